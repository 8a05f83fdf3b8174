"""Draft cache: verified continuations seen after a token suffix, proposed as one-hot drafts on later requests.

`DraftCache` (base.py) is the interface; `MemoryDraftCache` is the embedded default and `RedisDraftCache` shares
the cache between gateways through a plain Redis server or Redis Cluster. Build one with `open_cache`.
"""

from kvstore.base import DraftCache
from kvstore.factory import CacheSettings, open_cache

__all__ = ["CacheSettings", "DraftCache", "open_cache"]
