"""On a GPU: a step's host syncs do not grow with its chunks (none per layer and chunk).

A host sync inside the per-layer loop (``.item()``, ``tensor[i] = number`` on a CUDA tensor,
torch.unique, a blocking copy) empties the GPU's queue once per layer and chunk; the
GPU then waits while the host queues the next kernels. On the H200 two such syncs per
layer and chunk left the compute stream idle for about 2 s of a 23 s sparse 128K step of
Qwen2.5-7B (results/h200/offload-2026-12-03-session6). Run with `pytest -m gpu`.
"""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import oomb
from oomb.sparse import PageSelection

pytestmark = pytest.mark.gpu

CHUNK = 1024


def _model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                      attention_dropout=0.0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")


def _host_syncs(model, chunks: int, **kw) -> list[str]:
    """The synchronizing CUDA calls of one step (after a step of the same length: kernels compiled,
    store and slots at their size)."""
    ids = torch.randint(0, 4096, (1, chunks * CHUNK), device="cuda")
    oomb.chunked_backward(model, ids, chunk_size=CHUNK, page_size=128, **kw)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            oomb.chunked_backward(model, ids, chunk_size=CHUNK, page_size=128, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    oomb.release_memory(model)
    return [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]


@pytest.mark.parametrize("setting", ["dense", "sparse", "sparse-one-list-offload", "dense-offload"])
def test_host_syncs_do_not_grow_with_chunks(setting):
    model = _model()
    kw = {}
    if setting.startswith("sparse"):
        block = CHUNK if "one-list" in setting else 128
        kw["selection"] = PageSelection(page_budget=2, block=block)
    if setting.endswith("offload"):
        kw["offload"] = True
    few, many = _host_syncs(model, 4, **kw), _host_syncs(model, 8, **kw)
    print(f"{setting}: {len(few)} host syncs in a 4-chunk step, {len(many)} in an 8-chunk step")
    assert len(many) == len(few), many[:3]
    if setting == "sparse":  # on the device store no page union (torch.unique) is built
        assert len(few) == len(_host_syncs(model, 4))
