"""The benchmarks live outside the package: runnable as `python -m benchmarks.NAME`, refused clearly
without a GPU, and never imported by `oomb`."""

import ast
import importlib
from pathlib import Path

import pytest
import torch

from oomb.cli import main as oomb_main

ROOT = Path(__file__).resolve().parents[2]
GPU_BENCHES = ["core", "attention", "tune_attention", "sparse", "copy"]


@pytest.mark.parametrize("name", GPU_BENCHES)
def test_gpu_benchmark_refuses_without_cuda(name, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert importlib.import_module(f"benchmarks.{name}").main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_oomb_has_no_bench_command(capsys):
    with pytest.raises(SystemExit) as e:
        oomb_main(["bench", "core"])
    assert e.value.code == 2
    assert "invalid choice: 'bench'" in capsys.readouterr().err


def test_the_package_never_imports_benchmarks():
    offenders = []
    for path in sorted((ROOT / "oomb").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not offenders, f"oomb must not import the benchmarks folder: {offenders}"


def test_records_name_the_optional_kernels_installed_or_absent(monkeypatch):
    """flash-attn-4 and liger-kernel change what a step runs; a record says which versions ran, None if absent."""
    import importlib.metadata

    from benchmarks.common import RECORDED_DISTRIBUTIONS, library_versions

    real = importlib.metadata.version

    def version(name):
        if name == "flash-attn-4":
            raise importlib.metadata.PackageNotFoundError(name)
        return "9.9.9" if name == "liger-kernel" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    v = library_versions()
    assert list(v) == list(RECORDED_DISTRIBUTIONS)
    assert v["flash-attn-4"] is None and v["liger-kernel"] == "9.9.9"
    assert v["torch"] == torch.__version__ and v["transformers"] == real("transformers")
