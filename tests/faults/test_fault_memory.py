"""Out of memory inside a step (CUDA's error, a failed host allocation, Python's MemoryError) and in
the optimizer step: the run stops with what used the memory and which setting to change; the model,
optimizer and checkpoints are intact and the run resumes with the suggested setting."""

import pytest
import torch
from faultrun import RUN, assert_resumes_exactly, run_process, step_of

from oomb.engine import chunked_backward, release_memory
from oomb.train.config.presets import build_model
from oomb.train.config.settings import load_config
from oomb.train.loop.faults import EXIT_OUT_OF_MEMORY, measure_memory, memory_report
from oomb.train.runfolder.checkpoint import find_checkpoint, list_checkpoints


@pytest.mark.parametrize("fault,error", [
    ("oom-cuda", "OutOfMemoryError: CUDA out of memory"),
    ("oom-host", "RuntimeError: [enforce fail at alloc_cpu.cpp"),
    ("memoryerror", "MemoryError"),
])
def test_out_of_memory_mid_step_saves_the_last_step_and_resumes(tmp_path, straight, fault, error):
    run = tmp_path / "run"
    proc = run_process(fault, f"out_dir={run}", *RUN, fault_step=4)  # save_every=0: no checkpoint before
    assert proc.returncode == EXIT_OUT_OF_MEMORY, (proc.stdout, proc.stderr)
    out = " ".join(proc.stdout.split())  # undo the console's line wrapping
    assert f"out of memory in the forward/backward pass of step 4: {error}" in out
    for row in ("parameters", "gradients", "optimizer state (AdamW)", "K/V store (pages + gradient pages)",
                "process resident (host RSS)"):
        assert row in out
    assert "train.chunk_size=256: one chunk's activations" in out and "train.layer_checkpointing=true" in out
    assert "The model and optimizer are as after step 3 and were saved to" in out
    assert f"oomb train resume={run} train.chunk_size=128" in out
    assert step_of(find_checkpoint(run)) == 3
    # The suggested command: smaller chunks, the same gradient up to summation order.
    assert_resumes_exactly(run, straight, "train.chunk_size=128", rel=1e-5)


def test_out_of_memory_in_the_optimizer_step_keeps_the_last_checkpoint(tmp_path, straight):
    run = tmp_path / "run"
    proc = run_process("oom-optimizer", f"out_dir={run}", "train.save_every=2", *RUN, fault_step=3)
    assert proc.returncode == EXIT_OUT_OF_MEMORY, (proc.stdout, proc.stderr)
    out = " ".join(proc.stdout.split())
    assert "out of memory in the optimizer step of step 3" in out
    assert "may be partly updated: they are not saved" in out
    assert [c.name for c in list_checkpoints(run)] == ["step-00000002"]
    assert_resumes_exactly(run, straight)


def test_memory_report_measures_each_holder_and_has_room_for_a_plan():
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    chunked_backward(model, torch.randint(0, 64, (1, 256)), chunk_size=128, page_size=64)
    optimizer.step()
    use = measure_memory(model, optimizer)
    n = sum(p.numel() for p in model.parameters())
    assert use.parameters == 4 * n and use.gradients == 4 * n
    assert use.optimizer_state == 2 * 4 * n + 4 * len(list(model.parameters()))  # exp_avg, exp_avg_sq, step
    # layers, KV heads, head dim, fp32 bytes; K, V, dK, dV
    assert use.kv_store > 0 and use.kv_store_bytes_per_token == 2 * 2 * 32 * 4 * 4
    assert use.process_rss > 0 and use.cuda_allocated is None
    cfg = load_config(None, ["train.chunk_size=128"])
    plain = memory_report(use, cfg)
    assert "planned" not in plain and "K/V store" in plain
    planned = memory_report(use, cfg, estimate={"kv_store": 3 * 2**30})
    assert "planned" in planned and "3.00 GiB" in planned
    release_memory(model)
    assert measure_memory(model, optimizer).kv_store == 0


def test_a_gpu_that_ran_out_is_told_what_moves_to_the_host_and_what_held_the_run_back():
    from oomb.train.loop.faults import MemoryUse, memory_advice

    gib = 2**30
    use = MemoryUse(parameters=5 * gib, gradients=gib // 4, optimizer_state=gib // 8, kv_store=3 * gib,
                    kv_store_bytes_per_token=None, process_rss=30 * gib, process_peak_rss=30 * gib,
                    cuda_allocated=22 * gib, cuda_reserved=22 * gib, cuda_peak_allocated=22 * gib, cuda_total=79 * gib)
    capped = load_config(None, ["model.preset=llama-3-8b", "lora.r=32", "train.gpu_memory=23.6GiB",
                                "train.recompute=chunk", "data.seq_len=65536"])
    model = build_model("tiny", dtype=torch.float32, device="cpu").train()  # layers it can rebuild one at a time
    advice = memory_advice(use, capped, model)
    # the cap is what held it back (55 GiB of the card unused): first
    assert advice[0].startswith("train.gpu_memory=23.6GiB: the run is held to it on a card of 79.0")
    assert any(a.startswith("train.offload=true: the K/V pages") for a in advice)
    capped.train.cache_attention = True  # as a run settles it: offload needs the cache moved too
    assert any(a.startswith("train.offload=true train.cache_attention=host: the K/V pages")
               for a in memory_advice(use, capped, model))
    capped.train.cache_attention = "auto"
    assert any(a.startswith("train.recompute=layer-host:") for a in advice)
    import peft

    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert any(a.startswith("train.recompute=layer-host:") for a in memory_advice(use, capped, lora))  # peft's too
    assert not any(a.startswith("train.recompute") for a in memory_advice(use, capped, torch.nn.Linear(2, 2)))
    cfg = load_config(None, ["model.preset=llama-3-8b", "lora.r=32", "train.offload=true",
                             "train.recompute=layer-host", "data.seq_len=65536"])
    advice = memory_advice(use, cfg, model)  # offloaded already, by layer already, no cap: none of the three
    assert not any(a.startswith(("train.gpu_memory", "train.offload", "train.recompute")) for a in advice)
    host = MemoryUse(**{**use.__dict__, "cuda_allocated": None, "cuda_reserved": None, "cuda_peak_allocated": None,
                        "cuda_total": None})
    on_host = memory_advice(host, capped, model)  # the host ran out, not the GPU: no GPU advice
    assert not any(a.startswith(("train.gpu_memory", "train.offload", "train.recompute")) for a in on_host)
