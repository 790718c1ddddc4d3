"""`Idempotency-Key` on the REST API's POSTs: a retry gets the first answer instead of doing the work twice.

A POST under `/api/v1/` may carry `Idempotency-Key: <1-255 visible ASCII characters>`. The first
request with a key claims it (a row inserted under a unique constraint: of two racing requests
exactly one inserts, and only that one runs) and its answer is kept with it for
MINT_IDEMPOTENCY_TTL_S (24 h by default). Then, for the same key from the same caller:

- the same request again gets the kept answer, status and body, with `Idempotent-Replayed: true`;
- while the first still runs, `409 idempotency_in_progress` (with Retry-After);
- a different request (method, path, or body) gets `422 idempotency_key_reused`, naming what differs.

"The same caller" is one credential in one tenant: an API key (`key:<id>`), or a signed-in person in the
tenant the request acts for (`user:<id>@tenant:<id>`). Another key, person or tenant sending the same key
string has a claim of its own and never sees this one's answer. A request whose credential does not
authenticate claims nothing (the view refuses it as usual).

The body is compared by its SHA-256: the raw bytes of a JSON or form body; for a multipart upload, its
fields and, per file, field name, file name, size and SHA-256 (taken while the body streamed in, see
adapters.apis.DigestUploadHandler), since a client's retry frames the same files with a new boundary.

Answers that say "try again" are not kept, so a retry runs again: 401, 403, 408, 425, 429 and every
5xx (also when the view raised). An answer over MINT_IDEMPOTENCY_MAX_RESPONSE_BYTES is not kept either;
its key stays used, and a retry gets `409 idempotency_response_not_kept` with the first status. A claim
whose process died is taken over by a retry once MINT_IDEMPOTENCY_LOCK_S has passed. A tenant keeps at most
MINT_IDEMPOTENCY_MAX_KEYS_PER_TENANT live keys (the rows are on the database every tenant shares): a new key
past that gets `429 idempotency_keys_exhausted`; retries of kept keys still get their answers. Expired rows are
deleted hourly (tenants.tasks.idempotency_purge). The answer to `POST /api/v1/keys/` holds a token that
is shown once and stored nowhere, so that route refuses the header (`400 idempotency_not_supported`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.urls import Resolver404, resolve
from django.utils import timezone

from mint_site.errors import error_body
from tenants import selectors
from tenants.auth import SESSION_TENANT_KEY, TENANT_HEADER, KeyRefused, live_key
from tenants.keys import bearer_token
from tenants.models import IdempotencyRecord

HEADER = "HTTP_IDEMPOTENCY_KEY"
REPLAYED_HEADER = "Idempotent-Replayed"
API_PREFIX = "/api/v1/"
KEY_MAX_LENGTH = 255  # IdempotencyRecord.key's column
# Creating an API key answers with its token, and signing in with a session and its CSRF token: secrets MinT
# never stores, so no answer of those routes is kept.
NEVER_KEPT = re.compile(r"^/api/v1/(keys|session)/$")
# Answers that tell the client to try again (or were failures of the server): not kept, a retry runs.
RUN_AGAIN = frozenset({401, 403, 408, 425, 429})
_KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")
_PATH_CHARS = IdempotencyRecord._meta.get_field("path").max_length
_HASH_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class Caller:
    """Whose claim a key is: one API key, or one person acting in one tenant (None: no tenant)."""

    scope: str
    tenant_id: int | None
    api_key_id: int | None
    user_id: int | None


@dataclass(frozen=True)
class Claim:
    """This request holds the key (`record_id`) and runs; its answer is kept or the claim released after."""

    record_id: int


def scope_for(*, api_key_id: int | None, user_id: int | None, tenant_id: int | None) -> str:
    """The claim scope of a credential: an API key alone, or a person in a tenant."""
    if api_key_id is not None:
        return f"key:{api_key_id}"
    return f"user:{user_id}@tenant:{tenant_id if tenant_id is not None else '-'}"


def caller_of(request: HttpRequest) -> Caller | None:
    """The credential a request authenticates with, resolved as the API resolves it; None if it does not."""
    token = bearer_token(request.META.get("HTTP_AUTHORIZATION", ""))
    if token is not None:
        # A refused token claims nothing; the view then answers it (401, or 429 past the failure limits:
        # tenants.auth.authenticate_token counts it there, once).
        try:
            key = live_key(token)
        except KeyRefused:
            return None
        scope = scope_for(api_key_id=key.id, user_id=None, tenant_id=key.tenant_id)
        return Caller(scope=scope, tenant_id=key.tenant_id, api_key_id=key.id, user_id=None)
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    named = request.META.get(TENANT_HEADER) or request.session.get(SESSION_TENANT_KEY)
    membership = selectors.choose_tenant(user=user, named=named).membership
    tenant_id = membership.tenant_id if membership is not None else None
    return Caller(
        scope=scope_for(api_key_id=None, user_id=user.pk, tenant_id=tenant_id),
        tenant_id=tenant_id,
        api_key_id=None,
        user_id=user.pk,
    )


def request_fingerprint(request: HttpRequest, view_class: type | None = None) -> str:
    """SHA-256 of what makes a request the same request: method, path, query, media type and body.

    A multipart body counts by its fields and files (name, size, SHA-256), not its bytes: a retry frames
    the same files with a new boundary. Parsing it here readies the request as the view's parsers would
    (`prepare_request`), so the view then reads the files this parse produced.
    """
    digest = hashlib.sha256()

    def add(*items) -> None:
        digest.update(json.dumps(items, separators=(",", ":")).encode() + b"\n")

    add(request.method, request.path, request.META.get("QUERY_STRING", ""), request.content_type or "")
    if request.content_type == "multipart/form-data":
        for parser in getattr(view_class, "parser_classes", ()):
            prepare = getattr(parser, "prepare_request", None)
            if prepare is not None:
                prepare(request)
        fields, files = request.POST, request.FILES
        for name in sorted(fields):
            add("field", name, fields.getlist(name))
        for name in sorted(files):
            for upload in files.getlist(name):
                add("file", name, upload.name, upload.size, _file_sha256(upload))
    else:
        add("body")
        digest.update(request.body)
    return digest.hexdigest()


def _file_sha256(upload) -> str:
    known = getattr(upload, "sha256", None)
    if known is not None:
        return known
    digest = hashlib.sha256()
    if hasattr(upload, "temporary_file_path"):
        with open(upload.temporary_file_path(), "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()
    upload.seek(0)
    while chunk := upload.read(_HASH_CHUNK):
        digest.update(chunk)
    upload.seek(0)
    return digest.hexdigest()


def _error(status: int, code: str, message: str, detail=None, headers: dict[str, str] | None = None) -> JsonResponse:
    response = JsonResponse(error_body(code, message, detail), status=status)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def _tenant_full(caller: Caller, key: str) -> JsonResponse | None:
    """429 when the caller's tenant already keeps MINT_IDEMPOTENCY_MAX_KEYS_PER_TENANT live keys and `key` is a
    new one: the rows (answers included) are on the database every tenant shares. Counted up to the bound only."""
    bound = settings.MINT_IDEMPOTENCY_MAX_KEYS_PER_TENANT
    if caller.tenant_id is None or IdempotencyRecord.objects.filter(scope=caller.scope, key=key).exists():
        return None
    live = IdempotencyRecord.objects.filter(tenant_id=caller.tenant_id, expires_at__gt=timezone.now())
    if live[:bound].count() < bound:
        return None
    return _error(
        429,
        "idempotency_keys_exhausted",
        f"This tenant keeps {bound} Idempotency-Key answers already (MINT_IDEMPOTENCY_MAX_KEYS_PER_TENANT); each "
        f"is kept {settings.MINT_IDEMPOTENCY_TTL_S // 3600} h. Send the request without the header, or retry later.",
        headers={"Retry-After": "60"},
    )


def _applies(request: HttpRequest) -> bool:
    return request.method == "POST" and request.path.startswith(API_PREFIX) and HEADER in request.META


def key_problem(key: str, path: str) -> tuple[str, str] | None:
    """(code, message) of the 400 a malformed key (or a route that takes none) gets, or None."""
    limit = min(settings.MINT_IDEMPOTENCY_KEY_MAX_LENGTH, KEY_MAX_LENGTH)
    if len(key) > limit:
        return (
            "idempotency_key_too_long",
            f"The Idempotency-Key is {len(key)} characters long; at most {limit} are accepted.",
        )
    if not key or not _KEY_CHARS.match(key):
        return (
            "invalid_idempotency_key",
            f"The Idempotency-Key must be 1 to {limit} visible ASCII characters (a UUID is a good choice).",
        )
    if NEVER_KEPT.match(path):
        return (
            "idempotency_not_supported",
            f"{path} answers with a secret shown once, which is never stored; send it without Idempotency-Key and "
            "keep the answer.",
        )
    return None


def running_elsewhere(*, scope: str, key: str) -> bool:
    """Whether a request holding `key` for `scope` is still being handled (the upload gate asks before a body
    is read: a retry of a running upload need not send it again to hear 409)."""
    return IdempotencyRecord.objects.filter(
        scope=scope, key=key, state=IdempotencyRecord.State.IN_PROGRESS, locked_until__gt=timezone.now()
    ).exists()


def begin(request: HttpRequest) -> Claim | HttpResponse | None:
    """Before the view: a claim to run under, an answer to give instead (replay, refusal), or None (no key)."""
    key = request.META[HEADER].strip()
    problem = key_problem(key, request.path)
    if problem is not None:
        return _error(400, *problem)
    caller = caller_of(request)
    if caller is None:
        return None  # the view refuses the credential; nothing to keep
    try:
        view_class = getattr(resolve(request.path_info).func, "cls", None)
    except Resolver404:
        return None
    try:
        fingerprint = request_fingerprint(request, view_class)
    except (RequestDataTooBig, TooManyFilesSent, TooManyFieldsSent, MultiPartParserError) as exc:
        too_big = isinstance(exc, RequestDataTooBig)
        code = "payload_too_large" if too_big else "too_many_files" if isinstance(exc, TooManyFilesSent) else None
        return _error(413 if too_big else 400, code or "invalid_request", f"The request body was refused: {exc}")
    return claim(caller=caller, key=key, method=request.method, path=request.path, fingerprint=fingerprint)


def claim(*, caller: Caller, key: str, method: str, path: str, fingerprint: str) -> Claim | HttpResponse:
    """Claim `key` for this request (insert first: the unique constraint picks one of racing requests), or the
    answer a request that finds it claimed gets."""
    path = path[:_PATH_CHARS]
    if (refused := _tenant_full(caller, key)) is not None:
        return refused
    for _ in range(3):
        now = timezone.now()
        try:
            with transaction.atomic():
                record = IdempotencyRecord.objects.create(
                    scope=caller.scope,
                    key=key,
                    tenant_id=caller.tenant_id,
                    api_key_id=caller.api_key_id,
                    user_id=caller.user_id,
                    method=method,
                    path=path,
                    fingerprint=fingerprint,
                    locked_until=now + timedelta(seconds=settings.MINT_IDEMPOTENCY_LOCK_S),
                    expires_at=now + timedelta(seconds=settings.MINT_IDEMPOTENCY_TTL_S),
                )
            return Claim(record.id)
        except IntegrityError:
            pass
        existing = IdempotencyRecord.objects.filter(scope=caller.scope, key=key).first()
        if existing is None:
            continue  # purged meanwhile
        if existing.expires_at <= now:
            IdempotencyRecord.objects.filter(id=existing.id, expires_at__lte=now).delete()
            continue
        differs = [
            what
            for what, first, this in (
                ("method", existing.method, method),
                ("path", existing.path, path),
                ("body", existing.fingerprint, fingerprint),
            )
            if first != this
        ]
        if differs:
            return _error(
                422,
                "idempotency_key_reused",
                f"This Idempotency-Key was used for a different request ({existing.method} {existing.path}; "
                f"{', '.join(differs)} differ). Use a new key for a new request.",
                {"differs": differs, "first_request": f"{existing.method} {existing.path}"},
            )
        if existing.state == IdempotencyRecord.State.COMPLETED:
            return replay(existing)
        if existing.locked_until > now:
            return _in_progress()
        # The first request's process died holding the key (its lease ran out): this one runs instead.
        taken = IdempotencyRecord.objects.filter(
            id=existing.id, state=IdempotencyRecord.State.IN_PROGRESS, locked_until=existing.locked_until
        ).update(locked_until=now + timedelta(seconds=settings.MINT_IDEMPOTENCY_LOCK_S))
        if taken == 1:
            return Claim(existing.id)
    return _in_progress()


def _in_progress() -> JsonResponse:
    return _error(
        409,
        "idempotency_in_progress",
        "A request with this Idempotency-Key is still being handled; retry shortly to get its answer.",
        headers={"Retry-After": "1"},
    )


def replay(record: IdempotencyRecord) -> HttpResponse:
    """The kept answer of a completed request."""
    if record.response_body is None:
        return _error(
            409,
            "idempotency_response_not_kept",
            f"The request with this Idempotency-Key was handled (status {record.status_code}), but its answer "
            f"was larger than the {settings.MINT_IDEMPOTENCY_MAX_RESPONSE_BYTES} bytes kept; read the result "
            "with a GET.",
            {"status": record.status_code},
        )
    response = HttpResponse(
        bytes(record.response_body), status=record.status_code, content_type=record.content_type or None
    )
    response[REPLAYED_HEADER] = "true"
    return response


def finish(held: Claim, response: HttpResponse) -> None:
    """After the view: keep its answer with the key, or release the key so that a retry runs again."""
    status = response.status_code
    pending = IdempotencyRecord.objects.filter(id=held.record_id, state=IdempotencyRecord.State.IN_PROGRESS)
    if status >= 500 or status in RUN_AGAIN:
        pending.delete()
        return
    body = None if response.streaming else bytes(response.content)
    if body is not None and len(body) > settings.MINT_IDEMPOTENCY_MAX_RESPONSE_BYTES:
        body = None
    pending.update(
        state=IdempotencyRecord.State.COMPLETED,
        status_code=status,
        content_type=response.get("Content-Type", "")[:200],
        response_body=body,
        locked_until=timezone.now(),
    )


def release(held: Claim) -> None:
    IdempotencyRecord.objects.filter(id=held.record_id, state=IdempotencyRecord.State.IN_PROGRESS).delete()


class IdempotencyMiddleware:
    """Django middleware (after sessions and authentication) applying `Idempotency-Key` to `/api/v1/` POSTs.

    Sync and async: requests without the header pass straight through; the database work for those with it
    runs in a thread.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if self.is_async:
            return self.__acall__(request)
        if not _applies(request):
            return self.get_response(request)
        outcome = begin(request)
        if isinstance(outcome, HttpResponse):
            return outcome
        if outcome is None:
            return self.get_response(request)
        try:
            response = self.get_response(request)
        except BaseException:
            release(outcome)
            raise
        finish(outcome, response)
        return response

    async def __acall__(self, request: HttpRequest):
        if not _applies(request):
            return await self.get_response(request)
        outcome = await sync_to_async(begin)(request)
        if isinstance(outcome, HttpResponse):
            return outcome
        if outcome is None:
            return await self.get_response(request)
        try:
            response = await self.get_response(request)
        except BaseException:
            await sync_to_async(release)(outcome)
            raise
        await sync_to_async(finish)(outcome, response)
        return response


def idempotency_purge(*, now: datetime | None = None, batch: int = 10_000) -> int:
    """Delete the records whose time is over, a batch at a time; returns how many went."""
    now = now or timezone.now()
    removed = 0
    while True:
        ids = list(IdempotencyRecord.objects.filter(expires_at__lte=now).values_list("id", flat=True)[:batch])
        if not ids:
            return removed
        removed += IdempotencyRecord.objects.filter(id__in=ids).delete()[0]
        if len(ids) < batch:
            return removed
