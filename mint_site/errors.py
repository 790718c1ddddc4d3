"""One mapping from exceptions to HTTP errors, in the OpenAI-style shape.

Every API error body is `{"error": {"code": …, "message": …, "detail"?: …}}`, so
pipelines and the `openai` client can read failures the same way everywhere.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response

log = logging.getLogger(__name__)


class MintError(Exception):
    """An error the API reports as-is: a status, a machine code and a sentence for people."""

    status_code = status.HTTP_400_BAD_REQUEST
    code = "invalid_request"

    def __init__(
        self, message: str, *, code: str | None = None, detail: Any = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        self.detail = detail
        self.headers = headers or {}


class Conflict(MintError):
    status_code = status.HTTP_409_CONFLICT
    code = "conflict"


class QuotaExceeded(MintError):
    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    code = "quota_exceeded"


class PayloadTooLarge(MintError):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    code = "payload_too_large"


class NotFound(MintError):
    status_code = status.HTTP_404_NOT_FOUND
    code = "not_found"


def error_body(code: str, message: str, detail: Any = None) -> dict:
    error: dict[str, Any] = {"code": code, "message": message}
    if detail is not None:
        error["detail"] = detail
    return {"error": error}


def _flatten(detail: Any, prefix: str = "") -> list[str]:
    """DRF validation details as `field: message` lines, so the message names the field."""
    if isinstance(detail, dict):
        lines = []
        for key, value in detail.items():
            name = key if key != "non_field_errors" else ""
            lines += _flatten(value, f"{prefix}.{name}" if prefix and name else (name or prefix))
        return lines
    if isinstance(detail, list):
        lines = []
        for index, value in enumerate(detail):
            sub = prefix if not isinstance(value, (dict, list)) else f"{prefix}[{index}]"
            lines += _flatten(value, sub)
        return lines
    return [f"{prefix}: {detail}" if prefix else str(detail)]


def _drf_code(exc: exceptions.APIException) -> str:
    codes = exc.get_codes()
    if isinstance(codes, str):
        return codes
    return "invalid_request"


# Django's refusals of a request body it was parsing (mint_site/uploads.py counts files per route).
_BODY_REFUSALS = {
    TooManyFilesSent: "too_many_files",
    TooManyFieldsSent: "too_many_fields",
    RequestDataTooBig: "payload_too_large",
}


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, MintError):
        return Response(error_body(exc.code, exc.message, exc.detail), status=exc.status_code, headers=exc.headers)
    for kind, code in _BODY_REFUSALS.items():
        if isinstance(exc, kind):
            return Response(error_body(code, str(exc)), status=413 if code == "payload_too_large" else 400)
    if isinstance(exc, Http404):
        return Response(error_body("not_found", "Not found."), status=404)
    if isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, exceptions.ValidationError):
        lines = _flatten(exc.detail)
        return Response(error_body("invalid_request", "; ".join(lines), exc.detail), status=400)
    if isinstance(exc, exceptions.ParseError):
        return Response(error_body("invalid_json", f"Request body could not be parsed: {exc.detail}"), status=400)
    if isinstance(exc, exceptions.APIException):
        headers = {}
        if getattr(exc, "auth_header", None):
            headers["WWW-Authenticate"] = exc.auth_header
        if getattr(exc, "wait", None):
            headers["Retry-After"] = str(int(exc.wait))
        code = _drf_code(exc)
        return Response(error_body(code, str(exc.detail)), status=exc.status_code, headers=headers)
    return None


def json_404(request, exception=None) -> JsonResponse:
    return JsonResponse(error_body("not_found", f"No route for {request.path}."), status=404)


def json_500(request) -> JsonResponse:
    return JsonResponse(error_body("server_error", "The server failed to handle this request."), status=500)


class InvalidTransition(Conflict):
    """A state change asked of an object that is not in a state it can make it from."""

    code = "invalid_transition"


class Forbidden(MintError):
    status_code = status.HTTP_403_FORBIDDEN
    code = "forbidden"
