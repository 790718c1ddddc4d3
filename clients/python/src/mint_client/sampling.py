"""Rollouts for RL loops: push a policy step and sample it before anyone approves it.

    from mint_client import Client
    mint = Client()                                   # a key with scope pipeline (or sampling to sample only)
    r = mint.push("policy", "out/step-12", training_step=12, run="grpo-1", metrics={"reward": 0.4},
                  ready_to_sample=True)               # returns once r answers
    for s in mint.sample("policy", r.number, ["2+2=", "Say hi"], n=4, max_tokens=64, seed=0):
        s.text, s.token_ids, s.logprobs               # per sample, in prompt order

`sample` sends one completion request per prompt through the gateway (`/v1/completions`, model
`<adapter>@r<n>`), `concurrency` at a time; each is retried on 503 (a cold revision being loaded, a busy node)
and on 429 with Retry-After, honouring the server's wait, and on a connection that failed. Sampling is metered
as its own kind and counts toward the tenant's token limits.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import time
from ast import literal_eval
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mint_client.errors import MintError, RevisionFailed, WaitTimeout
from mint_client.models import Revision, revision_number

TOKEN_ID_PREFIX = "token_id:"  # vLLM's form of a token with `return_tokens_as_token_ids`
# How the gateway says a revision is not (yet) sampleable: worth waiting for while it is validated and exported.
NOT_YET = frozenset({"revision_not_exported", "adapter_not_ready", "node_busy"})
# Asks the gateway to hold a request for a revision being loaded until it is ready (at most the plan's
# max_cold_wait_s), instead of answering 503 at once.
WAIT_HEADER = "X-Mint-Wait"


@dataclass
class Sample:
    """One sampled completion: its prompt's place in the list (`prompt_index`), its place among that prompt's `n`
    samples (`index`), the text, the sampled tokens' ids and log-probabilities (what importance ratios need),
    why it stopped, and, when asked for, the experts each token was routed to (`routed_experts`: one entry per
    token position from `routed_experts_prompt_start`, the prompt's then the sampled ones but the last, each
    `[layers][top_k]` expert ids)."""

    prompt_index: int
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    routed_experts: list[list[list[int]]] | None = None
    usage: dict[str, int] = field(default_factory=dict)  # the request's (shared by the prompt's n samples)

    def as_json(self) -> dict[str, Any]:
        data = {
            "prompt_index": self.prompt_index,
            "index": self.index,
            "text": self.text,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }
        if self.routed_experts is not None:
            data["routed_experts"] = self.routed_experts
        return data


def decode_routed_experts(value: str) -> list[list[list[int]]]:
    """vLLM's `routed_experts` (base64 of a NumPy `.npy`, `[tokens, layers, top_k]` unsigned or signed ints) as
    nested lists, without NumPy; `numpy.asarray` of the result gives the array."""
    raw = base64.b64decode(value)
    if raw[:6] != b"\x93NUMPY":
        raise ValueError("routed_experts is not a .npy array")
    major = raw[6]
    header_len, start = (
        (struct.unpack("<H", raw[8:10])[0], 10) if major == 1 else (struct.unpack("<I", raw[8:12])[0], 12)
    )
    header = literal_eval(raw[start : start + header_len].decode("latin1"))  # a dict of literals, never code
    descr, shape = header["descr"], tuple(header["shape"])
    if header.get("fortran_order") or len(shape) != 3:
        raise ValueError(f"routed_experts: unexpected layout {header}")
    formats = {"|u1": "B", "|i1": "b", "<u2": "H", "<i2": "h", "<u4": "I", "<i4": "i", "<u8": "Q", "<i8": "q"}
    if descr not in formats:
        raise ValueError(f"routed_experts: unexpected dtype {descr}")
    tokens, layers, top_k = shape
    count = tokens * layers * top_k
    flat = struct.unpack(
        f"<{count}{formats[descr]}",
        raw[start + header_len : start + header_len + count * struct.calcsize(formats[descr])],
    )
    per_token = layers * top_k
    return [
        [list(flat[t * per_token + layer * top_k : t * per_token + (layer + 1) * top_k]) for layer in range(layers)]
        for t in range(tokens)
    ]


def _token_ids(tokens: list[str]) -> list[int]:
    return [int(t[len(TOKEN_ID_PREFIX) :]) if t.startswith(TOKEN_ID_PREFIX) else -1 for t in tokens]


def samples_of(answer: dict[str, Any], prompt_index: int) -> list[Sample]:
    """A completion answer's choices as samples, by choice index."""
    usage = answer.get("usage") or {}
    found = []
    for choice in sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0)):
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        routed = choice.get("routed_experts")
        found.append(
            Sample(
                prompt_index=prompt_index,
                index=choice.get("index", 0),
                text=choice.get("text") or "",
                token_ids=_token_ids(tokens),
                logprobs=logprobs.get("token_logprobs") if logprobs else None,
                finish_reason=choice.get("finish_reason"),
                routed_experts=decode_routed_experts(routed) if routed else None,
                usage=usage,
            )
        )
    return found


class SamplingMixin:
    """Client methods that sample through the gateway; uses the client's `_http`, `register` and `revision`."""

    def sample(
        self,
        adapter: str,
        revision: int | str,
        prompts: list[str] | list[list[int]],
        *,
        n: int = 1,
        max_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float | None = None,
        seed: int | None = None,
        logprobs: bool = True,
        stop: list[str] | None = None,
        routed_experts: bool = False,
        routed_experts_prompt_start: int | None = None,
        concurrency: int = 8,
        retries: int | None = None,
    ) -> list[Sample]:
        """Sample `n` completions of each prompt (text, or token ids) from `adapter` r`revision`; the samples in
        prompt order (each prompt's `n` by index). `logprobs`: each sampled token's log-probability and id;
        `seed`: prompt `i` is sent with `seed + i * n` (the engine seeds its `n` samples from there on, one each:
        every sample of the rollout has a seed of its own);
        `routed_experts`: the experts each token was routed to, from nodes that return them (MoE, R3).
        `retries` (default the client's) bounds the retries of each request; the first error left raises."""
        model = f"{adapter}@r{revision_number(revision)}"
        base: dict[str, Any] = {"model": model, "n": n, "max_tokens": max_tokens, "temperature": temperature}
        if top_p is not None:
            base["top_p"] = top_p
        if stop:
            base["stop"] = stop
        if logprobs:
            base |= {"logprobs": 0, "return_tokens_as_token_ids": True}
        if routed_experts:
            base["return_routed_experts"] = True
            if routed_experts_prompt_start is not None:
                base["routed_experts_prompt_start"] = routed_experts_prompt_start

        def one(i: int) -> list[Sample]:
            body = {**base, "prompt": prompts[i]}
            if seed is not None:
                body["seed"] = seed + i * n
            response = self._http.request("POST", "/v1/completions", json=body, idempotent=True, retries=retries)
            return samples_of(response.json(), i)

        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts)))) as pool:
            per_prompt = list(pool.map(one, range(len(prompts))))
        return [s for samples in per_prompt for s in samples]

    def push(
        self,
        adapter: str,
        path: str | os.PathLike,
        *,
        training_step: int | None = None,
        parent: int | str | None = None,
        run: str | None = None,
        metrics: dict[str, Any] | None = None,
        ready_to_sample: bool = False,
        timeout: float = 300.0,
        probe_prompt: str = "Hello",
    ) -> Revision:
        """Register a policy step (as `register`, with its `run` and `metrics`); with `ready_to_sample`, it is
        placed on a node as soon as it is exported (`prewarm`), and this returns once it answers a sample: a
        one-token completion of `probe_prompt` through the gateway (metered as sampling), tried every few
        tens of milliseconds while the gateway says it is not exported or not loaded yet. `RevisionFailed` if
        validation refuses it, `WaitTimeout` after `timeout` s. Once exported, a probe asks the gateway to hold it
        while the revision loads (`X-Mint-Wait`), so it is answered the moment the revision is ready."""
        registered = self.register(
            adapter, path, training_step=training_step, parent=parent, run=run, metrics=metrics, prewarm=ready_to_sample
        )
        if not ready_to_sample:
            return registered
        self.wait_until_sampleable(adapter, registered.number, timeout=timeout, probe_prompt=probe_prompt)
        return self.revision(adapter, registered.number)

    def wait_until_sampleable(
        self,
        adapter: str,
        revision: int | str,
        *,
        timeout: float = 300.0,
        probe_prompt: str = "Hello",
        interval: float = 0.03,
        max_interval: float = 0.25,
    ) -> None:
        """Return once `adapter` r`revision` answers a one-token sample (see `push`)."""
        number = revision_number(revision)
        body = {"model": f"{adapter}@r{number}", "prompt": probe_prompt, "max_tokens": 1, "temperature": 0}
        deadline, delay = time.monotonic() + timeout, interval
        while True:
            hold = max(1, int(deadline - time.monotonic()))
            try:
                self._http.request("POST", "/v1/completions", json=body, retries=0, headers={WAIT_HEADER: str(hold)})
                return
            except MintError as exc:
                if exc.code == "revision_not_sampleable":
                    current = self.revision(adapter, number)
                    raise RevisionFailed(
                        f"{adapter} r{number} cannot be sampled: {current.state}"
                        + (f" ({current.failure_code}: {current.failure_reason})" if current.failure_code else ""),
                        revision=current,
                        failure_code=current.failure_code,
                        failure_reason=current.failure_reason,
                    ) from exc
                if exc.code not in NOT_YET and exc.status not in (429, None):
                    raise
                last = exc
            if time.monotonic() + delay > deadline:
                raise WaitTimeout(f"{adapter} r{number} does not answer after {timeout:g} s ({last}).")
            self.sleep(delay)
            delay = min(max_interval, delay * 1.3)


def write_jsonl(samples: list[Sample], handle) -> None:
    """One JSON object per sample and line (what `mint sample` prints)."""
    for s in samples:
        handle.write(json.dumps(s.as_json(), ensure_ascii=False) + "\n")
