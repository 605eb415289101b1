"""Inputs that would blow up (issue 42, item 4), through `oomb train`: JSON nested 100K deep in a data row, a run
folder's config.json, a checkpoint's manifest.json and state.json or a model's config.json, a model folder whose
weights are a pickle, YAML aliases: each exits with code 2 before any work, a short message that quotes at most a
line, no traceback, in bounded time and memory. An empty assistant reply is counted and dropped."""

import hashlib
import json
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch
from chat_tokenizer import PLAIN_TEMPLATE, chat_tokenizer
from tiny_models import tiny_model

from oomb.cli import main
from oomb.train.config.bounded import MAX_DEPTH, MAX_JSON_BYTES, TooDeep, loads_json
from oomb.train.data.chat_packing import ChatCorpus
from oomb.train.data.corpus import DataError

DEEP = 100_000
FAST = ["data.seq_len=128", "train.chunk_size=64", "train.page_size=32", "train.device=cpu", "train.export=false",
        "train.lr=0.01", "train.warmup_steps=1"]
NESTED = "[" * DEEP + "]" * DEEP
TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep"


def _refused(capsys, *args: str, code: int = 2) -> str:
    """`oomb train *args`: exit ``code`` with a short message and no traceback, in bounded time and memory; the
    message, from "config error:" on."""
    capsys.readouterr()  # what the test printed before
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux: the process's peak so far
    start = time.perf_counter()
    assert main(["train", *args]) == code
    seconds = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    printed = capsys.readouterr()
    said = printed.out + printed.err
    assert "Traceback" not in said and "RecursionError" not in said and "Error:" not in said, said[:2000]
    message = said[said.index("config error:"):].strip()
    lines = message.splitlines()
    assert len(lines) <= 2 and all(len(line) <= 600 for line in lines), message[:2000]  # quotes at most a line
    assert seconds < 120 and grown < 512 * 1024, (seconds, grown)  # no blow-up: seconds, not minutes; < 0.5 GiB
    return message


def test_loads_json_refuses_deep_nesting_before_parsing():
    with pytest.raises(TooDeep):
        loads_json(NESTED)
    with pytest.raises(TooDeep):
        loads_json('{"a": ' + "{" * DEEP + "}" * DEEP + "}")  # objects too
    assert loads_json(json.dumps({"s": "[" * DEEP})) == {"s": "[" * DEEP}  # brackets in strings are text
    deep_ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads_json(deep_ok) == json.loads(deep_ok)


# --- data rows --------------------------------------------------------------------------------------


def test_a_deep_data_row_is_refused_naming_its_file_and_line(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "hello there"}) + "\n\n" + '{"text": "x", "meta": ' + NESTED + "}\n")
    out = tmp_path / "run"
    said = _refused(capsys, f"out_dir={out}", "data.task=text", f"data.paths=[{data}]", *FAST)
    assert f"{data}:3:" in said and TOO_DEEP in said and "fix or remove that line" in said
    assert not out.exists()


def _chat_args(tmp_path) -> list[str]:
    chat_tokenizer(None).save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "chat.jinja").write_text(PLAIN_TEMPLATE)
    return ["data.task=chat", f"data.tokenizer={tmp_path / 'tokenizer'}",
            f"data.chat_template={tmp_path / 'chat.jinja'}"]


def test_a_deep_chat_row_is_refused_naming_its_file_and_line(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text(json.dumps(ok) + "\n" + '{"messages": [{"role": "user", "content": ' + NESTED + "}]}\n")
    said = _refused(capsys, f"out_dir={tmp_path / 'run'}", *_chat_args(tmp_path), f"data.paths=[{data}]", *FAST)
    assert f"{data}:2:" in said and TOO_DEEP in said


# --- empty assistant replies ------------------------------------------------------------------------


def _chat(user: str, reply: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply, **extra}]}


def test_empty_assistant_replies_are_counted_and_dropped(tmp_path):
    rows = [_chat("hi", "hello"), _chat("hi", ""), _chat("what", "  \n\t"), _chat("count to two", "one two"),
            {"prompt": "thanks", "completion": ""},  # TRL's string form: an empty completion too
            _chat("hi", "", tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{}"}}])]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = ChatCorpus(path, chat_tokenizer(), 64, shuffle=False)
    c = corpus.counts
    assert (c.rows, c.kept, c.empty_reply, c.too_long, c.no_loss) == (6, 3, 3, 0, 0)  # a tool call is a reply
    assert c.summary(64) == "chat data: 3 of 6 samples kept; 3 dropped: 3 with an empty assistant reply"
    for _ in range(6):  # no sequence holds a sample with an empty reply: every document but padding has loss
        batch = corpus.batch(1)
        docs, labels = batch.doc_ids[0], batch.labels[0]
        for d in range(int(docs[-1])):
            assert bool((labels[docs == d] != -100).any())
    # With data.loss_on=all too: an empty reply teaches the model to end its turn at once, whatever carries loss.
    assert ChatCorpus(path, chat_tokenizer(), 64, loss_on="all").counts.empty_reply == 3
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[1:3]))
    with pytest.raises(DataError, match="no sample can train: chat data: 0 of 2 samples kept; 2 dropped: 2 with an "
                                        "empty assistant reply"):
        ChatCorpus(path, chat_tokenizer(), 64)


def test_a_run_reports_the_samples_dropped_for_an_empty_reply(tmp_path, capsys):
    rows = [_chat("tell me one two", "one two ."), _chat("tell me three", "three ."), _chat("hi", " ")] * 4
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert main(["train", f"out_dir={out}", *_chat_args(tmp_path), f"data.paths=[{data}]", "train.steps=1",
                 *FAST]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "chat data: 8 of 12 samples kept; 4 dropped: 4 with an empty assistant reply" in said


# --- a run folder -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", f"out_dir={run}", "train.steps=2", "train.final_eval_samples=0", *FAST]) == 0
    return run


def _copy(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, copy / "checkpoints" / "step-00000002"


def test_a_deep_config_json_in_a_run_folder_is_refused_on_resume(finished_run, tmp_path, capsys):
    run, _ = _copy(finished_run, tmp_path)
    (run / "config.json").write_text('{"train": ' + NESTED + "}")
    said = _refused(capsys, f"resume={run}", "train.steps=3")
    assert f"{run / 'config.json'} is refused" in said and TOO_DEEP in said


def test_a_deep_manifest_json_is_refused_on_resume(finished_run, tmp_path, capsys):
    run, ckpt = _copy(finished_run, tmp_path)
    (ckpt / "manifest.json").write_text(NESTED)
    said = _refused(capsys, f"resume={run}", "train.steps=3")
    assert "cannot resume" in said and "manifest.json" in said and TOO_DEEP in said


def test_a_deep_state_json_is_refused_on_resume(finished_run, tmp_path, capsys):
    run, ckpt = _copy(finished_run, tmp_path)
    state = '{"step": 2, "data": ' + NESTED + "}"
    (ckpt / "state.json").write_text(state)
    manifest = json.loads((ckpt / "manifest.json").read_text())  # its checksum made to match, as anyone can
    manifest["state.json"] = {"bytes": len(state), "sha256": hashlib.sha256(state.encode()).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    said = _refused(capsys, f"resume={run}", "train.steps=3")
    assert "cannot resume" in said and "state.json" in said and TOO_DEEP in said


def test_deep_lines_of_metrics_and_config_json_are_set_aside_when_a_config_file_resumes(finished_run, tmp_path,
                                                                                        capsys):
    # Given a config file, resume= does not start from the run's config.json: a deep one is replaced (not kept as
    # config.before-step-N.json), and a deep metrics line is kept aside like one cut short by a kill.
    run, _ = _copy(finished_run, tmp_path)
    (run / "config.json").write_text('{"train": ' + NESTED + "}")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": ' + NESTED + "}\n")
    config = tmp_path / "resume.yaml"
    config.write_text("data:\n  seq_len: 128\ntrain:\n  chunk_size: 64\n  page_size: 32\n  device: cpu\n"
                      "  export: false\n  lr: 0.01\n  warmup_steps: 1\n  steps: 3\n  final_eval_samples: 0\n")
    capsys.readouterr()
    assert main(["train", str(config), f"resume={run}"]) == 0
    assert "Traceback" not in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (run / "metrics.rolled-back.jsonl").read_text() == '{"step": ' + NESTED + "}\n"
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 3
    assert not list(run.glob("config.before-step-*.json"))


# --- a model folder ---------------------------------------------------------------------------------


def test_pickled_weights_are_refused_before_loading_with_a_command_that_converts_them(tmp_path, capsys):
    folder = tmp_path / "model"
    model = tiny_model("llama", vocab_size=300)
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    out = tmp_path / "run"
    said = _refused(capsys, f"out_dir={out}", f"model.path={folder}", "train.steps=1", *FAST)
    assert "pickled PyTorch files (pytorch_model.bin)" in said and "safetensors" in said
    assert not out.exists()
    # The command the message gives converts the folder; the run then starts.
    command = shlex.split(re.search(r"the file: (python -c .*?) \(it writes", said).group(1))
    subprocess.run([sys.executable, *command[1:]], check=True, capture_output=True, timeout=600)
    assert (folder / "model.safetensors").is_file()
    assert main(["train", f"out_dir={out}", f"model.path={folder}", "train.steps=1", *FAST]) == 0


@pytest.mark.parametrize("text,expected", [
    ('{"model_type": "llama", "x": ' + NESTED + "}", TOO_DEEP),
    ('{"model_type": "llama"}' + " " * MAX_JSON_BYTES, "larger than 16 MiB"),
])
def test_a_deep_or_huge_model_config_is_refused(tmp_path, capsys, text, expected):
    folder = tmp_path / "model"
    tiny_model("llama", vocab_size=300).save_pretrained(folder)
    (folder / "config.json").write_text(text)
    said = _refused(capsys, f"out_dir={tmp_path / 'run'}", f"model.path={folder}", *FAST)
    assert f"{folder / 'config.json'} cannot be read as a model's config" in said and expected in said


# --- config files and overrides ---------------------------------------------------------------------


BOMB = "".join(f"{n}: &{n} [{', '.join([f'*{p}' if p else '1'] * 10)}]\n"
               for p, n in zip(["", *"abcdefgh"], "abcdefghi", strict=True))  # i stands for 10^9 leaves


@pytest.mark.parametrize("where", ["train.steps", "train.lr", "data.paths"])
def test_a_yaml_alias_bomb_in_a_typed_key_is_refused_without_its_expansion(tmp_path, capsys, where):
    section, key = where.split(".")
    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB + f"{section}:\n  {key}: *i\n")
    said = _refused(capsys, str(config))
    assert "found the alias *a" in said and "config files take no YAML aliases" in said
    said = _refused(capsys, f"{where}=[&a [1, 1], *a, *a]")  # on the command line too
    assert "found the alias *a" in said


def test_deep_yaml_and_a_key_given_twice_on_the_command_line_are_refused(tmp_path, capsys):
    config = tmp_path / "deep.yaml"
    config.write_text("train:\n  steps: " + NESTED + "\n")
    assert "nested more than" in _refused(capsys, str(config))
    assert "twice" in _refused(capsys, "train.steps=1", "train.steps=2")
