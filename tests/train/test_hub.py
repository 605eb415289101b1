"""Hugging Face hub ids (oomb/train/config/hub.py) and datasets streamed through load_dataset, without a network.

No machine of the test suite reaches huggingface.co, so the hub code paths run against what
the hub leaves behind: a model snapshot in a Hugging Face cache (read offline, as from_pretrained
reads it), and dataset repositories as local folders, streamed by datasets.load_dataset exactly
as a hub id is.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny_models import tiny_model

from oomb.cli import main
from oomb.train.config.hub import looks_local, model_folder, parse_dataset_ref
from oomb.train.config.settings import ConfigError
from oomb.train.data.corpus import DataError, byte_level_tokenizer, find_sources
from oomb.train.data.packing import PackedCorpus
from oomb.train.data.rows import check_sources

ROOT = Path(__file__).resolve().parents[2]
FAST = ["data.seq_len=128", "train.chunk_size=64", "train.page_size=32", "train.device=cpu", "train.lr=0.01",
        "train.warmup_steps=1", "train.export=false"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cached_model(cache: Path, repo_id: str) -> Path:
    """A model snapshot laid out as huggingface_hub's cache holds one after a download."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    tiny_model("llama", vocab_size=300).save_pretrained(folder / "snapshots" / COMMIT)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    return folder / "snapshots" / COMMIT


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """What a machine without network sees: HF_HUB_OFFLINE=1 and a cache of its own (HF_HOME/hub)."""
    import datasets
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def _dataset_repo(root: Path, rows: int = 60) -> Path:
    """A dataset repository as the hub holds one (data/<split>-*.parquet), here a local folder."""
    (root / "data").mkdir(parents=True)
    texts = [f"row {i} " + "abcdefghij"[i % 10] * (3 + i % 17) for i in range(rows)]
    pq.write_table(pa.table({"text": texts, "n": list(range(rows))}), root / "data" / "train-00000-of-00001.parquet",
                   row_group_size=7)
    pq.write_table(pa.table({"text": ["held out one", "held out two"], "n": [0, 1]}),
                   root / "data" / "validation-00000-of-00001.parquet")
    return root


def test_dataset_names_are_local_paths_first_then_streams(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    repo = _dataset_repo(tmp_path / "repo")
    assert parse_dataset_ref("owner/name").split == "train"
    assert str(parse_dataset_ref("owner/name:validation")) == "owner/name:validation"
    ref = parse_dataset_ref("owner/name:sample-10BT:train")
    assert (ref.name, ref.config, ref.split) == ("owner/name", "sample-10BT", "train")
    assert parse_dataset_ref("repo") is None  # a bare local folder is searched for files, not streamed
    assert parse_dataset_ref("/no/such/folder") is None and parse_dataset_ref("a:b:c:d") is None
    assert [s.kind for s in find_sources(["repo"])] == ["parquet", "parquet"]
    (stream,) = find_sources(["repo:validation"])
    assert (stream.kind, stream.key, stream.ref.name) == ("stream", "repo:validation", str(Path("repo")))
    (hub,) = find_sources(["owner/name:test"])  # no such local path: a hub id, not read yet
    assert (hub.kind, hub.ref.split) == ("stream", "test")
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name.txt").write_text("local wins")
    assert [s.kind for s in find_sources(["owner/name.txt"])] == ["text"]
    assert repo.is_dir()


def test_a_mistyped_local_path_is_named_missing_without_asking_the_hub(tmp_path, monkeypatch):
    # Names that read as paths (a file suffix, a first folder that exists here, ./ or /) are never hub ids: a
    # missing one is said to be missing, with no network error in between.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "models").mkdir()
    import huggingface_hub

    def no_network(*args, **kw):
        raise AssertionError("the hub was asked about a local path")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    for name in ("notes.txt", "data/missing", "./corpus", "owner/books.jsonl"):
        assert looks_local(name), name
        assert parse_dataset_ref(name) is None
        with pytest.raises(DataError, match=f"data path {name.removeprefix('./')} does not exist"):
            find_sources([name])
    with pytest.raises(ConfigError, match="model.path='models/nope' does not exist"):
        model_folder("models/nope", weights=False)
    for name in ("owner/name", "Qwen/Qwen2.5-7B", "wikitext", "owner/name@v1.0"):  # hub ids stay hub ids
        assert not looks_local(name), name


def test_a_streamed_dataset_packs_exactly_as_its_file_does(tmp_path):
    repo = _dataset_repo(tmp_path / "repo")
    streamed = PackedCorpus(f"{repo}:train", byte_level_tokenizer(), 48, seed=3, window_rows=16)
    direct = PackedCorpus(repo / "data" / "train-00000-of-00001.parquet", byte_level_tokenizer(), 48, seed=3,
                          window_rows=16)
    assert streamed.sources[0].kind == "stream" and direct.sources[0].kind == "parquet"
    for _ in range(25):  # past the first epoch (the split holds ~1,100 tokens)
        a, b = streamed.batch(2), direct.batch(2)
        assert torch.equal(a.input_ids, b.input_ids)
    assert streamed.rows.epoch >= 1


def test_a_streamed_dataset_resumes_exactly_from_its_state_in_a_checkpoint(tmp_path):
    repo = _dataset_repo(tmp_path / "repo")
    straight = PackedCorpus(f"{repo}:train", byte_level_tokenizer(), 40, seed=1, window_rows=9)
    for _ in range(5):
        straight.batch(2)
    state = json.loads(json.dumps(straight.state_dict()))  # as state.json holds it
    assert state["window"] > 0 and state["start"]["state"]  # mid-split: the stream's own state
    expected = [straight.batch(2) for _ in range(20)]  # across windows and the end of the epoch
    resumed = PackedCorpus(f"{repo}:train", byte_level_tokenizer(), 40, seed=1, window_rows=9)
    resumed.load_state_dict(state)
    for want in expected:
        assert torch.equal(resumed.batch(2).input_ids, want.input_ids)
    assert straight.rows.epoch >= 1


def test_stream_errors_say_what_was_tried(tmp_path, offline_hub):
    repo = _dataset_repo(tmp_path / "repo")
    with pytest.raises(DataError, match=r"repo:nope: the dataset folder .*Bad split: nope. Available splits: "
                                        r"\['train', 'validation'\]"):
        check_sources(find_sources([f"{repo}:nope"]))
    with pytest.raises(DataError, match=r"someone/nothing:train: no local path .*someone/nothing; as a hub "
                                        r"dataset id it is streamed, never cached, and HF_HUB_OFFLINE=1 forbids "
                                        r"downloading it.*hf download --repo-type dataset someone/nothing"):
        check_sources(find_sources(["someone/nothing"]))
    with pytest.raises(DataError, match=r"data path /no/such/texts does not exist \(/no/such/texts\)$"):
        find_sources(["/no/such/texts"])  # a path, never a hub id
    with pytest.raises(DataError, match=r"data path a:b:c:d does not exist .*\(nor is it a Hugging Face hub dataset"):
        find_sources(["a:b:c:d"])  # neither
    (tmp_path / "other" / "data").mkdir(parents=True)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "other" / "data" / "train-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"other:train has no column 'text' \(columns: \['body'\]\); set "
                                        r"data.text_field"):
        check_sources(find_sources([f"{tmp_path / 'other'}:train"]))


def test_a_hub_model_id_loads_from_the_cache_offline_and_a_missing_one_says_where_it_looked(
        tmp_path, offline_hub, capsys):
    snapshot = _cached_model(offline_hub, "someone/tiny-a")
    assert model_folder("someone/tiny-a", weights=False) == snapshot
    assert model_folder("someone/tiny-a", weights=True) == snapshot
    with pytest.raises(ConfigError, match=r"model.path='someone/missing': no local path .*; as a hub model id it is "
                                          r"not in the cache .*hf/hub \(HF_HOME\), and HF_HUB_OFFLINE=1 forbids"):
        model_folder("someone/missing", weights=False)
    with pytest.raises(ConfigError, match=r"model.path='/no/such/model' does not exist \(/no/such/model\): give"):
        model_folder("/no/such/model", weights=False)
    _cached_model(offline_hub, "someone/tiny-b")  # a snapshot with its config but without weights
    (offline_hub / "models--someone--tiny-b" / "snapshots" / COMMIT / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"someone/tiny-b.*holds no weights"):
        model_folder("someone/tiny-b", weights=True)

    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "model.path=someone/missing", *FAST]) == 2
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in " ".join(capsys.readouterr().out.split())
    assert not run.exists()


def test_oomb_train_takes_a_hub_model_from_HF_HOME_and_a_streamed_dataset_and_resumes_exactly(tmp_path):
    """The whole path in a fresh process, as a user runs it: HF_HOME and HF_HUB_OFFLINE in the environment."""
    home = tmp_path / "hf"
    _cached_model(home / "hub", "someone/tiny-c")
    repo = _dataset_repo(tmp_path / "repo", rows=200)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    run = tmp_path / "run"
    args = ["model.path=someone/tiny-c", "data.task=text", f"data.paths=[{repo}:train]",
            f"data.val_paths=[{repo}:validation]", "train.steps=4", "train.save_every=2", *FAST]
    proc = subprocess.run([sys.executable, "-m", "oomb.cli", "train", f"out_dir={run}", *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and "val_loss" in records[-1]
    # Pinned to the commit it resolved to; the resume below builds it from the cache without asking the hub.
    assert json.loads((run / "config.json").read_text())["model"]["path"] == f"someone/tiny-c@{COMMIT}"

    copy = tmp_path / "copy"  # what a crash after step 2 leaves
    shutil.copytree(run, copy)
    proc = subprocess.run([sys.executable, "-m", "oomb.cli", "train",
                           f"resume={copy / 'checkpoints' / 'step-00000002'}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    again = [json.loads(x) for x in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again] == [r["loss"] for r in records]  # the same next batches after the resume
    final = "checkpoints/step-00000004/model.safetensors"
    assert (copy / final).read_bytes() == (run / final).read_bytes()


def test_a_revision_in_a_dataset_name():
    ref = parse_dataset_ref("owner/name@v1.2:sample-10BT:test")
    assert (ref.name, ref.revision, ref.config, ref.split) == ("owner/name", "v1.2", "sample-10BT", "test")
    assert str(ref) == "owner/name@v1.2:sample-10BT:test" and str(parse_dataset_ref(str(ref))) == str(ref)
    assert parse_dataset_ref(f"owner/name@{COMMIT}").revision == COMMIT
    assert parse_dataset_ref("owner/name").revision is None
    assert parse_dataset_ref("owner/name@:train") is None and parse_dataset_ref("@v1:train") is None


class _Hub:
    """huggingface_hub.HfApi.dataset_info as the hub answers it: the commit its main branch is at now."""

    def __init__(self, monkeypatch, sha: str):
        from huggingface_hub import HfApi

        self.sha, self.asked = sha, []
        monkeypatch.setattr(HfApi, "dataset_info", lambda api, name, **kw: self.answer(name))

    def answer(self, name):
        from types import SimpleNamespace

        self.asked.append(name)
        return SimpleNamespace(sha=self.sha)


def test_pinning_names_the_hub_commit_of_hub_datasets_only(tmp_path, monkeypatch):
    from oomb.train.config.hub import pin_dataset_revisions

    hub = _Hub(monkeypatch, COMMIT)
    repo = _dataset_repo(tmp_path / "repo")
    text = tmp_path / "a.txt"
    text.write_text("some text")
    paths = ["owner/name:train", "owner/other@v1:test", str(text), f"{repo}:train", str(tmp_path / "*.txt"),
             "owner/third"]
    assert pin_dataset_revisions(paths) == [f"owner/name@{COMMIT}:train", "owner/other@v1:test", str(text),
                                            f"{repo}:train", str(tmp_path / "*.txt"), f"owner/third@{COMMIT}:train"]
    assert hub.asked == ["owner/name", "owner/third"] and pin_dataset_revisions(None) is None


def test_pinning_offline_says_what_to_do(offline_hub):
    from oomb.train.config.hub import pin_dataset_revisions

    with pytest.raises(ConfigError, match=r"data.val_paths: .*HF_HUB_OFFLINE=1 forbids downloading it"):
        pin_dataset_revisions(["owner/name:test"], "data.val_paths")


def test_a_run_records_the_hub_commit_and_resumes_at_it_after_the_dataset_moved(tmp_path, monkeypatch):
    """A new run pins owner/name to the hub's commit; config.json records it; the resume streams that commit
    although the hub has moved on (datasets.load_dataset is pointed at a local copy of the repository)."""
    import datasets

    repo = _dataset_repo(tmp_path / "repo", rows=200)
    real = datasets.load_dataset
    streamed = []

    def load_dataset(name, *args, revision=None, **kw):
        streamed.append((name, revision))
        return real(str(repo) if name == "owner/name" else name, *args, **kw)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    hub = _Hub(monkeypatch, COMMIT)
    model = tmp_path / "model"
    tiny_model("llama", vocab_size=300).save_pretrained(model)
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", f"model.path={model}", "data.task=text", "data.paths=[owner/name:train]",
                 "train.steps=3", "train.save_every=1", *FAST]) == 0
    assert json.loads((run / "config.json").read_text())["data"]["paths"] == [f"owner/name@{COMMIT}:train"]
    assert streamed and set(streamed) == {("owner/name", COMMIT)} and hub.asked == ["owner/name"]
    first = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]

    hub.sha, streamed[:] = "f" * 40, []  # the dataset got a new commit on the hub
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "metrics.jsonl").write_text("\n".join((run / "metrics.jsonl").read_text().splitlines()[:1]) + "\n")
    shutil.rmtree(copy / "checkpoints" / "step-00000003")
    shutil.rmtree(copy / "checkpoints" / "step-00000002")
    assert main(["train", f"resume={copy / 'checkpoints' / 'step-00000001'}"]) == 0
    assert set(streamed) == {("owner/name", COMMIT)} and hub.asked == ["owner/name"]  # not asked again
    again = [json.loads(x)["loss"] for x in (copy / "metrics.jsonl").read_text().splitlines()]
    assert again == first


def test_a_pinned_hub_model_comes_from_the_cache_without_the_hub(tmp_path, offline_hub):
    # Offline, snapshot_download would list the repository for a commit whose file listing it did not cache: the
    # pinned commit is taken from the cache's snapshot when that holds the config and every weight file.
    from oomb.train.config.hub import pin_model_revision

    snapshot = _cached_model(offline_hub, "someone/tiny-p")
    assert model_folder(f"someone/tiny-p@{COMMIT}", weights=True) == snapshot
    assert pin_model_revision("someone/tiny-p") == f"someone/tiny-p@{COMMIT}"
    assert pin_model_revision(f"someone/tiny-p@{COMMIT}") == f"someone/tiny-p@{COMMIT}"
    assert pin_model_revision(str(snapshot)) == str(snapshot) and pin_model_revision(None) is None
    with pytest.raises(ConfigError, match=r"model.path='someone/tiny-p@' does not exist"):
        model_folder("someone/tiny-p@", weights=False)
    # oomb eval takes the pinned id as config.json records it.
    from oomb.train.eval.eval_model import load_eval_model

    assert load_eval_model(f"someone/tiny-p@{COMMIT}", torch.device("cpu")).model is not None
    # A sharded snapshot missing a shard is not taken from the cache (and offline nothing else can be had).
    sharded = _cached_model(offline_hub, "someone/tiny-s")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert model_folder(f"someone/tiny-s@{COMMIT}", weights=False) == sharded
    with pytest.raises(ConfigError, match=r"someone/tiny-s"):
        model_folder(f"someone/tiny-s@{COMMIT}", weights=True)


def test_a_lora_export_of_a_pinned_hub_model_names_its_id_and_commit(tmp_path, offline_hub):
    _cached_model(offline_hub, "someone/tiny-l")
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "model.path=someone/tiny-l", "lora.r=4", "lora.merge_on_export=false",
                 "train.steps=1", *FAST[:-1]]) == 0
    assert json.loads((run / "config.json").read_text())["model"]["path"] == f"someone/tiny-l@{COMMIT}"
    adapter = json.loads((run / "export" / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == ("someone/tiny-l", COMMIT)
