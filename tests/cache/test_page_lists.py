"""A step's page lists (oomb.cache.PageLists): chosen once, the past pages each layer reads, dropped.
And the offloaded store knows a list by its serial, not its address."""

import pytest
import torch

from oomb.cache import PagedKVStore, PageLists, PastPages, StoreSpec
from oomb.offload import OffloadedKVStore

PAGE = 4
SPEC = StoreSpec.uniform(num_layers=3, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32,
                 grad_dtype=torch.float32, device=torch.device("cpu"))


def _store(store_class, chunks=(6 * PAGE, 2 * PAGE)):
    store = store_class(SPEC)
    store.reserve(1, sum(chunks))
    for n in chunks:
        store.append_chunk(n)
    return store


def test_lists_are_chosen_once_per_layer_and_chunk_until_dropped():
    lists = PageLists(sparse=True)
    calls = []

    def choose():
        calls.append(1)
        return torch.tensor([[[[0, 3]]]], dtype=torch.int32)

    first = lists.chosen(0, 24, choose)
    assert lists.chosen(0, 24, choose) is first and len(calls) == 1  # stage 2 gets stage 1's lists
    lists.chosen(1, 24, choose)
    lists.chosen(0, 16, choose)
    assert len(calls) == 3  # another layer, another chunk: chosen anew
    lists.drop(24)
    assert lists.chosen(0, 24, choose) is not first and len(calls) == 4
    assert lists.chosen(0, 16, choose) is not None and len(calls) == 4  # the other chunk's lists are kept


def test_past_pages_of_dense_window_and_sparse_layers():
    store = _store(PagedKVStore)  # newest chunk: tokens 24..31, past pages 0..5
    lists = PageLists(sparse=True)
    assert lists.past_pages(store, 0) == (False, None)  # never ran: its window is unknown
    window = 2 * PAGE + 1  # query 24 sees keys 16.. : past pages 4, 5
    got = lists.layer_ran(store, 0, window, None)
    assert got.pages.tolist() == [4, 5]
    assert lists.past_pages(store, 0) == (True, got)  # the same list (same serial) when asked again
    # A sparse layer on a store that moves no pages: the list would not be used, so none is made.
    assert lists.layer_ran(store, 1, None, torch.tensor([[[[1, 3]]]], dtype=torch.int32)) is None
    assert lists.past_pages(store, 1) == (False, None)
    assert PageLists(sparse=False).layer_ran(store, 1, None, None) is None  # dense: all pages
    lists.drop(store.last_chunk().start)
    again = lists.past_pages(store, 0)[1]  # the window is remembered, the list is made anew
    assert again.pages.tolist() == [4, 5] and again.serial != got.serial


def test_the_union_of_a_layers_lists_is_what_an_offloaded_store_fetches():
    store = _store(OffloadedKVStore)
    lists = PageLists(sparse=True)
    chosen = torch.tensor([[[[0, 3], [1, 3]]]], dtype=torch.int32)  # [B=1, H_sel=1, 2 blocks, 2]
    past = lists.layer_ran(store, 2, None, chosen)
    # every past page in order, -1 where no list names it; the named ones numbered in the device slot, which has
    # room for all 4 entries of the lists (the host never counts the union: that would wait for the selection)
    assert past.pages.tolist() == [0, 1, -1, 3, -1, -1]
    assert past.slot_rows.tolist() == [0, 1, -1, 2, -1, -1] and past.num_rows == 4
    pages, rows = past.table_rows()
    assert pages.tolist() == [0, 1, 2, 3, 4, 5] and rows.tolist() == [0, 1, -1, 2, -1, -1]  # -1: the store's spare row
    one = torch.tensor([[[[2, 5]]]], dtype=torch.int32)  # one list: its own union, no copy
    assert lists.layer_ran(store, 1, None, one).pages.data_ptr() == one.data_ptr()


def _offloaded_with_pages():
    """An offloaded 1-layer store whose past pages 0..3 hold keys p (page p) and the next chunk appended."""
    spec = StoreSpec.uniform(num_layers=1, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32,
                     grad_dtype=torch.float32, device=torch.device("cpu"))
    store = OffloadedKVStore(spec)
    store.reserve(1, 6 * PAGE)
    store.append_chunk(4 * PAGE)
    store.fetch(0, None, grads=False)
    keys = torch.arange(4.0).repeat_interleave(PAGE).view(1, 1, 4 * PAGE, 1).expand(1, 1, 4 * PAGE, 4)
    store.write(0, keys.contiguous(), torch.zeros(1, 1, 4 * PAGE, 4))
    store.writeback(0, grads=False)
    store.append_chunk(2 * PAGE)
    return store


def _fetched_pages(store, past):
    pools, table = store.fetch(0, past, grads=False)
    return pools.k[table[0, past.pages.long()].long(), 0, 0, 0].tolist()


def test_an_offloaded_slot_knows_a_list_by_its_serial_not_its_address():
    store = _offloaded_with_pages()
    pages = torch.tensor([0, 2])
    assert _fetched_pages(store, PastPages(pages)) == [0.0, 2.0]
    # The same memory with other numbers, as a freed list's block reused by the next list would be:
    # keyed by address, the slot would still hold pages 0 and 2.
    pages.copy_(torch.tensor([1, 3]))
    assert _fetched_pages(store, PastPages(pages)) == [1.0, 3.0]


def test_an_offloaded_store_refuses_a_bare_tensor_as_past_pages():
    store = _offloaded_with_pages()
    with pytest.raises(TypeError, match="PastPages"):
        store.fetch(0, torch.tensor([0, 2]), grads=False)
