"""Cache key names: HMAC-SHA256 with a key derived from the cache secret, so names reveal neither prompt text nor
token ids.

The MAC covers (target model, tokenizer, scope, n, last n token ids); every field is length-prefixed, so no two
inputs share an encoding. Longer suffixes are more specific and are looked up first. A name is the prefix and the
MAC's first 16 bytes in unpadded base64url (27 bytes: Redis allocates it in a 32-byte class).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
from collections.abc import Sequence

KEY_VERSION = b"specmesh-draft-key-v2"          # v2: varint AES-SIV values (kvstore.codec)
DEFAULT_PREFIX = "sm:d:"
NAME_MAC_BYTES = 16


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


class KeyDeriver:
    def __init__(self, secret: bytes, model: str, tokenizer: str, suffix_lens: Sequence[int],
                 prefix: str = DEFAULT_PREFIX) -> None:
        if not secret:
            raise ValueError("the cache key secret must not be empty")
        lens = sorted({int(n) for n in suffix_lens}, reverse=True)
        if not lens or lens[-1] < 1:
            raise ValueError(f"suffix lengths must be >= 1, got {list(suffix_lens)}")
        self.suffix_lens = tuple(lens)
        self.prefix = prefix
        self._base = hmac.new(secret, digestmod=hashlib.sha256)
        self._base.update(_field(KEY_VERSION) + _field(model.encode()) + _field(tokenizer.encode()))

    @property
    def max_len(self) -> int:
        return self.suffix_lens[0]

    def keys(self, scope: str, context_ids: Sequence[int]) -> list[str]:
        """Key names for the suffixes of context_ids, longest first (only lengths the context has)."""
        scoped = self._base.copy()
        scoped.update(_field(scope.encode()))
        out = []
        for n in self.suffix_lens:
            if n > len(context_ids):
                continue
            mac = scoped.copy()
            mac.update(_field(struct.pack(f"<{n}I", *context_ids[-n:])))
            out.append(self.prefix + base64.urlsafe_b64encode(mac.digest()[:NAME_MAC_BYTES]).rstrip(b"=").decode())
        return out
