"""Typed readers for the environment.

Every setting MinT takes from the environment goes through one of these helpers, so
a bad value stops the process at start-up with a message naming the variable,
instead of surfacing later as a confusing error deep inside a request.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off.")


def _env_number(name: str, default, parse, kind: str, minimum):
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = parse(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not {kind}.") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below its minimum of {minimum}.")
    return value


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    return _env_number(name, default, int, "an integer", minimum)


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    return _env_number(name, default, float, "a number", minimum)


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, default).strip().lower()
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={value!r} is not one of {', '.join(choices)}.")
    return value


def env_dir(name: str) -> Path | None:
    """The existing directory `name` names, or None when it is unset. Set but empty is an error: libraries that
    test only whether the variable is set (prometheus_client) would write into the working directory."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    path = Path(raw.strip())
    if not raw.strip() or not path.is_dir():
        raise ImproperlyConfigured(f"{name}={raw!r} is not an existing directory.")
    return path


def parse_database_url(url: str, *, base_dir: Path) -> dict:
    """Turn `postgres://user:pass@host:port/name` or `sqlite:///path` into a DATABASES entry (dj-database-url),
    with a relative SQLite path under `base_dir` and PostgreSQL's pool options taken from the query."""
    try:
        db = dj_database_url.parse(url, conn_health_checks=True)
    except ValueError as exc:
        raise ImproperlyConfigured(f"DATABASE_URL={url!r}: {exc}") from None
    if db["ENGINE"] not in {"django.db.backends.postgresql", "django.db.backends.sqlite3"}:
        raise ImproperlyConfigured(f"DATABASE_URL={url!r} is not supported; use postgres://… or sqlite:///….")
    if db["NAME"] in {"", ":memory:"}:
        raise ImproperlyConfigured(f"DATABASE_URL={url!r} names no database.")
    options = db.setdefault("OPTIONS", {})
    if db["ENGINE"] == "django.db.backends.sqlite3":
        db["NAME"] = str(base_dir / db["NAME"])
        # Celery workers and the web server write to the same file.
        options.update(timeout=20, transaction_mode="IMMEDIATE")
        return db
    # Under ASGI every request runs its sync code in a thread of its own, so persistent
    # connections would pile up one per thread: connections come from a pool instead
    # (psycopg_pool), returned at the end of each request. `?pool=0` turns it off.
    db["CONN_MAX_AGE"] = int(options.pop("conn_max_age", 0))
    pool_size = int(options.pop("pool_max_size", 10))
    if str(options.pop("pool", 1)) != "0":
        options["pool"] = {"min_size": 1, "max_size": pool_size, "timeout": 10}
    return db


def check_redis_url(name: str, url: str) -> str:
    scheme = urlsplit(url).scheme
    if scheme not in {"redis", "rediss", "unix"}:
        raise ImproperlyConfigured(f"{name}={url!r} is not a redis://, rediss:// or unix:// URL.")
    return url
