"""fp32 master weights (oomb.train.loop.optim.MasterWeights): the optimizer equals fp32 training on the same
gradients, keeps updates bf16 rounds away, and runs of `oomb train` on masters resume exactly (after a
save, an out-of-memory optimizer step, a skipped non-finite step, and across the setting)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_model

import oomb.train.loop.trainer as trainer
from oomb.cli import main
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.loop.distributed import setup
from oomb.train.loop.faults import EXIT_OUT_OF_MEMORY, measure_memory
from oomb.train.loop.optim import MASTER_WEIGHTS_KEY, MasterWeights, build_optimizer, wants_master_weights

try:
    import bitsandbytes  # noqa: F401
except ImportError:
    OPTIMIZERS = ["adamw"]
else:
    OPTIMIZERS = ["adamw", "adamw8bit"]


def _params(dtype, seed=0) -> list[torch.nn.Parameter]:
    """A norm weight of ones, a matrix large enough for bitsandbytes' 8-bit states, a small bias."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(t.to(dtype)) for t in
            (torch.ones(64), torch.randn(128, 64, generator=g) * 0.02, torch.randn(16, generator=g) * 0.1)]


def test_updates_below_half_a_bf16_step_are_kept():
    # Constant gradients: each AdamW step moves a weight by lr (m / sqrt(v) = +-1). Near 1.0 the bf16 spacing
    # is 2^-7 above and 2^-8 below, so a step of 1e-3 rounds back to 1.0 every time on bf16 parameters.
    plain, mastered = _params(torch.bfloat16), _params(torch.bfloat16)
    grads = [torch.randn(p.shape).sign().to(torch.bfloat16) for p in plain]
    opt_plain = torch.optim.AdamW(plain, lr=1e-3, weight_decay=0.0)
    opt_master = build_optimizer("adamw", mastered, lr=1e-3, weight_decay=0.0, master_weights=True)
    assert isinstance(opt_master, MasterWeights)
    for _ in range(5):
        for ps in (plain, mastered):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
        opt_plain.step()
        opt_master.step()
    assert torch.equal(plain[0], torch.ones(64, dtype=torch.bfloat16))  # every update rounded away
    # On masters the weight moved 5e-3, more than half a bf16 step: every element changed, in the gradient's
    # opposite direction, to the bf16 value nearest its master.
    assert bool((mastered[0] != 1).all())
    assert torch.equal(torch.sign(mastered[0].float() - 1), -grads[0].float())
    master = opt_master.masters[0]
    torch.testing.assert_close(master, 1 - 5e-3 * grads[0].float(), rtol=0, atol=1e-6)
    assert torch.equal(mastered[0], master.to(torch.bfloat16))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_masters_equal_fp32_training_on_the_same_gradients(name):
    """The masters are bit for bit the parameters of an fp32 run given the same (clipped) gradients; the
    bf16 parameters are those rounded. Plain bf16 AdamW ends far from it. With LambdaLR, clipping, and an
    fp32 parameter (as LoRA adapters of a bf16 model) that is stepped as it is."""
    bf16 = _params(torch.bfloat16)
    adapter = torch.nn.Parameter(torch.randn(8, 8) * 0.1)  # fp32 beside the bf16 ones
    params = [*bf16, adapter]
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    make = dict(lr=3e-4, weight_decay=0.01)  # below half a bf16 step of the ones, about that of 0.1
    opts = {"masters": build_optimizer(name, params, master_weights=True, **make),
            "reference": build_optimizer(name, reference, **make), "plain": build_optimizer(name, plain, **make)}
    scheds = {k: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for k, o in opts.items()}
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # on the model's gradients, as the trainer does
        for ref, pl, p in zip(reference, plain, params, strict=True):
            ref.grad = p.grad.float()
            pl.grad = p.grad.clone()
        for k in opts:
            opts[k].step()
            scheds[k].step()
    assert opts["masters"].param_groups[0]["lr"] == opts["reference"].param_groups[0]["lr"] == 3e-4 / 13
    masters = opts["masters"].masters
    assert len(masters) == 3 and all(m.dtype == torch.float32 for m in masters)
    for m, p, ref in zip(masters, bf16, reference, strict=False):
        assert torch.equal(m, ref.detach()), "master != fp32 reference"
        assert torch.equal(p.detach(), ref.detach().to(torch.bfloat16)), "bf16 parameter != fp32 reference rounded"
    assert torch.equal(adapter.detach(), reference[3].detach())  # the fp32 parameter, stepped directly
    # Plain bf16 AdamW rounds every step: far from the reference rounded, the norm weight never moved.
    differ = sum(int((pl.detach() != ref.detach().to(torch.bfloat16)).sum())
                 for pl, ref in zip(plain[:3], reference[:3], strict=True))
    assert differ > 0.2 * sum(p.numel() for p in bf16), differ
    assert torch.equal(plain[0].detach(), torch.ones(64, dtype=torch.bfloat16))


def test_state_dict_holds_the_masters_and_a_state_without_them_starts_from_the_weights(tmp_path):
    params = _params(torch.bfloat16)
    opt = build_optimizer("adamw", params, lr=1e-3, weight_decay=0.0, master_weights=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.masters[0].add_(1e-3)  # a master that differs from its rounded parameter
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)  # tensors and plain data only
    assert sorted(saved[MASTER_WEIGHTS_KEY]) == [0, 1, 2]

    fresh = build_optimizer("adamw", [torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3,
                            weight_decay=0.0, master_weights=True)
    fresh.load_state_dict(saved)
    for a, b in zip(fresh.masters, opt.masters, strict=True):
        assert torch.equal(a, b)
    assert fresh.state[fresh.masters[1]]["exp_avg"].dtype == torch.float32

    # A plain bf16 AdamW's state (a checkpoint written without master weights): moments cast to fp32,
    # masters taken from the parameters (which a resume has just loaded).
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.AdamW(plain_params, lr=1e-3)
    for p in plain_params:
        p.grad = torch.ones_like(p)
    plain.step()
    into = build_optimizer("adamw", plain_params, lr=1e-3, weight_decay=0.0, master_weights=True)
    into.masters[0].zero_()
    into.load_state_dict(plain.state_dict())
    for m, p in zip(into.masters, plain_params, strict=True):
        assert torch.equal(m, p.detach().float())
    exp_avg = into.state[into.masters[1]]["exp_avg"]
    assert exp_avg.dtype == torch.float32 and torch.equal(exp_avg, plain.state[plain_params[1]]["exp_avg"].float())

    with pytest.raises(ValueError, match="master weights are for parameters"):
        other = build_optimizer("adamw", _params(torch.bfloat16)[:2] + [torch.nn.Parameter(torch.ones(16))],
                                lr=1e-3, weight_decay=0.0, master_weights=True)
        other.load_state_dict(saved)


def test_zero_grad_memory_and_the_fp32_no_op():
    model = tiny_model("llama").to(torch.bfloat16)
    opt = build_optimizer("adamw", list(model.parameters()), lr=1e-3, weight_decay=0.0, master_weights=True)
    n = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(p.grad is None for p in model.parameters()) and all(m.grad is None for m in opt.masters)
    use = measure_memory(model, opt)
    assert use.master_weights == 4 * n and use.parameters == 2 * n
    assert use.optimizer_state == 8 * n + 4 * len(opt.masters)  # fp32 exp_avg, exp_avg_sq; step scalars
    # fp32 parameters need no master: true and auto give the plain optimizer.
    fp32 = list(tiny_model("llama").parameters())
    assert type(build_optimizer("adamw", fp32, lr=1e-3, weight_decay=0.0, master_weights=True)) is torch.optim.AdamW


def test_setting_values_and_torchrun(monkeypatch):
    assert wants_master_weights("auto", torchrun=False) and wants_master_weights(True, torchrun=False)
    assert not wants_master_weights("auto", torchrun=True) and not wants_master_weights(False, torchrun=False)
    with pytest.raises(ConfigError, match="train.master_weights='always': use auto"):
        wants_master_weights("always", torchrun=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    cfg = load_config(None, ["train.master_weights=true", "train.device=cpu"])
    with pytest.raises(ConfigError, match="single-process only for now"):
        setup(cfg)  # refused before the process group starts


# ------------------------------------------------------------------------------------------ runs
STEPS = 8
LR = "0.0002"  # AdamW moves a weight by about lr per step: below half a bf16 step for |w| > ~0.1


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same 8-step run of a tiny llama in fp32, in bf16 on masters (the default) and in bf16 without.

    Its weights are bf16 values, so all three start from the same point.
    """
    root = tmp_path_factory.mktemp("master_weights")
    model = tiny_model("llama")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(root / "model")
    out = {"model": root / "model"}
    for name, extra in (("fp32", "model.dtype=float32"), ("masters", "model.dtype=bfloat16"),
                        ("plain", "model.dtype=bfloat16 train.master_weights=false")):
        out[name] = root / name
        assert main(["train", f"out_dir={out[name]}", *_run_args(root / "model"), *extra.split()]) == 0
    return out


def _run_args(model: Path) -> list[str]:
    return [f"model.path={model}", "data.seq_len=256", "train.chunk_size=128", "train.page_size=64",
            "train.device=cpu", f"train.lr={LR}", "train.warmup_steps=0", "train.min_lr_ratio=1.0",
            f"train.steps={STEPS}", "train.save_every=2", "train.export=false"]


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def _weights(run: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(_ckpt(run, step) / "model.safetensors")


def _masters(run: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The fp32 masters of a checkpoint by parameter name (the optimizer's order is the model's)."""
    opt = torch.load(_ckpt(run, step) / "optimizer.pt", weights_only=True)["optimizer"]
    masters = opt[MASTER_WEIGHTS_KEY]
    names = list(_weights(run, step))  # safetensors sorts names; the optimizer follows parameters()
    order = [n for n, _ in tiny_model("llama").named_parameters() if n in names]
    return {order[i]: t for i, t in masters.items()}


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_masters_move_what_bf16_rounds_away_and_track_fp32(runs, capsys):
    plain, masters, fp32 = _weights(runs["plain"]), _weights(runs["masters"]), _weights(runs["fp32"])
    saved = _masters(runs["masters"])
    norms = [n for n in plain if "norm" in n]
    assert norms and all(bool((plain[n] == 1).all()) for n in norms)  # no norm weight ever moved from 1.0
    assert all(bool((saved[n] != 1).all()) for n in norms)  # on masters every one did
    for name, master in saved.items():  # the model's weights are the masters rounded to nearest
        assert master.dtype == torch.float32 and torch.equal(masters[name], master.to(torch.bfloat16)), name
    init = load_file(runs["model"] / "model.safetensors")

    def error(weights):  # distance to the fp32 run, relative to how far the fp32 run moved
        moved = sum(float((fp32[n] - init[n]).norm()) ** 2 for n in fp32) ** 0.5
        return sum(float((weights[n].float() - fp32[n]).norm()) ** 2 for n in fp32) ** 0.5 / moved

    # bf16 forward and backward differ from fp32 in both; without masters the updates are lost on top.
    assert error(masters) < 0.6 * error(plain), (error(masters), error(plain))
    assert json.loads((_ckpt(runs["masters"], 2) / "state.json").read_text())["master_weights"] is True
    assert json.loads((_ckpt(runs["plain"], 2) / "state.json").read_text())["master_weights"] is False


def test_resume_on_masters_is_exact(runs, tmp_path):
    run = _copy(runs["masters"], tmp_path / "copy")
    assert main(["train", f"resume={_ckpt(run, 4)}"]) == 0
    assert _losses(run) == _losses(runs["masters"])
    for name in ("model.safetensors", "optimizer.pt"):
        assert (_ckpt(run, STEPS) / name).read_bytes() == (_ckpt(runs["masters"], STEPS) / name).read_bytes(), name


def test_out_of_memory_in_the_master_step_resumes_exactly(runs, tmp_path, monkeypatch, capsys):
    calls = [0]
    real_step = torch.optim.AdamW.step

    def failing_step(self, *args, **kwargs):  # AdamW.step of the masters, inside MasterWeights.step
        calls[0] += 1
        if calls[0] == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", failing_step)
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", *_run_args(runs["model"]), "model.dtype=bfloat16"]) == EXIT_OUT_OF_MEMORY
    out = " ".join(capsys.readouterr().out.split())
    assert "out of memory in the optimizer step of step 5" in out and "fp32 master weights" in out
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000004"]
    monkeypatch.undo()
    assert main(["train", f"resume={run}"]) == 0
    assert _losses(run) == _losses(runs["masters"])
    got, want = _weights(run), _weights(runs["masters"])
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_a_skipped_nonfinite_step_leaves_the_masters(runs, tmp_path, monkeypatch, capsys):
    real = trainer._forward_backward
    calls = [0]

    def poisoned(run, batches, on_chunk=None):
        loss, norm = real(run, batches, on_chunk)
        calls[0] += 1
        if calls[0] == 3:
            run.params[0].grad.view(-1)[0] = float("nan")
            norm = torch.tensor(float("nan"))
        return loss, norm

    monkeypatch.setattr(trainer, "_forward_backward", poisoned)
    run = tmp_path / "run"
    args = [a for a in _run_args(runs["model"]) if not a.startswith(("train.steps=", "train.save_every="))]
    assert main(["train", f"out_dir={run}", *args, "model.dtype=bfloat16", "train.steps=4",
                 "train.save_every=1", "train.on_nonfinite=skip"]) == 0
    assert "step skipped (no update)" in " ".join(capsys.readouterr().err.split())
    before, after = _masters(run, 2), _masters(run, 3)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not all(torch.equal(after[n], m) for n, m in _masters(run, 4).items())  # the next step moved them
    assert _losses(run)[:2] == _losses(runs["masters"])[:2]


@pytest.mark.parametrize("source,setting,note", [
    ("plain", "train.master_weights=auto", "was written without fp32 master weights: they start from its"),
    ("masters", "train.master_weights=false", "holds fp32 master weights, which this run does not use"),
])
def test_resume_across_the_setting(runs, tmp_path, capsys, source, setting, note):
    run = _copy(runs[source], tmp_path / "copy")
    assert main(["train", f"resume={_ckpt(run, 4)}", setting]) == 0
    assert note in " ".join(capsys.readouterr().out.split())
    # Step 5 runs on the checkpoint's weights either way: the same loss as the run that wrote it.
    assert _losses(run)[:5] == _losses(runs[source])[:5]
    on = setting.endswith("auto")
    assert json.loads((_ckpt(run, STEPS) / "state.json").read_text())["master_weights"] is on
    opt = torch.load(_ckpt(run, STEPS) / "optimizer.pt", weights_only=True)["optimizer"]
    assert (MASTER_WEIGHTS_KEY in opt) is on


def test_bad_setting_stops_before_work(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", f"out_dir={out}", "train.device=cpu", "train.master_weights=sometimes"]) == 2
    assert "train.master_weights='sometimes': use auto" in " ".join(capsys.readouterr().out.split())
    assert not out.exists()
