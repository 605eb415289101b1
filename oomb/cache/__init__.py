"""The paged K/V store (pools, block tables, free lists) and its page allocator."""

from oomb.cache.allocator import OutOfPagesError, PageAllocator
from oomb.cache.store import ChunkRecord, LayerPools, PagedKVStore, StoreSpec

__all__ = ["ChunkRecord", "LayerPools", "OutOfPagesError", "PageAllocator", "PagedKVStore", "StoreSpec"]
