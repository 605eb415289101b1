"""stream_summary: per-stream busy time and the compute stream's gaps, from trace events."""

from oomb.bench.timeline import kernel_group, stream_summary


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


def test_overlapping_spans_count_once():
    s = stream_summary([_kernel(1, 0, 100), _kernel(1, 50, 100), _kernel(1, 300, 10)])
    assert s["streams"]["1"]["busy_ms"] == 0.16  # 0..150 and 300..310
    assert abs(s["streams"]["1"]["kernel_ms"] - 0.21) < 1e-12  # summed durations
    assert stream_summary([])["compute_stream"] is None
