"""Forwarding to vLLM: pick the least-loaded ready target, rename the model, relay the answer.

Tenants never see what is behind the gateway: the body sent to the node names the LoRA,
and every answer (JSON or server-sent events) names the model string the caller sent.
One pooled transport per event loop carries all requests (`upstream.UpstreamTransport`:
keep-alive HTTP/1.1 with a C parser), called directly: httpx's client layer (redirects,
cookies, auth, hooks) and its own transport cost ~600 µs of CPU a request together, and
the gateway needs none of it. Tests replace it with `set_transport()`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import httpx
from django.conf import settings

from serving.gateway import GatewayError, Reply, usage
from serving.gateway.metrics import UPSTREAM_ERRORS
from serving.gateway.resolve import NotReady, Resolution, Target
from serving.gateway.upstream import UpstreamTransport

log = logging.getLogger(__name__)

# Requests in flight per placement id, in this process. Routing goes to the smallest count.
inflight: Counter[int] = Counter()

# Errors where nothing came back from the node: the request can safely go to another node.
_NOTHING_CAME_BACK = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.WriteError)
# Upstream 4xx answers the caller must see (bad parameters, prompt too long), with LoRA names scrubbed.
_CALLER_ERRORS = {400, 413, 422}

_transport: httpx.AsyncBaseTransport | None = None
_transports: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncBaseTransport] = (
    weakref.WeakKeyDictionary()
)


def set_transport(replacement: httpx.AsyncBaseTransport | None) -> None:
    """Send upstream requests through `replacement` (an `httpx.MockTransport` in tests); None restores the network."""
    global _transport
    _transport = replacement
    _transports.clear()


def transport() -> httpx.AsyncBaseTransport:
    """The pooled transport of the running event loop."""
    loop = asyncio.get_running_loop()
    found = _transports.get(loop)
    if found is None:
        found = _transport or UpstreamTransport(max_connections=settings.MINT_GATEWAY_MAX_CONNECTIONS)
        _transports[loop] = found
    return found


@functools.lru_cache(maxsize=4096)
def _url(node_url: str, path: str) -> httpx.URL:
    """Parsed once per node and path: parsing a URL string costs more than the rest of building a request."""
    return httpx.URL(node_url + path)


def _timeouts() -> dict[str, float]:
    """Per-request timeouts, in the form the transport reads from `request.extensions`."""
    return {
        "connect": settings.MINT_GATEWAY_CONNECT_TIMEOUT_S,
        "read": settings.MINT_GATEWAY_READ_TIMEOUT_S,
        "write": 30.0,
        "pool": 10.0,
    }


def pick(targets: tuple[Target, ...], exclude: Collection[int] = ()) -> Target | None:
    """The target with the fewest requests in flight (ties broken at random), or None if all are excluded."""
    candidates = [t for t in targets if t.placement_id not in exclude]
    if not candidates:
        return None
    least = min(inflight[t.placement_id] for t in candidates)
    return random.choice([t for t in candidates if inflight[t.placement_id] == least])


def _releaser(placement_id: int) -> Callable[[], None]:
    inflight[placement_id] += 1
    done = False

    def release() -> None:
        nonlocal done
        if done:
            return
        done = True
        inflight[placement_id] -= 1
        if inflight[placement_id] <= 0:
            del inflight[placement_id]

    return release


async def forward(*, path: str, body: dict[str, Any], resolution: Resolution, model: str) -> Reply:
    """Send a completion request to a ready node and relay its answer, or raise a 502/503/504 `GatewayError`.

    A failure before any byte came back is retried once on another ready target; when no target
    can be reached at all the answer is 503 adapter_not_ready, like for any adapter not ready.
    """
    payload = json.dumps({**body, "model": resolution.lora_name}, ensure_ascii=False).encode()
    tried: set[int] = set()
    for _attempt in range(2):
        target = pick(resolution.targets, tried)
        if target is None:
            break
        tried.add(target.placement_id)
        release = _releaser(target.placement_id)
        try:
            request = httpx.Request(
                "POST",
                _url(target.node_url, path),
                content=payload,
                headers={"content-type": "application/json"},
                extensions={"timeout": _timeouts()},
            )
            sent_at = time.perf_counter()
            upstream = await transport().handle_async_request(request)
        except _NOTHING_CAME_BACK as exc:
            release()
            UPSTREAM_ERRORS.labels(target.node_name).inc()
            log.warning("gateway: node %s failed before answering (%r)", target.node_name, exc)
            continue
        except httpx.TimeoutException as exc:
            release()
            UPSTREAM_ERRORS.labels(target.node_name).inc()
            log.warning("gateway: node %s timed out (%r)", target.node_name, exc)
            raise GatewayError(504, "upstream_timeout", "The serving node did not answer in time.") from None
        except httpx.HTTPError as exc:
            release()
            UPSTREAM_ERRORS.labels(target.node_name).inc()
            log.warning("gateway: node %s failed (%r)", target.node_name, exc)
            raise GatewayError(502, "upstream_error", "The serving node failed to answer.") from None
        except BaseException:
            release()
            raise
        usage.record(placement_id=target.placement_id)
        try:
            reply = await _relay(upstream, release=release, target=target, resolution=resolution, model=model)
            reply.upstream_s = time.perf_counter() - sent_at
            return reply
        except BaseException:
            release()
            await upstream.aclose()
            raise
    # Every ready node refused the connection (an engine died before the heartbeat saw it): for the
    # caller that is an adapter not ready yet, and the heartbeat takes the node out of routing.
    raise NotReady(
        f"Revision r{resolution.revision_number} of adapter {resolution.adapter_name!r} has no reachable node "
        "right now; retry shortly.",
        adapter_name=resolution.adapter_name,
    )


async def _relay(
    upstream: httpx.Response, *, release: Callable[[], None], target: Target, resolution: Resolution, model: str
) -> Reply:
    lora = resolution.lora_name
    streaming = upstream.status_code == 200 and upstream.headers.get("content-type", "").startswith("text/event-stream")
    if streaming:
        relay = _SSERelay(upstream, release=release, lora=lora, model=model, node_name=target.node_name)
        return Reply(
            200,
            content_type="text/event-stream",
            # Proxies in front must not hold events back.
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            stream=relay.events(),
            close=relay.finish,
        )
    try:
        content = await upstream.aread()
    except httpx.TimeoutException:
        UPSTREAM_ERRORS.labels(target.node_name).inc()
        raise GatewayError(504, "upstream_timeout", "The serving node did not finish in time.") from None
    except httpx.HTTPError:
        UPSTREAM_ERRORS.labels(target.node_name).inc()
        raise GatewayError(502, "upstream_error", "The serving node broke off its answer.") from None
    finally:
        release()
        await upstream.aclose()
    status = upstream.status_code
    if 200 <= status < 300:
        try:
            data = json.loads(content)
        except ValueError:
            UPSTREAM_ERRORS.labels(target.node_name).inc()
            raise GatewayError(502, "upstream_error", "The serving node answered with malformed JSON.") from None
        return Reply.json(_rewrite(data, lora=lora, model=model), status)
    if status == 404:
        # The node does not hold the LoRA after all (it restarted): the reconciler will notice;
        # meanwhile the caller retries like for any cold adapter.
        UPSTREAM_ERRORS.labels(target.node_name).inc()
        raise NotReady(
            f"Revision r{resolution.revision_number} of adapter {resolution.adapter_name!r} is being reloaded; "
            "retry shortly.",
            adapter_name=resolution.adapter_name,
        )
    if status in _CALLER_ERRORS:
        message = _upstream_message(content) or "The serving node refused the request."
        return GatewayError(status, "invalid_request", message.replace(lora, model)).reply()
    UPSTREAM_ERRORS.labels(target.node_name).inc()
    log.warning("gateway: node %s answered %s: %s", target.node_name, status, content[:500])
    raise GatewayError(502, "upstream_error", f"The serving node failed (HTTP {status}).")


def _upstream_message(content: bytes) -> str | None:
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return None


def _rewrite(data: Any, *, lora: str, model: str) -> Any:
    """Name the caller's model where vLLM named the LoRA: the `model` field and any error message."""
    if isinstance(data, dict):
        if "model" in data:
            data["model"] = model
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            error["message"] = error["message"].replace(lora, model)
    return data


class _SSERelay:
    """The body of a streamed answer: vLLM's events, one by one, with `model` renamed in each.

    The server calls `finish()` when the answer is over, also when the client went away
    before or during the stream; the upstream response is then closed and the in-flight
    count released, whichever of the two paths gets there first.
    """

    def __init__(self, upstream: httpx.Response, *, release: Callable[[], None], lora: str, model: str, node_name: str):
        self._upstream = upstream
        self._release = release
        self._lora = lora
        self._model = model
        self._node_name = node_name
        self._finished = False

    async def events(self) -> AsyncIterator[bytes]:
        event: list[str] = []
        try:
            async for line in self._upstream.aiter_lines():
                if line:
                    event.append(self._line(line))
                    continue
                if event:  # a blank line ends an event: send it whole
                    yield ("\n".join(event) + "\n\n").encode()
                    event = []
            if event:
                yield ("\n".join(event) + "\n\n").encode()
        except httpx.HTTPError as exc:
            # Headers are gone already: report the failure the way vLLM does inside a stream.
            UPSTREAM_ERRORS.labels(self._node_name).inc()
            log.warning("gateway: stream from node %s broke off (%r)", self._node_name, exc)
            error = GatewayError(502, "upstream_error", "The serving node broke off the stream.").body()
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            await self.finish()

    def _line(self, line: str) -> str:
        if not line.startswith("data:"):
            return line
        payload = line[5:].strip()
        if payload == "[DONE]":
            return "data: [DONE]"
        try:
            data = json.loads(payload)
        except ValueError:
            return line.replace(self._lora, self._model)
        data = _rewrite(data, lora=self._lora, model=self._model)
        return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":"))

    async def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._release()
        await self._upstream.aclose()


async def aclose() -> None:
    """Close the running loop's pooled transport (at loop shutdown, and in tests that run one loop per call)."""
    found = _transports.pop(asyncio.get_running_loop(), None)
    if found is not None:
        await found.aclose()


def clear() -> None:
    """Forget in-flight counts and clients, and restore the network transport (tests)."""
    inflight.clear()
    set_transport(None)
