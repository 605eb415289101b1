"""The README's example runs as written, and every config key is documented."""

import re
from pathlib import Path

from oomb.train.config.keys import describe_keys

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


def test_readme_setup_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = [line for line in ci.splitlines() if "pytest" in line][0].strip()
    assert test_cmd in readme, "the README's test command and .ci/run differ"


def test_every_config_key_is_in_the_docs():
    doc = (ROOT / "docs" / "config.md").read_text()
    missing = [key for key, _, _ in describe_keys() if f"`{key}`" not in doc]
    assert not missing, f"docs/config.md lacks {missing}"
