"""Cached values: a continuation of token ids, optionally sealed with AES-GCM bound to its key name.

Encryption is deterministic per (key, continuation) -- the nonce is an HMAC of both -- so equal continuations
share one sorted-set member and their counts add up; that reveals only what the counts already do. Anything that
does not decode (wrong version, bad length, failed authentication) decodes to None and is treated as a miss.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore.base import MAX_CONTINUATION_TOKENS

PLAIN = 1
SEALED = 2
NONCE_BYTES = 12


def parse_aes_key(text: str) -> bytes:
    """An AES key given as hex or base64 (16, 24 or 32 bytes)."""
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


class ValueCodec:
    def __init__(self, aes_key: bytes | None = None) -> None:
        self._aead = AESGCM(aes_key) if aes_key else None
        self._nonce_key = hmac.digest(aes_key, b"specmesh nonce key", "sha256") if aes_key else b""

    def encode(self, key: str, token_ids: Sequence[int]) -> bytes:
        plain = struct.pack(f"<{len(token_ids)}I", *token_ids)
        if self._aead is None:
            return bytes([PLAIN]) + plain
        nonce = hmac.digest(self._nonce_key, _field(key.encode()) + plain, hashlib.sha256)[:NONCE_BYTES]
        return bytes([SEALED]) + nonce + self._aead.encrypt(nonce, plain, key.encode())

    def decode(self, key: str, blob: object) -> list[int] | None:
        if not isinstance(blob, bytes) or not blob:
            return None
        if self._aead is None:
            return _tokens(blob[1:]) if blob[0] == PLAIN else None
        if blob[0] != SEALED or len(blob) < 1 + NONCE_BYTES:
            return None                       # plain values are refused once encryption is configured
        try:
            plain = self._aead.decrypt(blob[1:1 + NONCE_BYTES], blob[1 + NONCE_BYTES:], key.encode())
        except InvalidTag:
            return None
        return _tokens(plain)


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _tokens(plain: bytes) -> list[int] | None:
    if not plain or len(plain) % 4 or len(plain) > 4 * MAX_CONTINUATION_TOKENS:
        return None
    return list(struct.unpack(f"<{len(plain) // 4}I", plain))
