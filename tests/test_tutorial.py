"""docs/tutorial.md's CPU part runs as written: its python blocks, its YAML config and its oomb commands."""

import json
import re
import shlex
from pathlib import Path

from oomb.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_tutorial_cpu_part_runs(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "tutorial.md").read_text()
    cpu_part = text[: text.index("## On a GPU")]
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```(python|yaml|bash)\n(.*?)```", cpu_part, re.S)
    assert [kind for kind, _ in blocks] == ["python", "yaml", "bash", "bash", "python"]
    for kind, body in blocks:
        if kind == "python":
            exec(compile(body, "docs/tutorial.md", "exec"), {})
        elif kind == "yaml":
            Path("tutorial.yaml").write_text(body)
        else:
            for line in body.splitlines():
                assert line.startswith("oomb train "), line
                assert main(shlex.split(line)[1:]) == 0, line
    run = tmp_path / "runs" / "tutorial"
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # 6 steps, then 2 more after the resume
    for name in ("config.json", "training.png", "tensorboard", "checkpoints/latest", "export/tokenizer.json"):
        assert (run / name).exists(), name
