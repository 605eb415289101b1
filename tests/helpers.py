"""Comparison helpers with verbose failure messages, and a spy on the offloaded store's page copies."""

from __future__ import annotations

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are zero)."""
    x, ref = x.detach().double(), ref.detach().double()
    denom = ref.norm()
    if denom == 0:
        return float((x - ref).norm())
    return float((x - ref).norm() / denom)


def assert_close_rel(x: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "tensor") -> None:
    assert x.shape == ref.shape, f"{what}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{what}: {int((~torch.isfinite(x)).sum())} non-finite values"
    err = rel_err(x, ref)
    if err > tol:
        diff = (x.double() - ref.double()).abs()
        idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        raise AssertionError(
            f"{what}: relative error {err:.3e} > {tol:.1e}; worst at {idx}: {x[idx].item()} vs {ref[idx].item()}"
        )


def overridden(args, *changes: str) -> list[str]:
    """key=value ``args`` with ``changes`` in place of the same keys (a command line gives each key once)."""
    keys = {change.partition("=")[0] for change in changes}
    return [arg for arg in args if arg.partition("=")[0] not in keys] + list(changes)


def copy_kernel_calls(monkeypatch, store) -> list[bool]:
    """Send an offloaded ``store``'s page copies through the copy kernel (Triton's interpreter on the CPU, its CUDA
    path) and record each copy's ``use_kernel``: the list fills as the store copies."""
    import oomb.offload.host_pages as host_pages

    store.copy_kernels = True
    calls, real = [], host_pages.copy_pages

    def counted(*a, **k):
        calls.append(k.get("use_kernel"))
        return real(*a, **k)

    monkeypatch.setattr(host_pages, "copy_pages", counted)
    return calls
