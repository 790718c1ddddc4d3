"""Typed errors for every way a MinT call can fail.

The server answers every error as `{"error": {"code", "message", "detail"?}}` with an HTTP status;
`error_from_response` turns that into the subclass of `MintError` its status (and for a few, its code)
names, so callers catch what they can act on: `NotFound`, `FourEyesRefused`, `RateLimited`, ...
"""

from __future__ import annotations

from typing import Any

import httpx


class MintError(Exception):
    """A MinT call failed: `code` (machine-readable), `message` (for people), `status` (HTTP, None when no
    answer came), `detail` (the server's structured detail, if any)."""

    default_code = "error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status: int | None = None,
        detail: Any = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.status = status
        self.detail = detail
        self.retry_after = retry_after

    def __str__(self) -> str:
        where = f"{self.status} " if self.status is not None else ""
        return f"{where}{self.code}: {self.message}"

    def as_json(self) -> dict:
        error: dict[str, Any] = {"code": self.code, "message": self.message, "status": self.status}
        if self.detail is not None:
            error["detail"] = self.detail
        return {"error": error}


class ConfigurationError(MintError):
    """The client is missing its base URL or API key (or was given something unusable)."""

    default_code = "configuration"


class ValidationError(MintError):
    """400/422: the request was refused as invalid (a field, an upload that is no adapter, ...)."""

    default_code = "invalid_request"


class PayloadTooLarge(ValidationError):
    """413: an upload or body over a limit of the tenant or the platform."""

    default_code = "payload_too_large"


class AuthError(MintError):
    """401: the API key is missing, malformed, revoked or expired (or a session's password was not right)."""

    default_code = "not_authenticated"


class NotSignedIn(AuthError):
    """No valid session for the base URL (none stored, or it expired or was ended): sign in again (`mint login`)."""

    default_code = "not_signed_in"


class LoginLockedOut(AuthError):
    """429 `login_locked_out`: too many wrong passwords for this username from this address; `retry_after` says
    when to try again (each attempt before then starts the wait again)."""

    default_code = "login_locked_out"


class PermissionDenied(MintError):
    """403: the key's scope or its creator's role does not allow the call."""

    default_code = "forbidden"


class FourEyesRefused(PermissionDenied):
    """403 `four_eyes`: nobody approves a revision they registered (nor with a key they created)."""

    default_code = "four_eyes"


class NotFound(MintError):
    """404: no such adapter, revision, ... (another tenant's is answered exactly the same)."""

    default_code = "not_found"


class Conflict(MintError):
    """409: the object is not in a state that allows the call (wrong state, a duplicate, a gate)."""

    default_code = "conflict"


class DuplicateRevision(Conflict):
    """409 `duplicate_revision`: the upload equals revision `duplicate_of` (pass allow_duplicate=True)."""

    default_code = "duplicate_revision"

    @property
    def duplicate_of(self) -> str | None:
        return (self.detail or {}).get("duplicate_of") if isinstance(self.detail, dict) else None


class EvaluationGateRefused(Conflict):
    """409 `evaluation_pending` / `evaluation_failed` / `evaluation_unavailable`: approve with an override_reason."""

    default_code = "evaluation_failed"


class QuotaExceeded(MintError):
    """429: a limit of the tenant's plan (storage, adapters, pinned revisions, ...)."""

    default_code = "quota_exceeded"


class RateLimited(QuotaExceeded):
    """429 with Retry-After: too many requests for now; `retry_after` says when to come back."""

    default_code = "throttled"


class Unavailable(MintError):
    """503 (or 502/504): the server or something behind it cannot answer now."""

    default_code = "unavailable"


class NotReady(Unavailable):
    """503 `adapter_not_ready`: nothing serves the adapter yet."""

    default_code = "adapter_not_ready"


class ServerError(MintError):
    """Any other 5xx."""

    default_code = "server_error"


class ConnectionFailed(MintError):
    """No answer came: the connection failed or timed out (after every retry)."""

    default_code = "connection_error"


class UploadInterrupted(ConnectionFailed):
    """A resumable upload stopped before it completed; `Client.resume_upload(adapter, upload_id, path)` goes on."""

    default_code = "upload_interrupted"

    def __init__(self, message: str, *, upload_id: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.upload_id = upload_id


class WaitTimeout(MintError):
    """`wait_for` / `wait_for_alias` gave up before the state was reached."""

    default_code = "wait_timeout"


class RevisionFailed(MintError):
    """The revision ended `failed`: `failure_code` and `failure_reason` are the server's."""

    default_code = "revision_failed"

    def __init__(self, message: str, *, revision: Any = None, failure_code: str = "", failure_reason: str = "") -> None:
        super().__init__(
            message, code=failure_code or "revision_failed", detail={"revision": getattr(revision, "label", None)}
        )
        self.revision = revision
        self.failure_code = failure_code
        self.failure_reason = failure_reason


class RevisionRejected(MintError):
    """The revision was rejected while waiting for it to be approved."""

    default_code = "revision_rejected"


class ActivationFailed(MintError):
    """An alias will not serve the revision asked for: its placement failed, or the activation was withdrawn."""

    default_code = "activation_failed"


_BY_STATUS: dict[int, type[MintError]] = {
    400: ValidationError,
    401: AuthError,
    403: PermissionDenied,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: ValidationError,
    429: QuotaExceeded,
    502: Unavailable,
    503: Unavailable,
    504: Unavailable,
}
_BY_CODE: dict[str, type[MintError]] = {
    "four_eyes": FourEyesRefused,
    "duplicate_revision": DuplicateRevision,
    "evaluation_pending": EvaluationGateRefused,
    "evaluation_failed": EvaluationGateRefused,
    "evaluation_unavailable": EvaluationGateRefused,
    "adapter_not_ready": NotReady,
    "login_locked_out": LoginLockedOut,
}


def retry_after_of(response: httpx.Response) -> float | None:
    """The Retry-After header in seconds (the delta-seconds form; an HTTP date is ignored), or None."""
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def error_from_response(response: httpx.Response) -> MintError:
    """The typed error for a non-2xx answer, from its `{"error": {...}}` body (or its status alone)."""
    code, message, detail = None, None, None
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        code, message, detail = error.get("code"), error.get("message"), error.get("detail")
    status = response.status_code
    retry_after = retry_after_of(response)
    kind = _BY_CODE.get(code or "") or _BY_STATUS.get(status)
    if kind is QuotaExceeded and (retry_after is not None or code == "throttled"):
        kind = RateLimited
    if kind is None:
        kind = ServerError if status >= 500 else MintError
    text = message or (response.text[:500] if response.text else response.reason_phrase)
    return kind(text, code=code, status=status, detail=detail, retry_after=retry_after)
