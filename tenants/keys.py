"""API key tokens and the rules every caller of a key applies: the REST API (tenants/auth.py) and the gateway
(serving/gateway/auth.py, serving/gateway/usage.py) alike.

A token is `mint_<prefix>_<secret>`: the prefix finds the row; the secret is only ever hashed. Pure functions:
no database, no settings, so the gateway can apply them on its event loop to what it has cached.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

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


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header ("" when the token is missing), or None for a
    header of another kind (or none at all)."""
    kind, _, token = authorization.strip().partition(" ")
    if kind.lower() != "bearer":
        return None
    return token.strip()


def expiry_refusal(*, prefix: str, expires_at: datetime | None, now: datetime) -> str | None:
    """Why a key may no longer act because of its expiry, or None while it may (or never expires)."""
    if expires_at is None or expires_at > now:
        return None
    return f"The API key mint_{prefix}_… expired at {expires_at.isoformat()}."


def touch_due(last_used_at: datetime | None, now: datetime, interval: timedelta) -> bool:
    """Whether a key's use at `now` is worth writing: `last_used_at` is written at most once per `interval`."""
    return last_used_at is None or now - last_used_at >= interval
