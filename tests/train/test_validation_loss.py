"""The validation loss (oomb/train/eval/validation.py): its value, its held-out data, its schedule, a resume."""

import json
import re
import shutil

import pytest
import torch
from tiny_models import tiny_model

from oomb.cli import main
from oomb.train.config.presets import preset_config
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.data.corpus import byte_level_tokenizer
from oomb.train.data.inputs import build_inputs
from oomb.train.data.packing import PackedCorpus
from oomb.train.data.rows import open_rows
from oomb.train.data.windows import held_out
from oomb.train.eval.validation import build_validation, validation_loss
from oomb.train.loop.distributed import DistributedContext

FAST = ["data.seq_len=256", "train.chunk_size=128", "train.page_size=64", "train.device=cpu", "train.lr=0.01",
        "train.warmup_steps=1", "train.export=false"]
ONE = DistributedContext.single(torch.device("cpu"))  # a single process


@pytest.fixture
def text_dir(tmp_path):
    """40 documents, each naming itself: which run read which is visible in the tokens."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "docs.jsonl").write_text("".join(
        json.dumps({"text": f"<doc {i:02d}> " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 4)}) + "\n"
        for i in range(40)))
    return folder


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _documents(batches) -> set[str]:
    text = b"".join(bytes(t for t in b.input_ids.flatten().tolist() if t < 256) for b in batches).decode()
    return set(re.findall(r"<doc \d\d>", text))


def test_the_validation_loss_is_the_mean_token_loss_of_a_plain_forward(tmp_path, text_dir):
    model = tiny_model("llama", vocab_size=300)
    corpus = PackedCorpus(text_dir, byte_level_tokenizer(), 200, document_mask=True)
    batches = [corpus.batch(2) for _ in range(2)]
    cfg = load_config(None, ["train.chunk_size=64", "train.page_size=32"])
    got = validation_loss(model, batches, torch.device("cpu"), cfg)

    total, count = 0.0, 0
    with torch.no_grad():  # every document alone from position 0, as its document mask makes it
        for batch in batches:
            for ids, labels, docs in zip(batch.input_ids, batch.labels, batch.doc_ids, strict=True):
                for d in docs.unique():
                    seg_ids, seg_labels = ids[docs == d][None], labels[docs == d][None]
                    n = int((seg_labels[:, 1:] != -100).sum())
                    if n:
                        total += float(model(seg_ids, labels=seg_labels).loss) * n
                        count += n
    assert got == pytest.approx(total / count, rel=1e-5)
    assert got != pytest.approx(validation_loss(model, batches[:1], torch.device("cpu"), cfg), rel=1e-4)


def test_held_out_rows_are_never_trained_on_and_are_the_same_in_every_run(tmp_path, text_dir):
    config = preset_config("tiny")
    config.vocab_size = 300
    args = [*FAST, "data.task=text", f"data.paths=[{text_dir}]", "data.val_fraction=0.25", "train.val_batches=2"]
    inputs = build_inputs(load_config(None, args), config)
    validation = build_validation(load_config(None, args), inputs, ONE)
    held = _documents(validation.batches)
    trained = set()
    while inputs.corpus.rows.epoch == 0:
        trained |= _documents(inputs.batches(0))
    source = inputs.corpus.sources[0]
    rows = {r.value["text"][:8]: held_out(source, r.number, 0.25) for r in open_rows(source)}
    assert 5 <= sum(rows.values()) <= 15  # ~25% of 40
    assert trained == {doc for doc, out in rows.items() if not out}  # an epoch of training: every other row
    assert held and held <= {doc for doc, out in rows.items() if out}  # validation: held-out rows only
    other_seed = build_validation(load_config(None, [*args, "train.seed=7"]), inputs, ONE)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(validation.batches, other_seed.batches,
                                                                     strict=True))


def test_a_run_validates_at_its_steps_reports_it_and_resumes_on_schedule(tmp_path, capsys, model_dir, text_dir):
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "val.txt").write_text("a held-out text about foxes and dogs. " * 30)
    run = tmp_path / "run"
    args = [f"model.path={model_dir}", "data.task=text", f"data.paths=[{text_dir}]",
            f"data.val_paths=[{tmp_path / 'held'}]", "train.val_every=2", "train.val_batches=1", "train.steps=5",
            "train.save_every=1", "train.report_to=[jsonl,tensorboard]", *FAST]
    assert main(["train", f"out_dir={run}", *args]) == 0
    out = " ".join(capsys.readouterr().out.split())
    records = _metrics(run)
    validated = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(validated) == [2, 4, 5]  # every 2 steps and after the last
    assert validated[5] < validated[2]  # it learns the language the held-out text is in
    assert all(r["val_tokens"] == 255 for r in records if "val_loss" in r)
    assert "validation: 1 batch of 1 x 256 tokens (255 targets) from data.val_paths" in out
    assert f"validation loss {validated[5]:.4f} after step 5" in out
    assert f"step 4: loss {records[3]['loss']:.4f}, val_loss {validated[4]:.4f}" in out  # the progress lines
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/val_loss")} == pytest.approx(validated, rel=1e-6)

    copy = tmp_path / "copy"  # a crash after step 3: the resumed run validates at 4 and 5, the same values
    shutil.copytree(run, copy)
    assert main(["train", f"resume={copy / 'checkpoints' / 'step-00000003'}"]) == 0
    assert _metrics(copy) == [{**r, **{k: a[k] for k in ("seconds", "elapsed", "tokens_per_s", "eta_s",
                                                          "host_rss_gib")}}
                              for r, a in zip(records, _metrics(copy), strict=True)]


def test_passkey_runs_validate_on_sequences_they_never_train_on(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=2", "train.val_every=1", "train.val_batches=2",
                 *FAST]) == 0
    records = _metrics(run)
    assert [r["step"] for r in records if "val_loss" in r] == [1, 2]
    inputs = build_inputs(load_config(None, FAST), preset_config("tiny"))
    validation = build_validation(load_config(None, [*FAST, "train.val_every=1"]), inputs, ONE)
    trained = [inputs.batches(step)[0].input_ids for step in range(100)]
    assert not any(torch.equal(v.input_ids, t) for v in validation.batches for t in trained)


@pytest.mark.parametrize("args,match", [
    (["data.task=text", "train.val_every=5"], r"train.val_every=5 needs held-out data for data.task=text: set "
                                              r"data.val_paths .* or data.val_fraction"),
    (["data.task=text", "data.val_paths=[x]", "data.val_fraction=0.1"], "both choose held-out data: give one"),
    (["data.val_fraction=0.1"], r"data.val_fraction=0.1 needs data.task=text or data.task=chat"),
    (["data.task=text", "data.val_fraction=1.5"], r"data.val_fraction must be in \[0, 1\)"),
    (["train.val_batches=0"], "train.val_batches >= 1"),
    (["data.task=text", "data.val_paths=[/no/such/held]"], "data path /no/such/held does not exist"),
])
def test_bad_validation_settings_stop_before_work(tmp_path, capsys, model_dir, text_dir, args, match):
    out = tmp_path / "out"
    data = [f"data.paths=[{text_dir}]"] if "data.task=text" in args else []
    assert main(["train", f"out_dir={out}", f"model.path={model_dir}", *data, *FAST, *args]) == 2
    assert re.search(match, " ".join(capsys.readouterr().out.split())), match
    assert not out.exists()


def test_a_held_out_fraction_that_holds_nothing_is_refused(tmp_path):
    (tmp_path / "one.txt").write_text("a single document: a text file is held out whole, or not at all")
    config = preset_config("tiny")
    config.vocab_size = 300
    args = [*FAST, "data.task=text", f"data.paths=[{tmp_path / 'one.txt'}]"]
    # The file is not held out: nothing to validate on.
    inputs = build_inputs(load_config(None, [*args, "data.val_fraction=0.01"]), config)
    with pytest.raises(ConfigError, match="data.val_fraction: no row to read: .*held-out split.*held out whole"):
        build_validation(load_config(None, [*args, "data.val_fraction=0.01"]), inputs, ONE)
    with pytest.raises(ConfigError, match="data.paths: no row to read: .*held-out split"):
        build_inputs(load_config(None, [*args, "data.val_fraction=0.999"]), config)  # held out: nothing to train


def test_chat_validation_scores_the_assistant_tokens_of_held_out_conversations(tmp_path):
    from chat_tokenizer import PLAIN_TEMPLATE, chat_tokenizer

    chat_tokenizer(PLAIN_TEMPLATE).save_pretrained(tmp_path / "tokenizer")
    rows = [{"prompt": f"tell me {' '.join(['one', 'two', 'three'][: 1 + i % 3])} {i % 7}",
             "completion": f" {'yes' if i % 2 else 'no'} ."} for i in range(50)]  # plain text, as TRL reads it
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["data.seq_len=64", "data.task=chat", f"data.paths=[{tmp_path / 'chat.jsonl'}]",
            f"data.tokenizer={tmp_path / 'tokenizer'}", "data.val_fraction=0.2", "train.val_batches=2"]
    inputs = build_inputs(load_config(None, args), preset_config("tiny"))
    validation = build_validation(load_config(None, args), inputs, ONE)
    assert validation.notes[1].startswith("validation chat data: ") and "samples kept" in validation.notes[1]
    assert inputs.corpus.counts.rows + int(validation.notes[1].split(" of ")[1].split()[0]) == 50
    tokenizer = inputs.tokenizer
    for batch in validation.batches:  # loss only on what the assistant says, nothing on the prompts
        targets = batch.labels[batch.labels != -100].tolist()
        assert targets and set(tokenizer.convert_ids_to_tokens(targets)) <= {"yes", "no", ".", "</s>"}


def test_validation_runs_in_one_process_only():
    inputs = build_inputs(load_config(None, FAST), preset_config("tiny"))
    torchrun = DistributedContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="runs in one process for now: leave those keys out under torchrun"):
        build_validation(load_config(None, [*FAST, "train.val_every=2"]), inputs, torchrun)
    assert build_validation(load_config(None, FAST), inputs, torchrun) is None  # no validation: nothing to refuse
