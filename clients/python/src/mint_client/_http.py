"""The HTTP edge: bearer auth (or a person's session cookies), typed errors, and retries that are safe to make.

A request is retried (at most `retries` times, with exponential backoff, or the server's Retry-After when
it sends one) when no answer came (a connection that failed, dropped or timed out), on 503, on 429 with
Retry-After (a rate limit; a plan quota without it is final), and on 409 `idempotency_in_progress` (the
first try still runs). Every POST carries an `Idempotency-Key`, the same on each try, so the server runs
it once and answers a retry with the first answer (docs/api.md, "Safe retries"); PUT, GET and DELETE are
idempotent as they are. A POST sent `idempotent=False` (a route that refuses the header: its answer holds a
secret shown once) carries no key and is never retried.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from mint_client.errors import ConnectionFailed, MintError, error_from_response, retry_after_of

RETRY_STATUSES = frozenset({503})
IDEMPOTENCY_HEADER = "Idempotency-Key"
# The server answers this while the first request with the same Idempotency-Key still runs.
IN_PROGRESS = "idempotency_in_progress"

# A body built afresh for each try: multipart files are reopened, so a retry sends them whole.
BodyFactory = Callable[[], dict[str, Any]]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mint-client")
    except Exception:
        return "0"


class Http:
    """One pooled httpx client with MinT's auth, errors and retries."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None,
        timeout: float,
        retries: int,
        backoff: float,
        max_backoff: float,
        transport: httpx.BaseTransport | None,
        sleep: Callable[[float], None],
        headers: dict[str, str] | None = None,
        cookies: dict[str, str] | None = None,
    ) -> None:
        self.retries = max(0, retries)
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.sleep = sleep
        self.client = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={
                **({"Authorization": f"Bearer {api_key}"} if api_key is not None else {}),
                "User-Agent": f"mint-client/{_version()}",
                "Accept": "application/json",
                **(headers or {}),
            },
            cookies=cookies,
            timeout=timeout,
            transport=transport,
            follow_redirects=False,
        )

    def close(self) -> None:
        self.client.close()

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff)
        base = self.backoff * (2**attempt)
        return min(self.max_backoff, base) * (0.5 + random.random() / 2)  # jitter: retries of many clients spread

    def request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        params: dict | None = None,
        content: bytes | None = None,
        body: BodyFactory | None = None,
        headers: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        idempotent: bool = True,
        retries: int | None = None,
    ) -> httpx.Response:
        """Send one request (with retries); the 2xx answer, or the typed `MintError` of the last one."""
        headers = dict(headers or {})
        if method == "POST" and idempotent:
            headers.setdefault(IDEMPOTENCY_HEADER, idempotency_key or uuid.uuid4().hex)
        budget = self.retries if retries is None else retries
        if method == "POST" and not idempotent:
            budget = 0  # without a key, a retry could do the work twice
        attempt = 0
        while True:
            kwargs: dict[str, Any] = {"params": params, "headers": headers}
            closers: list[Callable[[], None]] = []
            if body is not None:
                built = body()
                closers = built.pop("_closers", [])
                kwargs.update(built)
            elif json is not None:
                kwargs["json"] = json
            elif content is not None:
                kwargs["content"] = content
            try:
                response = self.client.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                if attempt >= budget:
                    raise ConnectionFailed(f"{method} {url}: {type(exc).__name__}: {exc}".rstrip(": ")) from exc
                self.sleep(self.delay(attempt, None))
                attempt += 1
                continue
            finally:
                for closer in closers:  # files the body factory opened
                    closer()
            if response.is_success:
                return response
            error = error_from_response(response)
            if attempt < budget and self._retryable(response, error):
                self.sleep(self.delay(attempt, retry_after_of(response)))
                attempt += 1
                continue
            raise error

    @staticmethod
    def _retryable(response: httpx.Response, error: MintError) -> bool:
        if response.status_code in RETRY_STATUSES:
            return True
        if response.status_code == 429:
            return retry_after_of(response) is not None
        return response.status_code == 409 and error.code == IN_PROGRESS


def same_origin(link: str | None, base_url: str) -> str | None:
    """A `next` link as a path and query on the client's own base URL: behind a proxy the server may build it
    with an internal host, and the key is never sent to any host but the one it was given for."""
    if not link:
        return None
    url = httpx.URL(link)
    prefix = httpx.URL(base_url).path.rstrip("/")  # a MinT served under a path: the client adds it again
    path = url.path.removeprefix(prefix) if prefix and url.path.startswith(prefix + "/") else url.path
    return path + (f"?{url.query.decode()}" if url.query else "")
