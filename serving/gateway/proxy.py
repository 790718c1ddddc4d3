"""Forwarding to vLLM: pick the least-loaded ready target, rename the model, relay the answer.

Tenants never see what is behind the gateway: the body sent to the node names the LoRA,
and every answer (JSON or server-sent events) names the model string the caller sent.
All requests go through the state's pooled client (serving/gateway/upstream.py).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from django.conf import settings
from starlette.responses import Response

from serving.gateway import GatewayError
from serving.gateway.fairslots import NodeBusy
from serving.gateway.metering import Tally
from serving.gateway.metrics import NODE_BUSY, UPSTREAM_ERRORS
from serving.gateway.policy.answers import openai_answer
from serving.gateway.resolve import NotReady
from serving.gateway.responses import EventStream, error_response, json_response
from serving.gateway.routes import Resolution, Target
from serving.gateway.upstream import Dropped, NoAnswer, UpstreamError, UpstreamResponse, UpstreamTimeout

if TYPE_CHECKING:
    from serving.gateway.fairslots import FairSlots
    from serving.gateway.nodehealth import NodeHealth
    from serving.gateway.residency import ColdStarts, GpuTiers
    from serving.gateway.upstream import Upstream
    from serving.gateway.usage import Usage

log = logging.getLogger(__name__)

# Upstream 4xx answers the caller must see (bad parameters, prompt too long), with LoRA names scrubbed.
_CALLER_ERRORS = {400, 413, 422}
# Nodes that may receive one request none of them answered (`Dropped`: each closed the connection on it). Two
# covers a node killed under an innocent request; a request that itself kills the engine it reaches takes down
# no more than that, however many replicas its revision has (other tenants' requests share those engines).
MAX_DROPS = 2


class ProxyState(Protocol):
    """What forwarding uses of the gateway's state (serving/gateway/state.py builds it)."""

    upstream: Upstream
    node_slots: FairSlots
    nodes: NodeHealth
    inflight: Counter[int]  # requests in flight per placement id
    gpu: GpuTiers
    cold: ColdStarts
    usage: Usage


@dataclass(frozen=True)
class AnswerRules:
    """What a non-streamed answer may carry beyond OpenAI's fields (`keep`, of each choice) and a `check` of the
    node's whole answer that may refuse it (a GatewayError); serving/gateway/sampling.py sets both."""

    keep: frozenset[str] = frozenset()
    check: Callable[[dict[str, Any]], None] | None = None


def pick(
    inflight: Counter[int],
    targets: tuple[Target, ...],
    exclude: Collection[int] = (),
    *,
    suspect: Callable[[str], bool] | None = None,
    active: Callable[[Target], bool] | None = None,
) -> Target | None:
    """The target to send a request to next, or None if all are excluded.

    Nodes that failed to answer lately (`suspect`) come last, then draining nodes (they serve only until the
    revision is ready elsewhere), then the rest; inside the first group present, the target with the fewest
    requests in flight, and among those a node where the adapter is likely active in the GPU batch already
    (`active`: serving/gateway/residency.py GpuTiers) before one where vLLM would swap it in (ties at random).
    """
    candidates = [t for t in targets if t.placement_id not in exclude]
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    if suspect is not None or any(t.draining for t in candidates):
        tier = {t.placement_id: 2 * bool(suspect and suspect(t.node_name)) + t.draining for t in candidates}
        best = min(tier.values())
        candidates = [t for t in candidates if tier[t.placement_id] == best]
    least = min(inflight[t.placement_id] for t in candidates)
    candidates = [t for t in candidates if inflight[t.placement_id] == least]
    if active is not None and len(candidates) > 1:
        candidates = [t for t in candidates if active(t)] or candidates
    return random.choice(candidates)


def _releaser(inflight: Counter[int], placement_id: int) -> Callable[[], None]:
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


async def forward(
    state: ProxyState,
    *,
    path: str,
    body: dict[str, Any],
    resolution: Resolution,
    model: str,
    tenant_id: int,
    tally: Tally | None = None,
    answer: AnswerRules = AnswerRules(),
) -> tuple[Response, float]:
    """Send a completion request to a ready node and relay its answer, or raise a 502/503/504 `GatewayError`.

    Returns the response and the seconds spent waiting on the node (to its headers, for a stream).

    Failover: a request that got nothing back from a node (the connection failed, or closed before any byte
    of an answer: `NoAnswer`) is sent to the next ready replica, and so is one whose node answered 404 (it
    lost the adapter: it restarted), until each replica was tried once; a completion has no side effects,
    so sending it again is safe. The node is remembered as failing (serving/gateway/nodehealth.py): the
    next requests try it last, and the control plane is asked to probe it now. When no replica answers,
    the caller gets 503 adapter_not_ready with Retry-After, like for any adapter not ready; but once
    MAX_DROPS nodes had the request and closed the connection on it (`Dropped`), it gets 502 and no further
    replica is tried: a request that kills the engine it reaches does not go on to kill every replica.
    Nothing is retried once a node began to answer: a stream under way when its node dies is cut (the client
    sees the error event), and so is a timeout (504).

    The request holds one of the node's fair slots (serving/gateway/fairslots.py) from before it is sent until
    the node's answer is closed, in the name of `tenant_id`.
    When the chosen node's slots are all taken another ready node with a free one is tried first; otherwise
    the request waits its turn, at most MINT_GATEWAY_NODE_WAIT_S (then 503 node_busy).
    """
    tenant = tenant_id
    slots = state.node_slots
    nodes = state.nodes
    suspect = nodes.suspect if nodes.any_suspect() else None
    tally = tally if tally is not None else Tally()
    # Metering needs a stream's usage: its totals (the last chunk) and, for a stream that ends before them (the
    # client left, a time limit, the node broke off), the running usage of every chunk. Both are asked of vLLM
    # whatever the client asked, and what it did not ask for is kept from it.
    hide_usage = show_running = False
    if body.get("stream"):
        asked = body.get("stream_options") or {}
        hide_usage = not asked.get("include_usage")
        show_running = not hide_usage and bool(asked.get("continuous_usage_stats"))
        body = {**body, "stream_options": {**asked, "include_usage": True, "continuous_usage_stats": True}}
    payload = json.dumps({**body, "model": resolution.lora_name}, ensure_ascii=False).encode()
    tried: set[int] = set()
    lost = False  # a node answered 404: it does not hold the adapter (any more)
    drops = 0  # nodes that had the request and closed the connection on it
    state.cold.maybe_spread(resolution, state.inflight)
    for _attempt in range(len(resolution.targets)):
        target = pick(state.inflight, resolution.targets, tried, suspect=suspect, active=state.gpu.holds)
        if target is None:
            break
        slot = slots.try_take(target.node_name, tenant)
        if slot is None:
            full = {t.placement_id for t in resolution.targets if slots.full(t.node_name)}
            other = pick(state.inflight, resolution.targets, tried | full, suspect=suspect)
            if other is not None:
                target, slot = other, slots.try_take(other.node_name, tenant)
            if slot is None:
                try:
                    slot = await slots.take(target.node_name, tenant, wait_s=settings.MINT_GATEWAY_NODE_WAIT_S)
                except NodeBusy:
                    NODE_BUSY.labels(target.node_name).inc()
                    raise
        tried.add(target.placement_id)
        release = slot.joined(_releaser(state.inflight, target.placement_id))
        sent_at = time.perf_counter()
        try:
            upstream = await state.upstream.post(target.node_url + path, payload)
        except NoAnswer as exc:
            release()
            UPSTREAM_ERRORS.labels(target.node_name).inc()
            nodes.failed(target.node_name)
            suspect = nodes.suspect
            log.warning("gateway: node %s failed before answering (%s)", target.node_name, exc)
            drops += isinstance(exc, Dropped)
            if drops >= MAX_DROPS:
                raise GatewayError(
                    502, "upstream_error", f"{drops} serving nodes closed the connection on this request unanswered."
                ) from None
            continue
        except UpstreamTimeout as exc:
            release()
            UPSTREAM_ERRORS.labels(target.node_name).inc()
            log.warning("gateway: node %s timed out (%s)", target.node_name, exc)
            raise GatewayError(504, "upstream_timeout", "The serving node did not answer in time.") from None
        except UpstreamError as exc:
            release()
            UPSTREAM_ERRORS.labels(target.node_name).inc()
            log.warning("gateway: node %s failed (%s)", target.node_name, exc)
            raise GatewayError(502, "upstream_error", "The serving node failed to answer.") from None
        except BaseException:
            release()
            raise
        if suspect is not None:
            nodes.answered(target.node_name)
        if upstream.status == 404:
            # The node does not hold the LoRA after all (it restarted): the reconciler will notice; another
            # replica may still hold it.
            release()
            await upstream.aclose()
            UPSTREAM_ERRORS.labels(target.node_name).inc()
            lost = True
            continue
        state.usage.record(placement_id=target.placement_id)
        state.cold.tier(target.node_name, state.gpu.use(target))
        tally.node = target.node_name
        try:
            response = await _relay(
                upstream,
                release=release,
                target=target,
                resolution=resolution,
                model=model,
                tally=tally,
                hide_usage=hide_usage,
                show_running=show_running,
                choices_per_prompt=body.get("n") or 1,
                answer=answer,
            )
        except BaseException:
            release()
            await upstream.aclose()
            raise
        return response, time.perf_counter() - sent_at
    if lost:
        raise NotReady(
            f"Revision r{resolution.revision_number} of adapter {resolution.adapter_name!r} is being reloaded; "
            "retry shortly.",
            adapter_name=resolution.adapter_name,
        )
    # Every ready node refused the connection (an engine died before the heartbeat saw it): for the
    # caller that is an adapter not ready yet, and the probe the failure asked for takes the node out.
    raise NotReady(
        f"Revision r{resolution.revision_number} of adapter {resolution.adapter_name!r} has no reachable node "
        "right now; retry shortly.",
        adapter_name=resolution.adapter_name,
    )


async def _relay(
    upstream: UpstreamResponse,
    *,
    release: Callable[[], None],
    target: Target,
    resolution: Resolution,
    model: str,
    tally: Tally,
    hide_usage: bool,
    show_running: bool,
    choices_per_prompt: int,
    answer: AnswerRules,
) -> Response:
    lora = resolution.lora_name
    if upstream.status == 200 and upstream.content_type.startswith("text/event-stream"):
        relay = _SSERelay(
            upstream,
            release=release,
            lora=lora,
            model=model,
            node_name=target.node_name,
            tally=tally,
            hide_usage=hide_usage,
            show_running=show_running,
            choices_per_prompt=choices_per_prompt,
        )
        return EventStream(
            relay.events(),
            finish=relay.finish,
            idle_s=settings.MINT_GATEWAY_STREAM_IDLE_S,
            max_s=settings.MINT_GATEWAY_STREAM_MAX_S,
        )
    try:
        content = await upstream.read()
    except UpstreamTimeout:
        UPSTREAM_ERRORS.labels(target.node_name).inc()
        raise GatewayError(504, "upstream_timeout", "The serving node did not finish in time.") from None
    except UpstreamError:
        UPSTREAM_ERRORS.labels(target.node_name).inc()
        raise GatewayError(502, "upstream_error", "The serving node broke off its answer.") from None
    finally:
        release()
        await upstream.aclose()
    status = upstream.status
    if 200 <= status < 300:
        try:
            data = json.loads(content)
        except ValueError:
            UPSTREAM_ERRORS.labels(target.node_name).inc()
            raise GatewayError(502, "upstream_error", "The serving node answered with malformed JSON.") from None
        if isinstance(data, dict):
            tally.add_usage(data.get("usage"))
            if answer.check is not None:
                answer.check(data)  # after the usage is counted: the tokens were spent
        return json_response(_rewrite(data, lora=lora, model=model, keep=answer.keep), status)
    if status in _CALLER_ERRORS:
        message = _upstream_message(content) or "The serving node refused the request."
        return error_response(GatewayError(status, "invalid_request", message.replace(lora, model)))
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


def _rewrite(data: Any, *, lora: str, model: str, keep: frozenset[str] = frozenset()) -> Any:
    """Name the caller's model where vLLM named the LoRA (the `model` field and any error message), and keep
    only OpenAI's fields of a completion, chat completion or chunk (policy/answers.py), and `keep`'s."""
    if isinstance(data, dict):
        data = openai_answer(data, keep=keep)
        if "model" in data:
            data["model"] = model
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            error["message"] = error["message"].replace(lora, model)
    return data


def _lines(buffer: bytearray) -> list[bytes]:
    """Take the complete lines off the front of `buffer` (any of \\r\\n, \\n, \\r ends one), without their ends.

    A trailing \\r stays in the buffer: the \\n of its \\r\\n may come with the next chunk.
    """
    data, hold = bytes(buffer), b""
    if data.endswith(b"\r"):
        data, hold = data[:-1], b"\r"
    *complete, rest = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    buffer[:] = rest + hold
    return complete


class _SSERelay:
    """The body of a streamed answer: vLLM's events, one by one, with `model` renamed in each.

    The response calls `finish()` when the answer is over, also when the client went away
    before or during the stream; the upstream response is then closed and the in-flight
    count released, whichever of the two paths gets there first.
    """

    def __init__(
        self,
        upstream: UpstreamResponse,
        *,
        release: Callable[[], None],
        lora: str,
        model: str,
        node_name: str,
        tally: Tally,
        hide_usage: bool,
        show_running: bool,
        choices_per_prompt: int,
    ):
        self._upstream = upstream
        self._release = release
        self._lora = lora
        self._model = model
        self._node_name = node_name
        self._tally = tally
        self._hide_usage = hide_usage  # the last chunk's totals were asked for metering, not by the client
        self._show_running = show_running  # the client asked for every chunk's running usage too
        self._choices_per_prompt = choices_per_prompt
        self._finished = False

    async def events(self) -> AsyncIterator[bytes]:
        event: list[str] = []
        buffer = bytearray()
        try:
            async for chunk in self._upstream.chunks():
                buffer += chunk
                for raw in _lines(buffer):
                    line = raw.decode("utf-8", errors="replace")
                    if line:
                        if (kept := self._line(line)) is not None:
                            event.append(kept)
                    elif event:  # a blank line ends an event: send it whole
                        yield ("\n".join(event) + "\n\n").encode()
                        event = []
            if (rest := bytes(buffer).rstrip(b"\r")) and (kept := self._line(rest.decode("utf-8", errors="replace"))):
                event.append(kept)
            if event:
                yield ("\n".join(event) + "\n\n").encode()
        except UpstreamError as exc:
            # Headers are gone already: report the failure the way vLLM does inside a stream.
            UPSTREAM_ERRORS.labels(self._node_name).inc()
            self._tally.broken = True
            log.warning("gateway: stream from node %s broke off (%s)", self._node_name, exc)
            error = GatewayError(502, "upstream_error", "The serving node broke off the stream.").body()
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            await self.finish()

    def _line(self, line: str) -> str | None:
        """The line as the client gets it, or None for the usage chunk the client did not ask for."""
        if not line.startswith("data:"):
            return line
        payload = line[5:].strip()
        if payload == "[DONE]":
            return "data: [DONE]"
        try:
            data = json.loads(payload)
        except ValueError:
            return line.replace(self._lora, self._model)
        if isinstance(data, dict) and data.get("usage"):
            choices = data.get("choices")
            if not choices:  # the last chunk: the totals
                self._tally.add_usage(data["usage"])
                if self._hide_usage:
                    return None
            else:  # a chunk's running usage: its prompt's tokens and its choice's so far
                first = choices[0] if isinstance(choices, list) and isinstance(choices[0], dict) else {}
                self._tally.add_running_usage(
                    data["usage"], index=first.get("index"), choices_per_prompt=self._choices_per_prompt
                )
                if not self._show_running:
                    del data["usage"]  # as vLLM answers a client that did not ask for it
        data = _rewrite(data, lora=self._lora, model=self._model)
        return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":"))

    async def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._release()
        await self._upstream.aclose()
