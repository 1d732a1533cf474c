"""Random secrets and their hashes. Credentials, user tokens and lease tokens are
256-bit random values; only their SHA-256 is stored (they are high-entropy, so a
slow password hash buys nothing) and comparisons are constant-time."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_token() -> str:
    """A fresh 256-bit random token, hex encoded."""
    return secrets.token_hex(32)


def hash_secret(raw: str) -> bytes:
    return hashlib.sha256(raw.encode("utf-8")).digest()


def secrets_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def matches(raw: str, stored_hash: bytes | None) -> bool:
    """Whether ``raw`` hashes to ``stored_hash``, in constant time."""
    if stored_hash is None:
        return False
    return hmac.compare_digest(hash_secret(raw), stored_hash)
