"""The clients of benchmarks/hostile_edges.py: probes that time one URL, and flooders that disturb the server.

The flooders run in processes of their own at the lowest CPU priority (they stand for other machines); the probes
run ahead of them, so that what a probe measures is the server's answer, not its own wait for a CPU.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import secrets
import socket
import threading
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field

import httpx

FLOOD_CLIENTS = 32
FLOOD_PROCESSES = 8  # the clients' threads in few processes: the flooding machine's work, not the server's
# CPU priorities on the clients' CPUs: the probes ahead of the flooders (which must still get CPU on a busy machine).
PROBE_NICE, FLOODER_NICE = -5, 5
PART_BYTES = 8 * 1024 * 1024
OTHER_BYTES = 4 * 1024 * 1024


@dataclass
class Probe:
    """Calls one URL every `period` seconds from a thread; each answer's (moment, seconds, status)."""

    url: str
    period: float
    headers: dict[str, str] = field(default_factory=dict)
    samples: list[tuple[float, float, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        # Ahead of the flooders on the clients' CPUs (where the process may: root), so that what it measures is
        # the server's answer, not its own wait for a CPU among the flooding threads.
        with suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PROBE_NICE)
        with httpx.Client(timeout=30) as http:
            next_at = time.monotonic()
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    status = http.get(self.url, headers=self.headers).status_code
                except httpx.HTTPError:
                    status = 0
                self.samples.append((time.time(), time.perf_counter() - started, status))
                next_at += self.period
                self.stop.wait(max(0.0, next_at - time.monotonic()))

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread

    def between(self, start: float, end: float) -> list[tuple[float, float, int]]:
        return [s for s in self.samples if start <= s[0] < end]


# ---------------------------------------------------------------------------------------------- the flooders


def _raw(host: str, port: int, head: str, body_bytes: int, chunk: bytes) -> int:
    """One request over its own connection: the headers, then as much of a `body_bytes` body as the server takes
    before it answers; the answer's status (0 when the server hung up first)."""
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(head.encode())
        sent = 0
        try:
            while sent < body_bytes:
                sock.sendall(chunk[: min(len(chunk), body_bytes - sent)])
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            line = sock.makefile("rb").readline()
        except (ConnectionResetError, TimeoutError):
            return 0
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def anonymous_requests(base: str, stop: threading.Event, answers: Counter) -> None:
    """One client: anonymous requests in turn, as fast as the server answers: 8 MiB parts, 4 MiB bodies to the
    REST API and the gateway, tiny calls."""
    host, port = base.removeprefix("http://").split(":")
    chunk = b"x" * 65536
    part = "/api/v1/adapters/victim/uploads/6d1f0e5c-7a3b-4c1e-9f00-0123456789ab/parts/1/"
    json_type = "Content-Type: application/json\r\n"
    kinds = [
        ("part_8MiB", f"PUT {part} HTTP/1.1\r\nHost: {host}\r\nX-Mint-Part-Sha256: {'0' * 64}\r\n", PART_BYTES),
        ("api_4MiB", f"POST /api/v1/adapters/ HTTP/1.1\r\nHost: {host}\r\n{json_type}", OTHER_BYTES),
        ("gateway_4MiB", f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{json_type}", OTHER_BYTES),
        ("tiny", f"GET /api/v1/ HTTP/1.1\r\nHost: {host}\r\n", 0),
    ]
    i = random.randrange(len(kinds))
    while not stop.is_set():
        name, head, size = kinds[i % len(kinds)]
        i += 1
        head += f"Content-Length: {size}\r\nConnection: close\r\n\r\n" if size else "Connection: close\r\n\r\n"
        try:
            status = _raw(host, int(port), head, size, chunk)
        except OSError:
            status = 0
        answers[f"{name}:{status}"] += 1


def bad_key_requests(base: str, stop: threading.Event, answers: Counter) -> None:
    """One client: random keys, as fast as the server answers, at the gateway and at the REST API in turn."""
    with httpx.Client(base_url=base, timeout=30) as http:
        i = random.randrange(2)
        while not stop.is_set():
            token = f"mint_{secrets.token_hex(6)}_{secrets.token_urlsafe(24)}"
            path = "/v1/models" if i % 2 == 0 else "/api/v1/"
            i += 1
            try:
                status = http.get(path, headers={"Authorization": f"Bearer {token}"}).status_code
            except httpx.HTTPError:
                status = 0
            answers[f"{path}:{status}"] += 1


FLOODERS = {"anonymous": anonymous_requests, "bad_key": bad_key_requests}


def flooder(kind: str, base: str, clients: int, ready, go, stop, results) -> None:
    """A process of `clients` flooding threads: ready once set up, flooding from `go` until `stop`."""
    os.setpriority(os.PRIO_PROCESS, 0, FLOODER_NICE)
    answers: Counter = Counter()
    halt = threading.Event()
    threads = [threading.Thread(target=FLOODERS[kind], args=(base, halt, answers)) for _ in range(clients)]
    ready.put(os.getpid())
    go.wait()
    for thread in threads:
        thread.start()
    stop.wait()
    halt.set()
    for thread in threads:
        thread.join(timeout=60)
    results.put(dict(answers))


def flood(kind: str, base: str, seconds: float) -> tuple[float, float, dict]:
    """FLOOD_CLIENTS clients of `kind` (in FLOOD_PROCESSES processes, started and set up beforehand) for `seconds`:
    (when they started, when they stopped, their answers by kind and status)."""
    context = multiprocessing.get_context("spawn")  # no thread of this process (the probes) is forked
    ready, results, go, stop = context.Queue(), context.Queue(), context.Event(), context.Event()
    each = FLOOD_CLIENTS // FLOOD_PROCESSES
    workers = [
        context.Process(target=flooder, args=(kind, base, each, ready, go, stop, results), daemon=True)
        for _ in range(FLOOD_PROCESSES)
    ]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=120)
    started = time.time()
    go.set()
    time.sleep(seconds)
    stop.set()
    ended = time.time()
    total: Counter = Counter()
    for _ in workers:
        total.update(results.get(timeout=120))
    for worker in workers:
        worker.join(timeout=30)
    return started, ended, dict(sorted(total.items()))
