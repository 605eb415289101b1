"""The page allocator and the paged store: invariants after every operation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomb.cache import OutOfPagesError, PageAllocator, PagedKVStore, StoreSpec


def _check_allocator(a: PageAllocator, held: set[int]):
    assert a.num_used == len(held)
    assert a.num_free + a.num_used == a.num_pages


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_allocator_invariants(ops):
    a = PageAllocator(16)
    stack: list[list[int]] = []
    for alloc, n in ops:
        if alloc:
            if n > a.num_free:
                with pytest.raises(OutOfPagesError):
                    a.allocate(n)
            else:
                ids = a.allocate(n)
                assert len(set(ids)) == n
                assert not set(ids) & {i for s in stack for i in s}
                stack.append(ids)
        elif stack:
            a.free(stack.pop())
        _check_allocator(a, {i for s in stack for i in s})


def test_allocator_misuse_raises():
    a = PageAllocator(4)
    ids = a.allocate(2)
    a.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(ids)
    with pytest.raises(ValueError, match="shrink"):
        a.grow(2)
    a.grow(8)
    assert a.num_free == 8


def _spec(**kw):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32,
                grad_dtype=torch.float32, device=torch.device("cpu"))
    base.update(kw)
    return StoreSpec.uniform(**base)


def test_store_round_trip_and_page_table():
    store = PagedKVStore(_spec())
    batch, chunks = 2, [8, 8, 5]  # last chunk ragged: 5 tokens = 2 pages, 3 slots of padding
    store.reserve(batch, sum(chunks))
    assert store.capacity_pages == batch * 6
    written = []
    for n in chunks:
        rec = store.append_chunk(n)
        k = torch.randn(batch, 2, n, 8)
        v = torch.randn(batch, 2, n, 8)
        for layer in range(2):
            store.write(layer, k + layer, v - layer)
        written.append((rec, k, v))
    assert store.num_tokens == 21
    # Every page id appears once in the table; tables of the two sequences are disjoint.
    ids = store.page_table[:, :6].reshape(-1).tolist()
    assert sorted(ids) == list(range(12))
    for rec, k, v in written:
        rk, rv = store.read(1, rec.start, rec.end)
        torch.testing.assert_close(rk, k + 1, rtol=0, atol=0)
        torch.testing.assert_close(rv, v - 1, rtol=0, atol=0)
    # Padding slots of the ragged last page are zero, and the mean key ignores them.
    rec, k, _ = written[-1]
    last_page = store.page_table[0, 5].long()
    pool = store.layer(0)
    assert torch.equal(pool.k[last_page, :, 1:], torch.zeros(2, 3, 8))
    torch.testing.assert_close(pool.mean_k[last_page], k[0, :, 4:5].mean(dim=1))
    first_page = store.page_table[1, 0].long()
    torch.testing.assert_close(pool.mean_k[first_page], written[0][1][1, :, 0:4].mean(dim=1))
    # Free newest first; the store shrinks back to empty.
    for rec, _, _ in reversed(written):
        assert store.last_chunk() == rec
        store.free_last_chunk()
        assert store.num_tokens == rec.start
    assert store.num_used_pages == 0
    with pytest.raises(RuntimeError, match="no chunk"):
        store.free_last_chunk()


def test_store_zeroes_gradient_pages_on_append():
    store = PagedKVStore(_spec())
    store.reserve(1, 8)
    store.append_chunk(8)
    store.layer(0).dk.fill_(3.0)
    store.free_last_chunk()
    rec = store.append_chunk(8)
    dk, dv = store.read_grad(0, rec)
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


def test_store_misuse_raises():
    store = PagedKVStore(_spec())
    with pytest.raises(RuntimeError, match="reserve"):
        store.append_chunk(4)
    store.reserve(1, 12)
    store.append_chunk(6)  # ragged chunk in the middle
    with pytest.raises(RuntimeError, match="multiple of page_size"):
        store.append_chunk(4)
    with pytest.raises(ValueError, match="do not fit"):
        store.write(0, torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))
    with pytest.raises(TypeError, match="float64"):
        store.write(0, torch.zeros(1, 2, 6, 8, dtype=torch.float64), torch.zeros(1, 2, 6, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="empty store"):
        store.reserve(1, 12)
    store.clear()
    assert store.num_used_pages == 0


def test_store_grows_past_reservation_keeping_data():
    store = PagedKVStore(_spec(page_size=2))
    store.reserve(1, 4)
    assert store.capacity_pages == 2
    store.append_chunk(4)
    k = torch.randn(1, 2, 4, 8)
    store.write(0, k, k)
    store.append_chunk(6)  # past the reservation: pools grow and keep what they held
    assert store.capacity_pages >= 5
    rk, _ = store.read(0, 0, 4)
    torch.testing.assert_close(rk, k, rtol=0, atol=0)


def test_store_reserve_grows_empty_pools_without_copy():
    store = PagedKVStore(_spec())
    store.reserve(1, 8)
    small = store.capacity_pages
    store.reserve(2, 64)
    assert store.capacity_pages == 2 * 16 > small
    assert store.nbytes() == store.capacity_pages * store.spec.bytes_per_page()


def test_bytes_per_token_matches_qwen25_7b():
    spec = StoreSpec.uniform(num_layers=28, num_kv_heads=4, head_dim=128, page_size=128, dtype=torch.bfloat16,
                     grad_dtype=torch.bfloat16, device=torch.device("cpu"))
    assert spec.bytes_per_token() == 112 * 1024  # DESIGN.md: K+V 56 KiB/token, with gradients 112 KiB


def test_a_store_without_gradient_pages_holds_half_and_refuses_gradient_reads():
    import dataclasses

    from oomb.offload import OffloadedKVStore

    spec = StoreSpec.uniform(num_layers=28, num_kv_heads=4, head_dim=128, page_size=128, dtype=torch.bfloat16,
                             grad_dtype=torch.bfloat16, device=torch.device("cpu"))
    forward = dataclasses.replace(spec, gradients=False)
    assert forward.bytes_per_token() == 56 * 1024 and forward != spec  # K and V alone
    assert forward.layer_bytes(10) * 2 - spec.layer_bytes(10) == 10 * 4 * forward.summary_dim() * 2  # summaries
    store = PagedKVStore(dataclasses.replace(_spec(page_size=2), gradients=False))
    store.reserve(1, 4)
    assert store.layer(0).dk.shape[0] == 0 and store.layer(0).k.shape[0] == 2
    store.append_chunk(4)
    k = torch.randn(1, 2, 4, 8)
    store.write(0, k, 2 * k)
    store.append_chunk(6)  # grows past the reservation, keeping K and V
    rk, rv = store.read(0, 0, 4)
    torch.testing.assert_close(rk, k, rtol=0, atol=0)
    torch.testing.assert_close(rv, 2 * k, rtol=0, atol=0)
    assert store.nbytes() == store.capacity_pages * store.spec.bytes_per_page()
    store.fetch(0, None, grads=False)
    with pytest.raises(RuntimeError, match="no gradient pages"):
        store.fetch(0, None, grads=True)
    with pytest.raises(RuntimeError, match="no gradient pages"):
        store.read_grad(0, store.last_chunk())
    with pytest.raises(ValueError, match="keeps gradient pages"):
        OffloadedKVStore(forward)


def test_release_frees_the_pools():
    store = PagedKVStore(_spec())
    store.reserve(1, 16)
    store.append_chunk(16)
    store.release()
    assert store.capacity_pages == 0 and store.nbytes() == 0 and store.num_used_pages == 0
    store.reserve(1, 8)  # still usable
    store.append_chunk(8)


def test_failed_growth_leaves_an_empty_consistent_store(monkeypatch):
    store = PagedKVStore(_spec())
    store.reserve(1, 16)

    def fail(num_pages, window_pages):
        if num_pages:
            raise torch.OutOfMemoryError("simulated")
        original(num_pages, window_pages)

    original = store._allocate_pools
    monkeypatch.setattr(store, "_allocate_pools", fail)
    with pytest.raises(torch.OutOfMemoryError):
        store.reserve(1, 1024)
    assert store.capacity_pages == 0 and store.nbytes() == 0
    monkeypatch.undo()
    store.reserve(1, 16)  # usable again
    store.append_chunk(16)
    assert store.num_used_pages == 4
