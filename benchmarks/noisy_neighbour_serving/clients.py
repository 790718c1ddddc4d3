"""Tenant A and tenant B as clients of the stack, each in a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import select
import socket
import time
from collections import Counter
from typing import NamedTuple

import httpx

from benchmarks.common import (
    server_timing,
)
from benchmarks.noisy_neighbour_serving import B_ADAPTER, BODY, RECV_BUFFER

# ---------------------------------------------------------------- clients (processes of their own)


def answer_code(response: httpx.Response) -> str:
    """`status` for a success, else `status:code` from the `{"error": {"code": …}}` body."""
    if response.status_code == 200:
        return "200"
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "?"
    return f"{response.status_code}:{code}"


class Sample(NamedTuple):
    sent: float  # time.monotonic(): CLOCK_MONOTONIC, the same clock in every process
    seconds: float
    outcome: str  # "200", "<status>:<code>" or "exception:<type>"
    upstream_ms: float | None  # the node's part, from the gateway's Server-Timing


async def _post(http: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Sample:
    """One request and its outcome; a failure to get an answer at all is `exception:<type>`."""
    sent = time.monotonic()
    try:
        response = await http.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        return Sample(sent, time.monotonic() - sent, f"exception:{type(exc).__name__}", None)
    return Sample(sent, time.monotonic() - sent, answer_code(response), server_timing(response).get("upstream"))


async def _open_loop(
    http, url: str, headers: dict, model: str, rate: float, until, prompts, max_tokens: int = BODY["max_tokens"]
) -> list[asyncio.Task]:
    """Send a request every 1/rate s, not waiting for answers, until `until()` says stop; the tasks sent."""
    tasks: list[asyncio.Task] = []
    next_at = time.monotonic()
    while not until(next_at):
        body = BODY | {"model": model, "prompt": f"Hello world {next(prompts)}", "max_tokens": max_tokens}
        tasks.append(asyncio.create_task(_post(http, url, body, headers)))
        next_at += 1 / rate
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    return tasks


def _steady(base: str, token: str, model: str, rate: float, stop, results) -> None:
    """Tenant B's steady traffic until `stop`; sends back every (sent at, seconds, outcome)."""

    async def run() -> list[Sample]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            headers = {"Authorization": f"Bearer {token}"}
            url = f"{base}/v1/completions"
            tasks = await _open_loop(http, url, headers, model, rate, lambda _: stop.is_set(), itertools.count())
            return list(await asyncio.gather(*tasks))

    results.send(asyncio.run(run()))


def _neighbour(base: str, token: str, commands) -> None:
    """Tenant A: runs one window per command received (a dict, see `neighbour_window`), answers its tally."""
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    prompts = itertools.count(10**9)  # apart from B's prompts: the prefix cache must not flatter anyone
    while (command := commands.recv()) is not None:
        commands.send(asyncio.run(neighbour_window(base, token, command, prompts)))


async def neighbour_window(base: str, token: str, command: dict, prompts) -> dict:
    """One of A's windows: open-loop requests at `rate`; in a flood also streams never read, and activations."""
    started = time.monotonic()
    end = started + command["duration"]
    tally: dict[str, Counter] = {"requests": Counter(), "streams": Counter(), "activations": Counter()}
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        activations = asyncio.create_task(_activate_all(http, base, headers, command["activations"]))
        socks = await asyncio.to_thread(open_streams, base, token, command, prompts) if command["streams"] else []
        tasks = await _open_loop(
            http,
            f"{base}/v1/completions",
            headers,
            command["model"],
            command["rate"],
            lambda at: at >= end,
            prompts,
            max_tokens=command["max_tokens"],
        )
        # What is still unanswered a second after the window is counted as such; the flood stops at the window.
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, end + 1.0 - time.monotonic())) if tasks else ((), ())
        for task in pending:
            task.cancel()
        tally["requests"].update(task.result()[2] for task in done)
        tally["requests"]["unanswered_at_window_end"] += len(pending)
        tally["activations"].update(await activations)
        streams, delivered = await asyncio.to_thread(close_streams, socks)
        tally["streams"].update(streams)
    return {
        "stream_bytes": delivered,
        "tally": {kind: dict(sorted(counts.items())) for kind, counts in tally.items()},
        "requests_sent": len(tasks),
        "request_rate": round(len(tasks) / command["duration"], 2),
        "seconds": round(time.monotonic() - started, 2),
    }


async def _activate_all(http: httpx.AsyncClient, base: str, headers: dict, activations: list[list]) -> Counter:
    """A's activations through the REST API, one after another: (adapter, alias, revision number) each."""
    outcomes: Counter = Counter()
    for adapter, alias, number in activations:
        url = f"{base}/api/v1/adapters/{adapter}/activate/"
        try:
            response = await http.post(url, json={"revision": number, "alias": alias}, headers=headers)
            outcomes[answer_code(response)] += 1
        except httpx.HTTPError as exc:
            outcomes[f"exception:{type(exc).__name__}"] += 1
    return outcomes


def open_streams(base: str, token: str, command: dict, prompts) -> list[socket.socket | str]:
    """`stream: true` requests on raw sockets with a small receive buffer; nothing is read until closing."""
    host, port = base.removeprefix("http://").split(":")
    out: list[socket.socket | str] = []
    for _ in range(command["streams"]):
        body = json.dumps(
            {
                "model": command["model"],
                "prompt": f"Tell me a long story {next(prompts)}",
                "max_tokens": command["stream_tokens"],
                "temperature": 0,
                "stream": True,
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)  # before connect: sets the window
        sock.settimeout(5)
        try:
            sock.connect((host, int(port)))
            sock.sendall(head + body)
        except OSError as exc:
            sock.close()
            out.append(f"exception:{type(exc).__name__}")
            continue
        out.append(sock)
    return out


def close_streams(socks: list[socket.socket | str]) -> tuple[Counter, list[int]]:
    """Each stream's outcome, from what its socket holds now (read without waiting), then close them all;
    and the bytes each admitted stream had delivered into its socket.

    `200:open` the gateway still holds the stream and has not sent all of it (a reader this slow holds it
    back), `200:complete` the whole answer (`data: [DONE]`) lies unread in the socket's buffers, `200:cut` the
    gateway ended it early (an idle timeout, say), `<status>:<code>` a refusal, `no_answer` nothing came back
    at all, `reset` the connection was reset before anything could be read.
    """
    outcomes: Counter = Counter()
    delivered: list[int] = []
    for sock in socks:
        if isinstance(sock, str):
            outcomes[sock] += 1
            continue
        outcome, size = _stream_outcome(sock)
        outcomes[outcome] += 1
        if outcome.startswith("200"):
            delivered.append(size)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # unread data (or the linger of 0) makes it a reset: the gateway learns at once
    return outcomes, delivered


def _stream_outcome(sock: socket.socket) -> tuple[str, int]:
    """(outcome, bytes read) from what the socket holds; only what is already there is read."""
    sock.setblocking(False)
    data, ended, wait = b"", False, 0.01
    try:
        while len(data) < 1 << 22:
            ready, _, _ = select.select([sock], [], [], wait)
            if not ready:
                break
            chunk = sock.recv(1 << 16)
            if not chunk:
                ended = True
                break
            data, wait = data + chunk, 0.0
    except OSError:
        if not data:
            return "reset", 0
        ended = True
    if not data:
        return ("ended_without_answer" if ended else "no_answer"), 0
    status = data.split(b"\r\n", 1)[0].split()[1].decode() if data.startswith(b"HTTP/") else "?"
    if status == "200":
        if b"data: [DONE]" in data:
            return "200:complete", len(data)
        return ("200:cut" if ended else "200:open"), len(data)
    try:
        code = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"]
    except (IndexError, ValueError, KeyError, TypeError):
        code = "?"
    return f"{status}:{code}", len(data)


class Clients:
    """B's steady traffic and A's process, on the benchmark's CPUs (the front half: where callers would be)."""

    def __init__(self, base: str, b_token: str, a_token: str, b_rate: float):
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._samples, sender = context.Pipe(duplex=False)
        self._steady = context.Process(
            target=_steady, args=(base, b_token, B_ADAPTER, b_rate, self._stop, sender), daemon=True
        )
        self._a, a_end = context.Pipe()
        self._neighbour = context.Process(target=_neighbour, args=(base, a_token, a_end), daemon=True)
        self.samples: list[Sample] = []

    def start(self) -> None:
        self._steady.start()
        self._neighbour.start()

    def pids(self) -> dict[str, int]:
        """The clients' processes, for CPU accounting."""
        return {"client_b": self._steady.pid, "client_a": self._neighbour.pid}

    def a_start(self, command: dict) -> None:
        self._a.send(command)

    def a_result(self, timeout: float) -> dict:
        if not self._a.poll(timeout):
            raise TimeoutError(f"tenant A's window did not end within {timeout:.0f} s")
        return self._a.recv()

    def stop(self) -> None:
        self._stop.set()
        self.samples = self._samples.recv()
        self._steady.join(timeout=30)
        self._a.send(None)
        self._neighbour.join(timeout=30)
        for process in (self._steady, self._neighbour):
            if process.is_alive():
                process.kill()

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.sent < end]


# ---------------------------------------------------------------- the stack: tenants, revisions, settling
