"""stream_summary: per-stream busy time and the compute stream's gaps, from trace events."""

from benchmarks.timeline import kernel_group, stream_summary


def _kernel(stream, ts, dur, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_compute_stream_gaps_and_other_streams():
    events = [
        _kernel(7, 0, 100, "gemm"), _kernel(7, 150, 50, "attn"), _kernel(7, 300, 100, "gemm"),  # 250 us busy
        _kernel(13, 90, 40, "copy_pages"),  # overlaps the compute stream
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 200, "dur": 80, "args": {"stream": 13}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000, "args": {}},  # not GPU work
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 100, "dur": 60, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 5, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 20, "dur": 5, "args": {}},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5, "args": {"stream": 7}},  # not a span
    ]
    s = stream_summary(events)
    assert s["compute_stream"] == 7
    assert s["wall_ms"] == 0.4  # 0 .. 400 us: host calls are not GPU work
    assert s["host_calls"] == [("cudaStreamSynchronize", 0.06, 1), ("cudaLaunchKernel", 0.01, 2)]
    assert s["compute_busy_ms"] == 0.25 and abs(s["compute_idle_ms"] - 0.15) < 1e-12
    copy = s["streams"]["13"]
    assert copy["kernels"] == 1 and copy["copies"] == 1 and copy["busy_ms"] == 0.12
    assert s["top_kernels"][0] == ("gemm", 0.2, 2)
    assert s["kernel_groups"] == {"matmul": {"ms": 0.2, "count": 2}, "other": {"ms": 0.05, "count": 1}}
    assert copy["groups"] == {"page copies": {"ms": 0.04, "count": 1}}
    # idle: 100..150 between gemm and attn, 200..300 between attn and gemm
    assert [(a, b, round(ms, 6), n) for a, b, ms, n in s["top_gaps"]] == [("attn", "gemm", 0.1, 1),
                                                                       ("gemm", "attn", 0.05, 1)]


def test_kernel_groups_name_our_kernels_and_library_matmuls():
    assert kernel_group("_fwd_kernel") == "attention forward"
    assert kernel_group("_bwd_dkdv_sparse_kernel") == "attention dk/dv"
    assert kernel_group("_bwd_dq_kernel") == "attention dq"
    assert kernel_group("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN") == "matmul"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert kernel_group("some_new_kernel") == "other"
    assert kernel_group("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_0") == \
        "attention forward (FA4)"
    assert kernel_group("kernel_flash_attn_cute_FlashAttentionBackwardSm90_object") == "attention backward (FA4)"
    assert kernel_group("_rms_norm_forward_kernel") == "norm"
    assert kernel_group("_triton_rope") == "rope"
    assert kernel_group("void at::native::index_elementwise_kernel<128, 4, ...>") == "gather/scatter"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == "fill"


def test_overlapping_spans_count_once():
    s = stream_summary([_kernel(1, 0, 100), _kernel(1, 50, 100), _kernel(1, 300, 10)])
    assert s["streams"]["1"]["busy_ms"] == 0.16  # 0..150 and 300..310
    assert abs(s["streams"]["1"]["kernel_ms"] - 0.21) < 1e-12  # summed durations
    assert stream_summary([])["compute_stream"] is None


def test_copies_are_attributed_to_the_op_and_oomb_frame_that_queued_them():
    def span(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}

    events = [
        span("python_function", "oomb/engine/step.py(10): chunked_backward", 0, 1000),
        span("python_function", "oomb/sparse/selection.py(120): select_pages", 100, 200),
        span("python_function", "torch/_tensor.py(5): __setitem__", 150, 30),  # not oomb's: skipped
        span("cpu_op", "aten::copy_", 155, 20),
        span("cuda_runtime", "cudaMemcpyAsync", 160, 10, correlation=1),
        span("cpu_op", "aten::topk", 400, 50),  # only the step's frame around it
        span("cuda_runtime", "cudaMemsetAsync", 410, 5, correlation=2),
        span("cuda_runtime", "cudaMemcpyAsync", 420, 5, correlation=3),
        span("cpu_op", "aten::add", 2000, 10, tid=2),  # another thread, no frames
        span("cuda_runtime", "cudaMemcpyAsync", 2002, 3, tid=2, correlation=4),
        span("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 170, 4, stream=7, correlation=1),
        span("gpu_memset", "Memset (Device)", 420, 2, stream=7, correlation=2),
        span("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 430, 6, stream=7, correlation=3),
        span("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 2010, 8, stream=7, correlation=4),
        span("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 3000, 1, stream=7, correlation=99),  # no host call
        _kernel(7, 0, 10),
    ]
    rows = stream_summary(events)["copies_by_op"]
    got = {(copy, op, frame): (round(ms, 6), n) for copy, op, frame, ms, n in rows}
    assert got == {
        ("Memcpy HtoD (Pageable -> Device)", "aten::copy_", "oomb/sparse/selection.py(120): select_pages"): (0.004, 1),
        ("Memcpy HtoD (Pageable -> Device)", "aten::topk", "oomb/engine/step.py(10): chunked_backward"): (0.006, 1),
        ("Memset (Device)", "aten::topk", "oomb/engine/step.py(10): chunked_backward"): (0.002, 1),
        ("Memcpy HtoD (Pageable -> Device)", "aten::add", "?"): (0.008, 1),
        ("Memcpy DtoD (Device -> Device)", "?", "?"): (0.001, 1),
    }


def test_gpu_time_goes_to_the_innermost_oomb_range_around_its_launch():
    def span(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}

    events = [
        span("user_annotation", "oomb.attention.forward.window", 0, 100),
        span("cuda_driver", "cuLaunchKernel", 10, 5, correlation=1),
        span("user_annotation", "oomb.attention.forward.full", 200, 100),
        span("user_annotation", "oomb.inner", 210, 20),  # nested: its launch counts for it alone
        span("cuda_runtime", "cudaLaunchKernel", 215, 2, correlation=2),
        span("cuda_runtime", "cudaLaunchKernel", 250, 2, correlation=3),
        span("cuda_runtime", "cudaMemcpyAsync", 260, 2, correlation=4),
        span("user_annotation", "ProfilerStep#1", 300, 50),  # not oomb's
        span("cuda_runtime", "cudaLaunchKernel", 310, 2, correlation=5),
        span("user_annotation", "oomb.attention.forward.window", 400, 100, tid=2),  # another thread's range
        span("cuda_runtime", "cudaLaunchKernel", 450, 2, tid=2, correlation=6),
        span("kernel", "k1", 20, 30, stream=7, correlation=1),
        span("kernel", "k2", 220, 40, stream=7, correlation=2),
        span("kernel", "k3", 260, 50, stream=7, correlation=3),
        span("gpu_memcpy", "Memcpy HtoD", 262, 8, stream=8, correlation=4),
        span("kernel", "k5", 320, 60, stream=7, correlation=5),
        span("kernel", "k6", 460, 10, stream=7, correlation=6),
    ]
    assert stream_summary(events)["ranges"] == {
        "oomb.attention.forward.full": {"ms": 0.058, "gpu_ops": 2, "ranges": 1},
        "oomb.inner": {"ms": 0.04, "gpu_ops": 1, "ranges": 1},
        "oomb.attention.forward.window": {"ms": 0.04, "gpu_ops": 2, "ranges": 2},
    }


def test_oomb_names_each_layer_s_attention_by_what_it_attends():
    # On CPU (no kernels) the ranges themselves: a GPT-OSS model alternates sliding and full layers, and a
    # page-sparse step names its full layers' calls sparse.
    import torch
    from tiny_models import VOCAB, tiny_model

    import oomb
    from oomb.sparse import PageSelection

    model = tiny_model("gpt_oss", sliding_window=9)
    ids = torch.randint(0, VOCAB, (1, 96))  # 3 chunks: stage 1 runs chunks 0 and 1, stage 2 chunks 2, 1, 0
    per_kind = model.config.num_hidden_layers // 2  # the layers alternate sliding and full
    dense = {"window": (5, 3), "full": (5, 3)}  # (forward calls, backward calls) per layer of the kind
    sparse = {"window": (5, 3), "sparse": (3, 2), "full": (2, 1)}  # the first chunk has no past to choose from
    for selection, calls in ((None, dense), (PageSelection(page_budget=2, block=16, sink_pages=1), sparse)):
        oomb.chunked_backward(model, ids, chunk_size=32, page_size=4, selection=selection)  # the first step's probes
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            oomb.chunked_backward(model, ids, chunk_size=32, page_size=4, selection=selection)
        names = [e.name for e in prof.events() if e.name.startswith("oomb.attention.")]
        for kind, (forward, backward) in calls.items():
            assert names.count(f"oomb.attention.forward.{kind}") == forward * per_kind, kind
            assert names.count(f"oomb.attention.backward.{kind}") == backward * per_kind, kind
        assert len(names) == 8 * 2 * per_kind
