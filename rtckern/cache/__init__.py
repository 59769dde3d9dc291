"""Cache tiers: memory, then read-only layers and the local disk cache, then a remote tier."""

from .disk import CacheWarning, DiskCache, EntryInfo, atomic_write
from .entry import InvalidEntry, pack, unpack
from .memory import MemoryCache
from .stats import Stats, TierStats

__all__ = ["CacheWarning", "DiskCache", "EntryInfo", "InvalidEntry", "MemoryCache", "Stats", "TierStats",
           "atomic_write", "pack", "unpack"]
