"""API key tokens: `mint_<prefix>_<secret>`. The prefix finds the row; the secret is only ever hashed."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

TOKEN_PREFIX = "mint"


@dataclass(frozen=True)
class ParsedToken:
    prefix: str
    secret: str


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_token() -> tuple[str, str, str]:
    """A fresh token, its prefix and the hash to store: (token, prefix, key_hash)."""
    prefix = secrets.token_hex(6)  # hex: never contains the "_" separator
    secret = secrets.token_urlsafe(32)
    return f"{TOKEN_PREFIX}_{prefix}_{secret}", prefix, hash_secret(secret)


def parse_token(token: str) -> ParsedToken | None:
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX or not parts[1] or not parts[2]:
        return None
    return ParsedToken(prefix=parts[1], secret=parts[2])


def secret_matches(secret: str, key_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), key_hash)
