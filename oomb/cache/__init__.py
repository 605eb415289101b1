"""The paged K/V store (pools, block tables, free lists), its page allocator, its interface and a step's page lists."""

from oomb.cache.allocator import OutOfPagesError, PageAllocator
from oomb.cache.interface import KVStore
from oomb.cache.page_lists import PageLists
from oomb.cache.past_pages import PastPages
from oomb.cache.spec import PageShape, StoreBytes, StoreSpec
from oomb.cache.store import ChunkRecord, LayerPools, PagedKVStore

__all__ = [
    "ChunkRecord",
    "KVStore",
    "LayerPools",
    "OutOfPagesError",
    "PageAllocator",
    "PageLists",
    "PageShape",
    "PagedKVStore",
    "PastPages",
    "StoreBytes",
    "StoreSpec",
]
