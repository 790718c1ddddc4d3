"""The live run's clients: the official `openai` client with its default settings, in processes of their own.

Every logical request is one `client.completions.create` (two retries that honour `Retry-After`, the
client's defaults); an httpx event hook on the client's connection pool notes each attempt (sent, answered,
status, `Retry-After`, error code), so a record says what the caller saw and what each try got.

- `open_loop`: requests at Poisson arrivals, each in a thread of a large pool (a request waiting out a
  `Retry-After` does not hold the next one back). The mode (a shared integer the coordinator sets) picks the
  aliases and their weights: Zipf over the whole catalog, or the busy set of the thrashing phase.
- `closed_loop`: `concurrency` threads walk a list of aliases once, each asking for the next when its last
  request ended, while an event is set (the scan: one tenant touching cold adapters once each).

A process sends its records through a pipe when told to stop. Times are wall-clock (`time.time()`, the clock
the database's timestamps come from on this host) and durations monotonic.
"""

from __future__ import annotations

import bisect
import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

BODY = {"max_tokens": 4, "temperature": 0}


@dataclass(frozen=True)
class Mode:
    kind: str  # the records' kind: zipf, hot, thrash
    aliases: list[int]  # indices into the model list
    cum_weights: list[float] | None  # None: uniform
    rate: float  # requests a second


class Caller:
    """openai clients (one per tenant, one connection pool) that record every attempt of every request."""

    def __init__(self, base_url: str, tokens: list[str]) -> None:
        import httpx
        import openai

        self._local = threading.local()
        self._http = httpx.Client(
            timeout=httpx.Timeout(60.0, connect=5.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
            event_hooks={"request": [self._sent], "response": [self._answered]},
        )
        self._clients = [openai.OpenAI(base_url=f"{base_url}/v1", api_key=t, http_client=self._http) for t in tokens]
        self._prompts = itertools.count()
        self._lock = threading.Lock()
        self.records: list[dict] = []

    def _sent(self, request) -> None:
        self._local.sent = time.time()

    def _answered(self, response) -> None:
        code = ""
        if response.status_code != 200:
            response.read()
            try:
                code = response.json()["error"]["code"] or ""
            except Exception:
                code = "(not json)"
        retry_after = response.headers.get("retry-after")
        self._local.attempts.append(
            (self._local.sent, time.time(), response.status_code, float(retry_after) if retry_after else None, code)
        )

    def call(self, kind: str, tenant: int, alias: int, model: str) -> dict:
        import openai

        with self._lock:
            prompt = f"Hello world {next(self._prompts)}"  # never sent before: no prefix-cache flattery
        self._local.attempts = attempts = []
        start, started = time.time(), time.monotonic()
        error = ""
        try:
            self._clients[tenant].completions.create(model=model, prompt=prompt, **BODY)
        except openai.APIStatusError as exc:
            error = f"{exc.status_code} {attempts[-1][4] if attempts else ''}".strip()
        except openai.APIError as exc:  # connection, timeout
            error = type(exc).__name__
        record = {
            "kind": kind,
            "tenant": tenant,
            "alias": alias,
            "start": start,
            "latency": time.monotonic() - started,
            "error": error,
            "attempts": attempts,
        }
        with self._lock:
            self.records.append(record)
        return record

    def close(self) -> None:
        self._http.close()


def open_loop(base_url, tokens, models, tenants, modes: list[Mode], mode, seed: int, stop, out) -> None:
    """Poisson arrivals at the current mode's rate until `stop`; then the records go to `out`."""
    caller = Caller(base_url, tokens)
    rng = random.Random(seed)
    with ThreadPoolExecutor(max_workers=384) as pool:
        due = time.monotonic()
        while not stop.is_set():
            current = modes[mode.value]
            if current.rate <= 0:
                time.sleep(0.05)
                due = time.monotonic()
                continue
            due += rng.expovariate(current.rate)
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            if current.cum_weights is None:
                alias = current.aliases[rng.randrange(len(current.aliases))]
            else:
                alias = current.aliases[bisect.bisect(current.cum_weights, rng.random() * current.cum_weights[-1])]
            pool.submit(caller.call, current.kind, tenants[alias], alias, models[alias])
    caller.close()
    out.send(caller.records)


def closed_loop(base_url, tokens, models, tenants, kind: str, aliases: list[int], concurrency: int, go, stop, out):
    """`concurrency` threads walk `aliases` once, each request after the last, while `go` is set."""
    caller = Caller(base_url, tokens)
    queue = iter(aliases)
    lock = threading.Lock()

    def walk() -> None:
        while not stop.is_set():
            if not go.wait(0.2):
                continue
            with lock:
                alias = next(queue, None)
            if alias is None:
                return
            caller.call(kind, tenants[alias], alias, models[alias])

    threads = [threading.Thread(target=walk, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(timeout=130)
    caller.close()
    out.send(caller.records)


class Process:
    """One client process (`open_loop` or `closed_loop`), started and stopped by the coordinator."""

    def __init__(self, target, *args) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.stop_event = context.Event()
        self._results, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=target, args=(*args, self.stop_event, sender), daemon=True)
        self.records: list[dict] = []

    def start(self) -> Process:
        self._process.start()
        return self

    def stop(self) -> list[dict]:
        self.stop_event.set()
        self.records = self._results.recv()
        self._process.join()
        return self.records
