"""docs/chat.md's CPU part runs as written, and what it says about the run holds."""

import json
import re
import shlex
from pathlib import Path

from oomb.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_chat_doc_cpu_part_runs(tmp_path, monkeypatch, capsys):
    text = (ROOT / "docs" / "chat.md").read_text()
    cpu_part = text[text.index("## Try it on a CPU"): text.index("## On a GPU")]
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```(python|yaml|bash)\n(.*?)```", cpu_part, re.S)
    assert [kind for kind, _ in blocks] == ["python", "yaml", "bash"]
    for kind, body in blocks:
        if kind == "python":
            exec(compile(body, "docs/chat.md", "exec"), {})
        elif kind == "yaml":
            Path("chat.yaml").write_text(body)
        else:
            for line in body.splitlines():
                assert line.startswith("oomb train "), line
                assert main(shlex.split(line)[1:]) == 0, line
    assert "chat data: 80 of 80 samples kept" in capsys.readouterr().out
    run = tmp_path / "runs" / "chat"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7)) and all(0 < r["loss_tokens"] < 512 for r in records)

    from transformers import AutoTokenizer

    from oomb.train.data.chat import ChatTemplate

    tokenizer = AutoTokenizer.from_pretrained(run / "export")
    assert tokenizer.chat_template == Path("chat.jinja").read_text()
    first = json.loads(Path("chat.jsonl").read_text().splitlines()[0])["messages"]
    ids, mask = ChatTemplate(tokenizer).encode(first, "chat.jsonl:1")
    assert tokenizer.decode(ids[mask]) == "red-red.<|end|>\n"  # what the page says carries loss
