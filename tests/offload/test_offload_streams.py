"""The offloaded store's copy stream against page lists made on the compute stream (GPU only).

The copy kernel reads a sparse layer's page list on the copy stream. The list is made on the
compute stream just before (the layer's selection), so the copy must wait for it, and its memory
must not go to another tensor before the copies that read it ran. Both are arranged here so that
the wrong order would be seen: the compute stream (or the copy stream) is held busy with a sleep
kernel while the host queues the rest.
"""

import pytest
import torch

from oomb.cache import PastPages, StoreSpec
from oomb.offload import OffloadedKVStore

pytestmark = pytest.mark.gpu

PAGE, HEADS, DIM, PAST = 16, 2, 64, 48
SLEEP = 500_000_000  # GPU clock cycles: ~0.25 s, far longer than the host takes to queue the rest


def _store_with_past() -> tuple[OffloadedKVStore, torch.Tensor]:
    """A one-layer store holding PAST pages of random keys (written home), and the next chunk appended."""
    spec = StoreSpec.uniform(num_layers=1, num_kv_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.bfloat16,
                     grad_dtype=torch.bfloat16, device=torch.device("cuda"))
    store = OffloadedKVStore(spec)
    store.reserve(1, (PAST + 4) * PAGE)
    store.append_chunk(PAST * PAGE)
    store.fetch(0, None, grads=False)
    keys = torch.randn(1, HEADS, PAST * PAGE, DIM, device="cuda", dtype=torch.bfloat16)
    store.write(0, keys, torch.randn_like(keys))
    store.writeback(0, grads=False)
    store.append_chunk(4 * PAGE)
    # Compile the copy kernel's gather and scatter now: a first launch compiles for longer than the
    # sleep lasts, and a copy that starts late would pass whatever the order.
    store.fetch(0, PastPages(torch.arange(2, dtype=torch.int32, device="cuda")), grads=True)
    store.writeback(0, grads=True)  # scatters the zeros it fetched
    torch.cuda.synchronize()
    return store, keys[0].view(HEADS, PAST, PAGE, DIM).transpose(0, 1)  # [page, H, P, D]


CHOSEN = [3, 7, 8, 20, 21, 33, 40, 47]


def test_the_copy_waits_for_a_page_list_still_being_made():
    store, key_pages = _store_with_past()
    want = torch.tensor(CHOSEN, dtype=torch.int32, device="cuda")
    pages = torch.zeros_like(want)  # what a copy that ran ahead would read: page 0, eight times
    torch.cuda._sleep(SLEEP)  # the compute stream is busy when the list gets its values...
    pages.copy_(want)  # ...as a selection still queued behind other kernels
    pools, table = store.fetch(0, PastPages(pages), grads=False)
    rows = table[0, want.long()].long()
    assert torch.equal(pools.k[rows], key_pages[want.long()])


def test_a_page_list_outlives_the_copies_that_read_it():
    store, _ = _store_with_past()
    want = torch.tensor(CHOSEN, dtype=torch.int32, device="cuda")
    pages = PastPages(want.clone())
    pools, table = store.fetch(0, pages, grads=True)
    marks = torch.arange(1, len(CHOSEN) + 1, device="cuda", dtype=torch.bfloat16)
    pools.dk[table[0, want.long()].long()] = marks.view(-1, 1, 1, 1)  # this chunk's backward, as it were
    with torch.cuda.stream(store._copy_stream):
        torch.cuda._sleep(SLEEP)  # the scatter home queued next runs only after this
    store.writeback(0, grads=True)
    # The step lets go of the list (after the chunk's backward) and the slot takes another one (a prefetch:
    # a fetch would make the compute stream wait for the copy stream, and hide the hazard); without care
    # the list's memory goes to the next small tensors while the scatter has not read it yet.
    del pages
    store.prefetch(0, PastPages(want[:2].clone()), grads=False)
    junk = [torch.full_like(want, PAST - 1) for _ in range(8192)]  # 4 MiB of small blocks: every free one
    torch.cuda.synchronize()
    pools, table = store.fetch(0, PastPages(want), grads=True)  # the host's gradient pages of the chosen pages
    got = pools.dk[table[0, want.long()].long()]
    assert torch.equal(got.float().amax(dim=(1, 2, 3)), marks.float()), "gradient pages scattered elsewhere"
    del junk
