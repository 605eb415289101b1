"""Pages in host memory: the offloaded paged store and its device working slots."""

from oomb.offload.store import OffloadedKVStore

__all__ = ["OffloadedKVStore"]
