"""HostStash: what is kept comes back as it was (values, shape, strides of transposed views, dtype), in any
order, from regions of one buffer reused between steps; a stash asked for more than its size refuses."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomb.engine import host_stash
from oomb.engine.host_stash import HostAttentionCache, HostStash, chunk_lengths, chunk_lengths_of, region_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]


@st.composite
def tensors(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=3, max_size=4)))
    dtype = draw(st.sampled_from(DTYPES))
    x = (torch.randn(shape) * 100).to(dtype)
    if draw(st.booleans()):  # a transposed view, as FA4's attention outputs are laid out
        x = x.transpose(1, 2)
    return x


@settings(max_examples=60, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=6), st.randoms())
def test_kept_tensors_come_back_as_they_were_in_any_order(kept, rng):
    owner = torch.nn.Linear(1, 1)
    stash = HostStash.for_model(owner, "test", sum(region_bytes(tuple(x.shape), x.dtype) for x in kept),
                                torch.device("cpu"))
    for i, x in enumerate(kept):
        stash.keep(i, x)
    order = list(range(len(kept)))
    rng.shuffle(order)
    for i in order:
        back = stash.take(i)
        assert back.dtype == kept[i].dtype and back.shape == kept[i].shape and torch.equal(back, kept[i])
        if not kept[i].is_contiguous():
            assert back.stride() == kept[i].stride()  # the same view: a consumer reading strides sees no change
    assert not any(i in stash for i in range(len(kept)))


def test_the_buffer_is_reused_grown_and_refuses_more_than_planned():
    owner = torch.nn.Linear(1, 1)
    x = torch.randn(3, 100)
    first = HostStash.for_model(owner, "a", region_bytes((3, 100), torch.float32), torch.device("cpu"))
    first.keep("x", x)
    with pytest.raises(RuntimeError, match="host stash full"):
        first.keep("y", x)
    with pytest.raises(KeyError, match="kept already"):
        first.keep("x", x)
    again = HostStash.for_model(owner, "a", region_bytes((3, 100), torch.float32), torch.device("cpu"))
    assert again._buffer is first._buffer  # kept between steps
    bigger = HostStash.for_model(owner, "a", 2 * region_bytes((3, 100), torch.float32), torch.device("cpu"))
    assert bigger._buffer.numel() >= 2 * region_bytes((3, 100), torch.float32)
    assert HostStash.for_model(owner, "b", 1, torch.device("cpu"))._buffer is not bigger._buffer  # per purpose
    host_stash.release(owner)
    assert owner not in host_stash._BUFFERS


def test_the_attention_cache_mapping_pops_once_and_forgets_a_chunk():
    owner = torch.nn.Linear(1, 1)
    out, lse = torch.randn(1, 8, 2, 4).transpose(1, 2), torch.randn(1, 2, 8)  # [B, H, C, D] of [B, C, H, D]
    chunks = [(0, 8), (8, 16)]
    size = HostAttentionCache.nbytes([(2, 4)] * 2, chunk_lengths(chunks), 1, torch.float32)
    assert size == 2 * 2 * (region_bytes((1, 2, 8, 4), torch.float32) + region_bytes((1, 2, 8), torch.float32))
    cache = HostAttentionCache(HostStash.for_model(owner, "attention outputs", size, torch.device("cpu")), step=-1)
    for layer in (0, 1):
        for start, _ in chunks:
            cache[(layer, start)] = (out, lse)
    assert sorted(cache) == [(0, 0), (0, 8), (1, 0), (1, 8)] and len(cache) == 4
    got_out, got_lse = cache.pop((1, 8))
    assert torch.equal(got_out, out) and torch.equal(got_lse, lse)
    assert cache.pop((1, 8), "absent") == "absent"
    for key in [k for k in cache if k[1] == 0]:  # what StepContext.drop_page_lists does after chunk 0
        del cache[key]
    assert list(cache) == [(0, 8)]


@pytest.mark.parametrize("purpose,setting", [("layer inputs", "train.recompute=chunk"),
                                             ("attention outputs", "train.cache_attention=true")])
def test_host_memory_that_cannot_be_pinned_is_refused_with_the_setting_that_avoids_it(monkeypatch, purpose, setting):
    from oomb.engine.layer_recompute import LayerInputs

    # cudaHostRegister failing (a host without that much lockable memory): the error names the memory, its size
    # and the setting that keeps it on the GPU, instead of a bare CUDA error at the first step.
    class FailingRuntime:
        @staticmethod
        def cudaHostRegister(ptr, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FailingRuntime())
    model = torch.nn.Linear(1, 1)
    with pytest.raises(RuntimeError, match=rf"could not pin 0\.00 GiB of host memory for the step's {purpose} "
                                           rf"\(cudaHostRegister error 2\); free host memory, or keep them on the "
                                           rf"GPU with .*\({setting}\)"):
        if purpose == "layer inputs":  # each host store as the step makes it
            LayerInputs.on_host(model, 2, [(0, 64)], 1, 8, torch.float32, torch.device("cuda"))
        else:
            HostAttentionCache.on_host(model, [(2, 4)] * 2, [(0, 64)], 1, torch.float32, torch.device("cuda"))
    assert purpose not in host_stash._BUFFERS.get(model, {})  # nothing half-made is kept for the next step


@given(seq_len=st.integers(0, 5000), chunk_size=st.integers(1, 700), but_last=st.booleans())
def test_chunk_lengths_of_counts_the_chunks_a_step_makes_without_listing_them(seq_len, chunk_size, but_last):
    chunks = [(start, min(start + chunk_size, seq_len)) for start in range(0, seq_len, chunk_size)]
    kept = chunks[:-1] if but_last else chunks
    assert chunk_lengths_of(seq_len, chunk_size, but_last=but_last) == chunk_lengths(kept)


def test_chunk_lengths_of_a_sequence_of_a_trillion_tokens_is_two_numbers():
    assert chunk_lengths_of(1 << 40, 3000) == {3000: (1 << 40) // 3000, (1 << 40) % 3000: 1}
