"""benchmarks/h200.sh: valid bash, one job per record, and every command it would run names a real module,
test file or script with options that module accepts (checked by parsing them, nothing is run)."""

import argparse
import importlib
import json
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "h200.sh"
RESULTS = ROOT / "benchmarks" / "results"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def _parts() -> dict[str, list[str]]:
    listing = _run("--list")
    assert listing.returncode == 0, listing.stderr
    return {name: jobs.split() for name, jobs in (line.split(":", 1) for line in listing.stdout.splitlines())}


def _jobs(*names: str) -> dict[str, list[list[str]]]:
    """Each job's commands, as the shell would split them (continuation lines joined, $OUT left as is)."""
    dry = _run("--dry-run", *names)
    assert dry.returncode == 0, dry.stderr
    jobs = {}
    for block in dry.stdout.split("### ")[1:]:
        name, body = block.split("\n", 1)
        statements = body.replace("\\\n", " ").splitlines()
        jobs[name] = [shlex.split(s) for s in statements if s.strip()]
    return jobs


class _Parsed(Exception):
    pass


def _parses(module: str, argv: list[str], monkeypatch) -> None:
    """`module`'s main accepts `argv`: its argparse parser runs and returns (then main stops, before any work)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)  # SystemExit(2) with the parser's message on an unknown option
        raise _Parsed

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(_Parsed):
            importlib.import_module(module).main(argv)


def test_script_is_valid_bash_and_refuses_unknown_parts():
    for script in (SCRIPT, ROOT / "benchmarks" / "longrun.sh"):
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    wrong = _run("--dry-run", "cores")
    assert wrong.returncode == 2 and "no part or job 'cores'" in wrong.stderr
    assert _run().returncode == 2  # nothing asked for: the usage, not every part


def test_every_record_has_a_job_that_writes_it():
    jobs = {job for part in _parts().values() for job in part}
    records = {p.name.removesuffix(".json") for p in RESULTS.glob("*.json")}
    assert records, "no records under benchmarks/results"
    assert records <= jobs, f"records no job of h200.sh reproduces: {sorted(records - jobs)}"
    for name, statements in _jobs("all").items():
        if name in records:
            written = " ".join(" ".join(s) for s in statements)
            assert f"$OUT/{name}.json" in written, f"job {name} does not write $OUT/{name}.json"


def test_every_command_names_a_real_module_and_its_options(monkeypatch):
    checked = 0
    for name, statements in _jobs("all").items():
        for words in statements:
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # VAR=value before a command
            words = [w for w in words if w != "2>&1"]
            # ${VAR:-default}: the default, what runs where the caller sets nothing
            words = [w[w.index(":-") + 2 : -1] if w.startswith("${") and ":-" in w else w for w in words]
            if ">" in words:
                words = words[:words.index(">")]
            if words[:3] == ["python3", "-m", "pytest"]:
                options_values = ("gpu", "no:cacheprovider")  # of -m and -p
                paths = [w.split("::")[0] for w in words[3:] if not w.startswith("-") and w not in options_values]
                assert paths and all((ROOT / p).exists() for p in paths), f"{name}: {words}"
            elif words[:2] == ["python3", "-m"] and words[2].startswith("benchmarks."):
                _parses(words[2], words[3:], monkeypatch)
            elif words[:1] == ["bash"]:
                assert (ROOT / words[1]).is_file(), f"{name}: no {words[1]}"
            else:
                assert words[0] in ("cp", "rm"), f"{name}: a command the test does not know: {words}"
            checked += 1
    assert checked >= 30


def test_a_wrong_option_is_caught(monkeypatch):
    with pytest.raises(SystemExit):
        _parses("benchmarks.core", ["--lengths", "", "--chunks", "8192"], monkeypatch)


def test_records_name_their_machine_date_and_command():
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        missing = [k for k in ("machine", "date", "command") if not record.get(k)]
        assert not missing, f"{path.name} lacks {missing}"
