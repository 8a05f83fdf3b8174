"""Cached values: a continuation of token ids, varint-packed and sealed with AES-SIV bound to its key name.

Layout: AES-SIV(key name as associated data, LEB128 varints of the token ids) = 16-byte synthetic IV + ciphertext
as long as the varints. AES-SIV is deterministic, so equal continuations share one sorted-set member and their
counts add up; that reveals only what the counts already do. Size matters: Redis keeps a sorted set compact
(listpack) only while every member is at most `zset-max-listpack-value` bytes (64 by default), and a compact set
costs ~140 bytes where a skiplist one costs ~1000. 16 ids below 2**21 take at most 48 varint bytes + 16 = 64.
Anything that does not decode (bad length, failed authentication, truncated varint) decodes to None: a miss.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESSIV

from kvstore.base import MAX_CONTINUATION_TOKENS

SIV_BYTES = 16
SIV_KEY_BYTES = 64                     # AES-256-SIV
MAX_TOKEN_ID = 2**32 - 1


def parse_aes_key(text: str) -> bytes:
    """Key material for cached values, given as hex or base64 (16, 24 or 32 bytes)."""
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        try:
            key = base64.b64decode(text, validate=True)
        except binascii.Error:
            raise ValueError("cache encryption key must be hex or base64") from None
    if len(key) not in (16, 24, 32):
        raise ValueError(f"cache encryption key must be 16, 24 or 32 bytes, got {len(key)}")
    return key


def pack_varints(token_ids: Sequence[int]) -> bytes:
    """LEB128: 7 bits per byte, low bits first, high bit set on every byte but a number's last."""
    out = bytearray()
    for t in token_ids:
        if not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"token id out of range: {t}")
        while t >= 0x80:
            out.append(0x80 | (t & 0x7F))
            t >>= 7
        out.append(t)
    return bytes(out)


def unpack_varints(data: bytes, max_count: int = MAX_CONTINUATION_TOKENS) -> list[int] | None:
    """The ids packed in data; None when a varint is truncated, too long, or there are more than max_count."""
    out: list[int] = []
    value, shift = 0, 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte & 0x80:
            if shift >= 35:
                return None
            continue
        if value > MAX_TOKEN_ID or len(out) == max_count:
            return None
        out.append(value)
        value, shift = 0, 0
    return out if shift == 0 and out else None


class ValueCodec:
    """Seals continuations under a 64-byte AES-SIV key (kvstore.factory derives it from the configured secret)."""

    def __init__(self, siv_key: bytes) -> None:
        if len(siv_key) != SIV_KEY_BYTES:
            raise ValueError(f"the value key must be {SIV_KEY_BYTES} bytes, got {len(siv_key)}")
        self._aead = AESSIV(siv_key)

    def encode(self, key: str, token_ids: Sequence[int]) -> bytes:
        return self._aead.encrypt(pack_varints(token_ids), [key.encode()])

    def decode(self, key: str, blob: object) -> list[int] | None:
        if not isinstance(blob, bytes) or len(blob) <= SIV_BYTES:
            return None
        try:
            plain = self._aead.decrypt(blob, [key.encode()])
        except InvalidTag:
            return None
        return unpack_varints(plain)
