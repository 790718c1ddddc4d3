"""Who is calling, from a request's headers alone: what the ASGI body limits ask before a byte of a body is read.

Django reads a whole request body before any middleware or view runs, and the gateway used to read its body
before the key: a caller who is nobody could make the site receive (and spool) megabytes per request. The
gates of mint_site/limits.py resolve the caller here first, exactly as the API will (an API key by
`tenants.auth.authenticate_token`, failures counted; else the session cookie's person in the tenant the
request names), and answer a refusal instead of reading: nobody, a refused key, a person in no tenant.

ORM and Redis work: the async entry points run it on a worker thread and hand its connection back.
"""

from __future__ import annotations

from http.cookies import SimpleCookie
from importlib import import_module
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user
from django.db import connections
from django.http import HttpRequest
from rest_framework.exceptions import APIException

from mint_site.limits import Refusal
from tenants.access import Access, key_access, member_access
from tenants.auth import SESSION_TENANT_KEY, authenticate_token
from tenants.selectors import memberships_of

Scope = dict[str, Any]

NOBODY = Refusal(401, "not_authenticated", "Send an API key as `Authorization: Bearer mint_…`, or sign in.")


def headers_of(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope.get("headers", ())}


def key_from_headers(headers: dict[str, str], scope: Scope) -> Access | Refusal | None:
    """The access of the key an `Authorization: Bearer` header names, the refusal the API would answer (401, or
    429 past the failure limits), or None when no key is sent."""
    kind, _, token = headers.get("authorization", "").strip().partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        return None
    client = (scope.get("client") or (None,))[0]
    try:
        key = authenticate_token(token.strip(), client=client)  # counts failures against the address
    except APIException as refused:
        codes = refused.get_codes()
        wait = getattr(refused, "wait", None)
        return Refusal(
            refused.status_code,
            codes if isinstance(codes, str) else "invalid_api_key",
            str(refused.detail),
            {"Retry-After": str(int(wait))} if wait else {},
        )
    return key_access(key)  # narrowed to what its creator may do now


def session_user(headers: dict[str, str]) -> tuple[Any, Any] | None:
    """The signed-in person the session cookie names and their session, or None."""
    cookies = SimpleCookie()
    try:
        cookies.load(headers.get("cookie", ""))
    except Exception:
        return None
    morsel = cookies.get(settings.SESSION_COOKIE_NAME)
    if morsel is None:
        return None
    request = HttpRequest()
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(morsel.value)
    user = get_user(request)
    return (user, request.session) if user.is_authenticated else None


def caller_from_headers(headers: dict[str, str], scope: Scope) -> Access | Refusal:
    """The access of the key or the signed-in person the headers name, or the refusal the API would answer
    (401 nobody or a refused key, 429 past the failure limits, 404 no tenant of theirs)."""
    found = key_from_headers(headers, scope)
    if found is not None:
        return found
    signed_in = session_user(headers)
    if signed_in is None:
        return NOBODY
    user, session = signed_in
    memberships = memberships_of(user=user)
    slug = headers.get("x-mint-tenant") or session.get(SESSION_TENANT_KEY)
    membership = next((m for m in memberships if m.tenant.slug == slug), None)
    if membership is None and not slug and memberships:
        membership = memberships[0]
    if membership is None:
        return Refusal(404, "tenant_not_found", "No tenant of yours to act in.")
    return member_access(user, membership.tenant, membership.role)


def _known(scope: Scope) -> Refusal | None:
    headers = headers_of(scope)
    try:
        found = key_from_headers(headers, scope)
        if found is None and session_user(headers) is None:
            found = NOBODY
    finally:
        connections.close_all()  # a worker thread outside any request: hand its connection back
    return found if isinstance(found, Refusal) else None


async def known_caller(scope: Scope) -> Refusal | None:
    """None when the headers name a caller the API would accept (a live key, a signed-in person), else the
    refusal to answer unread: the body limits' gate for a large body on any route (mint_site/limits.py)."""
    return await sync_to_async(_known, thread_sensitive=False)(scope)
