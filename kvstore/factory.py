"""Builds the configured draft cache: Redis when a URL is given, the in-process cache otherwise.

Redis values are always sealed (kvstore.codec): with the explicit encryption key when one is set, else with a key
derived from the cache secret (kvstore.derive; the random per-process secret when none is configured)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kvstore.base import DraftCache
from kvstore.codec import ValueCodec, parse_aes_key
from kvstore.derive import key_names_key, values_key
from kvstore.keys import KeyDeriver
from kvstore.memory import MemoryDraftCache
from kvstore.redis_cache import RedisDraftCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSettings:
    redis_url: str = ""                    # "" = in-process cache
    cluster: bool = False                  # the URL names a Redis Cluster node
    secret: str = ""                       # HMAC key for key names; "" = random per process (no sharing)
    encryption_key: str = ""               # key material (hex or base64) for values; "" = from the secret
    ttl_s: float = 86_400.0
    suffix_lens: tuple[int, ...] = (8, 4, 2)
    max_keys: int = 200_000                # in-process cache bound
    read_timeout_s: float = 0.05


def parse_lens(text: str) -> tuple[int, ...]:
    """'8,4,2' -> (8, 4, 2)."""
    try:
        lens = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not lens or min(lens) < 1:
        raise ValueError(f"expected positive lengths, got {text!r}")
    return lens


def open_cache(settings: CacheSettings, model: str, tokenizer: str) -> DraftCache:
    secret = settings.secret.encode()
    if not secret:
        secret = os.urandom(32)
        if settings.redis_url:
            log.warning("no cache secret configured: keys are private to this gateway and not shared")
    keys = KeyDeriver(key_names_key(secret), model, tokenizer, settings.suffix_lens)
    if not settings.redis_url:
        return MemoryDraftCache(keys, settings.ttl_s, settings.max_keys)
    explicit = parse_aes_key(settings.encryption_key) if settings.encryption_key else None
    codec = ValueCodec(values_key(secret, explicit))
    return RedisDraftCache(settings.redis_url, keys, codec, settings.ttl_s, cluster=settings.cluster,
                           read_timeout_s=settings.read_timeout_s)
