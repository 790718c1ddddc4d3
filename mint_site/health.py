"""Liveness and readiness probes."""

from __future__ import annotations

import logging

import redis
from django.conf import settings
from django.db import connection
from django.http import JsonResponse

log = logging.getLogger(__name__)


def healthz(request) -> JsonResponse:
    """The process is up and answering."""
    return JsonResponse({"status": "ok"})


def _check_database() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception:
        log.exception("Readiness: the database is unavailable.")
        return False
    return True


def _check_redis() -> bool:
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
    try:
        client.ping()
    except Exception:
        log.exception("Readiness: Redis is unavailable.")
        return False
    finally:
        client.close()
    return True


def readyz(request) -> JsonResponse:
    """The database and Redis are reachable; 503 naming what is not.

    The body says only which check failed: exception text can carry host names, addresses and user
    names, and the probe is public. The exception itself goes to the log.
    """
    checks = {"database": _check_database(), "redis": _check_redis()}
    ready = all(checks.values())
    body = {name: ("ok" if ok else "unavailable") for name, ok in checks.items()}
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": body}, status=200 if ready else 503)
