"""docs/trainer.md's CPU example runs as written and prints what the page says."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_trainer_doc_cpu_example_runs(tmp_path, monkeypatch, capsys):
    text = (ROOT / "docs" / "trainer.md").read_text()
    cpu_part = text[text.index("## Try it on a CPU"): text.index("## On a GPU")]
    (code,) = re.findall(r"```python\n(.*?)```", cpu_part, re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/trainer.md", "exec"), {})
    printed = capsys.readouterr().out
    (claim,) = re.findall(r"It prints `(loss [0-9.]+ -> [0-9.]+)`", cpu_part)
    assert claim in printed, printed[-2000:]
    eval_loss = float(re.search(r"'eval_loss': ([0-9.]+)", printed).group(1))
    assert abs(eval_loss - 1.2) < 0.1  # "an eval_loss near 1.2"
