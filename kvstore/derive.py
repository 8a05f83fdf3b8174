"""Keys derived from the one configured cache secret: HKDF-SHA256 with a distinct label per use, so the key that
names cache entries (HMAC) and the key that seals their values (AES-SIV) are independent."""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstore.codec import SIV_KEY_BYTES

KEY_NAMES_LABEL = b"specmesh draft-cache v2: key names (HMAC-SHA256)"
VALUES_LABEL = b"specmesh draft-cache v2: values (AES-SIV)"


def hkdf(material: bytes, label: bytes, length: int) -> bytes:
    if not material:
        raise ValueError("key material must not be empty")
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=label).derive(material)


def key_names_key(secret: bytes) -> bytes:
    return hkdf(secret, KEY_NAMES_LABEL, 32)


def values_key(secret: bytes, encryption_key: bytes | None = None) -> bytes:
    """From the explicit encryption key when one is configured, else from the cache secret."""
    return hkdf(encryption_key or secret, VALUES_LABEL, SIV_KEY_BYTES)
