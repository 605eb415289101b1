"""A sliding layer's pages in the device store: what it keeps of each chunk, what it gives back, what it zeroes."""

import pytest
import torch

from oomb.cache import PagedKVStore, StoreSpec
from oomb.cache.window_pages import tail_pages, window_page_ids

PAGE = 4


def _store(windows=(None, 6), batch=2, tokens=60, chunk=16):
    spec = StoreSpec.uniform(len(windows), 1, 2, page_size=PAGE, dtype=torch.float32, grad_dtype=torch.float32,
                             device=torch.device("cpu"), windows=windows)
    store = PagedKVStore(spec)
    store.reserve(batch, tokens, chunk)
    return store


def _fill(store, layer, value):
    """Write ``value`` as every key, value and key gradient of the newest chunk's pages of ``layer``."""
    record = store.last_chunk()
    k = torch.full((store.batch_size, 1, record.end - record.start, 2), float(value))
    store.write(layer, k, k)
    ids = store.layer_table(layer)[:, record.first_page : record.first_page + record.num_pages].reshape(-1).long()
    store.layer(layer).dk[ids] = float(value)


def test_each_chunk_keeps_the_pages_the_next_window_reaches():
    assert tail_pages(6, PAGE) == 2 and tail_pages(1, PAGE) == 0 and tail_pages(5, PAGE) == 1
    store = _store()
    for value, size in enumerate((16, 16, 16, 12), start=1):
        store.append_chunk(size)
        _fill(store, 1, value)
    # chunks of 4 pages: the three before the newest keep 2 pages each, the newest (3 pages) all; + the scratch page
    assert store.window_pages_used() == {6: 2 * (3 * 2 + 3) + 1}
    assert store.num_used_pages == 2 * 15  # the full-attention layer keeps every page
    assert store.layer(1).k.shape[0] == window_page_ids(6, batch_size=2, num_tokens=60, page_size=PAGE, chunk_size=16)
    table = store.layer_table(1)
    scratch = table[0, 0].item()
    assert (table[:, [0, 1, 4, 5, 8, 9]] == scratch).all()  # given up: on the scratch page
    assert (table[:, [2, 3, 6, 7, 10, 11, 12, 13, 14]] != scratch).all()
    # what the newest chunk's window reads is intact: the previous chunk's last 5 tokens
    keys, _ = store.read(1, 43, 48)
    assert (keys == 3).all()
    with pytest.raises(ValueError, match="tokens \\[30, 40\\) include pages it gave up"):
        store.read(1, 30, 40)  # the third chunk's first pages: given up when the fourth was appended
    assert store.read(0, 30, 40)[0].shape[2] == 10  # the full-attention layer keeps every page


def test_freeing_a_chunk_gives_the_one_before_its_pages_back_with_zero_gradients():
    store = _store()
    for value in (1, 2, 3):
        store.append_chunk(16)
        _fill(store, 1, value)
    tail = store.layer_table(1)[:, 6:8].reshape(-1).long()
    store.layer(1).dk[tail] = 7.0  # what the newest chunk's backward adds into the previous chunk's tail
    store.free_last_chunk()
    dk, _ = store.read_grad(1, store.last_chunk())
    assert (dk[:, :, :8] == 0).all()  # given back: zeroed, no later chunk saw them
    assert (dk[:, :, 8:] == 7).all()  # the tail kept its gradient
    keys, _ = store.read(1, 24, 32)
    assert (keys == 2).all()  # the tail kept its keys; the other pages are written again by the recompute
    assert store.window_pages_used() == {6: 2 * (2 + 4) + 1}


@pytest.mark.parametrize("window", [1, 6, 17, 100])
def test_bytes_for_is_what_reserve_allocates(window):
    store = _store(windows=(window, None, window), tokens=60, chunk=16)
    tables = 2 * 15 * 4 * 2  # the shared block table and the window's
    assert PagedKVStore.bytes_for(store.spec, 2, 60, chunk_size=16).device == store.nbytes() + tables
    capacity = store.layer(0).k.shape[0]
    for size in (16, 16, 16, 12):
        store.append_chunk(size)
    store.free_last_chunk()  # the third chunk gets its pages back
    assert store.layer(0).k.shape[0] == capacity  # the step never outgrew the reservation
    store.clear()
    assert store.window_pages_used() == {window: 1} and store.num_used_pages == 0


def test_a_window_spec_names_every_layer():
    with pytest.raises(ValueError, match="windows names 1 layers"):
        StoreSpec.uniform(2, 1, 2, page_size=4, dtype=torch.float32, grad_dtype=torch.float32,
                          device=torch.device("cpu"), windows=(4,))
    with pytest.raises(ValueError, match="at least 1 token"):
        StoreSpec.uniform(1, 1, 2, page_size=4, dtype=torch.float32, grad_dtype=torch.float32,
                          device=torch.device("cpu"), windows=(0,))


def test_the_plan_line_names_the_full_layers_pages_and_the_windows():
    spec = _store(windows=(None, 6, 6)).spec
    assert PagedKVStore.describe(spec, 2, 15) == (
        f"2 x 15 pages x {spec.layer_page_bytes(0):,} B (K, V, dK, dV, mean keys) of 1 layer; of the other 2, "
        "what their windows reach + page tables")
    plain = _store(windows=(None, None)).spec
    assert PagedKVStore.describe(plain, 1, 3).endswith(f"x {2 * plain.layer_page_bytes(0):,} B (K, V, dK, dV, "
                                                       "mean keys) + page table")


def test_a_spec_without_any_window_is_one_spec():
    # the engine names every site's window, the planner every config layer's: all None is no windows at all
    fields = dict(page_size=4, dtype=torch.float32, grad_dtype=torch.float32, device=torch.device("cpu"))
    assert StoreSpec.uniform(2, 1, 2, windows=(None, None), **fields) == StoreSpec.uniform(2, 1, 2, **fields)
    assert StoreSpec.uniform(3, 1, 2, windows=(None, 6, None), **fields).full_layers() == [0, 2]
