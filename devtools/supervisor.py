"""Child processes for `make run`, tests/e2e and benchmarks: started in their own process groups, all stopped.

`Supervisor` starts each child in a new session (so a terminal's Ctrl-C reaches only the
supervising process, which then stops the children in order) and stops them within a bound:
SIGTERM to every child's process group, newest first, then SIGKILL to whatever is left of a
group once the grace period is over, which also ends a Celery pool process stuck in a task.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis

BASE_DIR = Path(__file__).resolve().parent.parent
# uvicorn's graceful shutdown takes at most 5 s (web_argv; several web processes drain at once, each getting the
# group's SIGTERM); a Celery worker finishes its running tasks.
STOP_GRACE_S = 10.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignal(KeyboardInterrupt):
    """SIGINT or SIGTERM reached a supervising process: unwind and stop the children."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(interval)
    raise TimeoutError(f"{what} did not come up within {timeout:.0f} s")


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=2).status_code == 200


def redis_ok(port: int) -> bool:
    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
        return client.ping()


class Supervisor:
    """Starts child processes in their own process groups and stops them all, newest first."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[tuple[str, subprocess.Popen]] = []
        self._starting = False
        self._stop_signal: str | None = None

    def stop_on_signals(self) -> None:
        """Turn SIGINT and SIGTERM into `StopSignal` in this (the main) thread, whatever was inherited.

        A process started in the background by a non-interactive shell inherits SIGINT ignored, and
        Python then installs no KeyboardInterrupt handler: without this, Ctrl-C (or `kill -INT`) would
        leave every child running. Only the first signal counts, so a second one cannot interrupt the
        stopping; one that arrives while a child is being started is raised once it is tracked.
        """
        for signum in _STOP_SIGNALS:
            signal.signal(signum, self._on_stop_signal)

    def _on_stop_signal(self, signum: int, frame) -> None:
        if self._stop_signal is not None:
            return
        self._stop_signal = signal.Signals(signum).name
        if not self._starting:
            raise StopSignal(self._stop_signal)

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
        nice: int = 0,
    ) -> subprocess.Popen:
        """Start `argv` as `name`; `cpus` confines it (and every process and thread it starts) to those CPUs,
        `nice` lowers its CPU priority (and theirs)."""
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115  (the child owns it)
        self._starting = True
        try:
            process = subprocess.Popen(
                argv,
                env=env,
                cwd=BASE_DIR,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.children.append((name, process))
        finally:
            self._starting = False
            log.close()
        if self._stop_signal is not None:
            raise StopSignal(self._stop_signal)
        # Before the child's interpreter has started any thread or process: they all inherit these.
        if cpus:
            os.sched_setaffinity(process.pid, cpus)
        if nice:
            os.setpriority(os.PRIO_PROCESS, process.pid, nice)
        return process

    def dead_child(self) -> tuple[str, int] | None:
        for name, process in self.children:
            if process.poll() is not None:
                return name, process.returncode
        return None

    def watch(self, *, interval: float = 1.0) -> tuple[str, int]:
        """Wait until a child exits (a stop signal interrupts the wait); return its name and status."""
        while True:
            dead = self.dead_child()
            if dead is not None:
                return dead
            time.sleep(interval)

    def stop(self, name: str, *, timeout: float = STOP_GRACE_S) -> None:
        stopping = [(n, p) for n, p in self.children if n == name]
        _stop_groups([p for _, p in stopping], timeout)
        for child in stopping:
            self.children.remove(child)

    def stop_all(self, *, timeout: float = STOP_GRACE_S) -> None:
        """Stop every child: SIGTERM to each process group (newest first), SIGKILL to what is left after `timeout`."""
        children, self.children = self.children, []
        _stop_groups([p for _, p in reversed(children)], timeout)


def _stop_groups(processes: list[subprocess.Popen], timeout: float) -> None:
    """Each process leads its own group: its children (Celery's pool, vLLM's engine core) are stopped with it."""
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    # Also for a leader that exited: members of its group may be left behind (a pool process stuck in a task).
    for process in processes:
        _signal_group(process, signal.SIGKILL)
        process.wait()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
