"""Who may upload how much, decided before the upload's body is read (mint_site/limits.py asks).

The upload routes (the API's revision registration and the dashboard's upload form) are
the only ones that take large bodies. Before a byte of the body is read, the caller is
resolved from its API key or its session cookie, exactly as the view will resolve it:
nobody anonymous, no key without the right to register, no throttled caller and no
tenant at its storage quota gets to send a body at all, and everyone else may send at
most their tenant's `max_upload_bytes` (plus room for the multipart framing), or what is
left of its `max_storage_bytes` if that is less. The view checks the exact numbers again
once the files are parsed; this only keeps a caller from spending more disk than it could
ever be allowed.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.db import connections

from adapters import selectors
from mint_site.limits import Allowance, Refusal, Scope
from tenants import idempotency
from tenants.access import Access, Capability
from tenants.header_auth import caller_from_headers, headers_of
from tenants.throttles import GATE_COUNTED, api_write_refusal

# The API's registration and the dashboard's upload form.
UPLOAD_ROUTES = re.compile(r"^/(?:api/v1/adapters/[^/]+/revisions|adapters/[^/]+/register)/$")
MULTIPART_SLACK = 64 * 1024  # boundaries and form fields around the files


async def allowance(scope: Scope) -> Allowance | Refusal:
    """The body an upload's caller may send, or the refusal to answer instead of reading it."""
    return await sync_to_async(_in_thread, thread_sensitive=False)(upload_allowance, scope)


async def part_allowance(scope: Scope, part: Allowance) -> Allowance | Refusal:
    """A resumable upload's part (adapters/uploads.py): the caller must be one who may register revisions before
    a byte of the part is read, so a part with a bad key is 401 whatever its length; then `part`, the part size.
    """
    return await sync_to_async(_in_thread, thread_sensitive=False)(_part_allowance, scope, part)


def _in_thread(decide: Callable[..., Allowance | Refusal], *args) -> Allowance | Refusal:
    try:
        return decide(*args)
    finally:
        connections.close_all()  # a worker thread outside any request: hand its connection back


def _part_allowance(scope: Scope, part: Allowance) -> Allowance | Refusal:
    access = caller_from_headers(headers_of(scope), scope)
    if isinstance(access, Refusal):
        return access
    if not access.can(Capability.REGISTER):
        return Refusal(403, "forbidden", "This caller may not register revisions in this tenant.")
    return part


def upload_allowance(scope: Scope) -> Allowance | Refusal:
    headers = headers_of(scope)
    access = caller_from_headers(headers, scope)
    if isinstance(access, Refusal):
        return access
    if not access.can(Capability.REGISTER):
        return Refusal(403, "forbidden", "This caller may not register revisions in this tenant.")
    tenant = access.tenant
    held = _idempotency_refusal(headers, scope, access)
    if held is not None:
        return held
    # The upload counts against the caller's API write rate here, once, whatever becomes of its body: a
    # throttled caller sends none, and one refused for size still spent a write.
    refused = api_write_refusal(tenant=tenant, key=access.actor.key, user=access.actor.user)
    if refused is not None:  # the key's or person's rate, or the tenant's (both named in the message)
        return Refusal(429, "rate_limited", str(refused.detail), {"Retry-After": str(refused.wait)})
    scope[GATE_COUNTED] = True  # the DRF throttle does not count it again
    use = selectors.storage_use(tenant=tenant)
    if use.revisions >= tenant.max_revisions:
        return Refusal(
            429,
            "storage_quota_exceeded",
            f"Tenant {tenant.slug} keeps {use.revisions} revisions, its limit (max_revisions={tenant.max_revisions}).",
        )
    room = tenant.max_storage_bytes - use.bytes
    if room < tenant.max_upload_bytes:
        return Allowance(
            max(0, room) + MULTIPART_SLACK,
            Refusal(
                429,
                "storage_quota_exceeded",
                f"Tenant {tenant.slug} stores {use.bytes} bytes; this upload would pass its limit "
                f"(max_storage_bytes={tenant.max_storage_bytes}).",
            ),
        )
    return Allowance(
        tenant.max_upload_bytes + MULTIPART_SLACK,
        Refusal(
            413,
            "payload_too_large",
            f"The upload is over tenant {tenant.slug}'s limit of {tenant.max_upload_bytes} bytes (max_upload_bytes).",
        ),
    )


def _idempotency_refusal(headers: dict[str, str], scope: Scope, access: Access) -> Refusal | None:
    """An API upload's Idempotency-Key, checked before its body is sent: a malformed key is 400, and the retry of
    an upload still being handled is 409 `idempotency_in_progress` without sending it all again
    (tenants/idempotency.py answers everything else once the body is read)."""
    key = headers.get("idempotency-key")
    if key is None or not scope.get("path", "").startswith(idempotency.API_PREFIX):
        return None
    key = key.strip()
    problem = idempotency.key_problem(key, scope["path"])
    if problem is not None:
        return Refusal(400, *problem)
    actor = access.actor
    who = idempotency.scope_for(
        api_key_id=actor.key.id if actor.key is not None else None,
        user_id=actor.user.pk if actor.user is not None else None,
        tenant_id=access.tenant.id,
    )
    if idempotency.running_elsewhere(scope=who, key=key):
        return Refusal(
            409,
            "idempotency_in_progress",
            "A request with this Idempotency-Key is still being handled; retry shortly to get its answer.",
            {"Retry-After": "1"},
        )
    return None
