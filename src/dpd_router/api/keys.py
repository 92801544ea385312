"""API keys as the router holds them: SHA-256 hex digests, never the keys themselves."""

from __future__ import annotations

import hashlib

HEX_DIGITS = frozenset("0123456789abcdef")


def hash_key(key: str) -> str:
    """The digest a key is configured by (what `dpd-router hash-key` prints)."""
    return hashlib.sha256(key.encode()).hexdigest()


def checked_digest(text: str) -> str:
    """A configured digest, normalised (lower case, no `sha256:` prefix); ValueError when it is not one."""
    digest = text.strip().lower().removeprefix("sha256:")
    if len(digest) != 64 or not set(digest) <= HEX_DIGITS:
        raise ValueError("API keys are configured as SHA-256 hex digests of the keys (see `dpd-router hash-key`)")
    return digest
