"""Liveness and readiness probes."""

from __future__ import annotations

import redis
from django.conf import settings
from django.db import connection
from django.http import JsonResponse


def healthz(request) -> JsonResponse:
    """The process is up and answering."""
    return JsonResponse({"status": "ok"})


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _check_redis() -> str | None:
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
    try:
        client.ping()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()
    return None


def readyz(request) -> JsonResponse:
    """The database and Redis are reachable; 503 naming what is not."""
    checks = {"database": _check_database(), "redis": _check_redis()}
    body = {name: ("ok" if error is None else error) for name, error in checks.items()}
    ready = all(error is None for error in checks.values())
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": body}, status=200 if ready else 503)
