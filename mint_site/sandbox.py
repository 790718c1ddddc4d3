"""Run work on untrusted input in a child process, under a time limit and a memory bound.

A tenant's files are read by Celery workers that every tenant shares. Celery's own limits
do not protect them: `worker_max_memory_per_child` is checked only after a task ends, hard
time limits need the prefork pool (tests/e2e and node agents run `--pool solo`), and a pool
process that dies takes its task with it, to be delivered again (acks_late) and kill the
next one. So the worker forks: the child lowers its address-space limit, runs the work and
writes the result to a pipe; the parent waits with deadlines. Past the soft limit the child
gets SIGTERM (it raises `SoftTimeLimit` where it is, so `finally` blocks run); past the hard
limit it is killed. A child that runs out of memory raises MemoryError, or is killed by the
kernel: either way the parent raises `OutOfResources`, and the worker lives on.

The child inherits the parent's memory (fork, copy-on-write), so the work and its arguments
need no pickling; only the result or exception travels back (pickled). The child must not
use the parent's database connections (their sockets are shared): any query raises there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import resource
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class Bounds:
    """What one piece of work may take: wall-clock seconds (asked to stop, then killed) and memory."""

    soft_time_s: float
    hard_time_s: float
    memory_bytes: int  # address space the child may map beyond what the parent had at the fork
    # Run at the lowest CPU priority (nice 19) and the idle I/O class: work that should take only what
    # nobody else wants (a tenant's backlog, while other tenants wait for theirs).
    background: bool = False
    # Move to that priority once the work has run this long (None: never): long work yields to short work,
    # as in a multilevel feedback queue, whoever sent it.
    demote_after_s: float | None = None


class SandboxError(Exception):
    """The work did not finish inside its bounds."""


class TimeLimit(SandboxError):
    """The work ran past its time limit and was stopped."""


class OutOfResources(SandboxError):
    """The work ran out of memory, or its process died (killed by the kernel, a crash)."""


class SoftTimeLimit(BaseException):
    """Raised inside the child when its soft time limit passes; a BaseException, so `except Exception` lets it by."""


def run_bounded(work: Callable[..., T], *args: Any, bounds: Bounds, **kwargs: Any) -> T:
    """`work(*args, **kwargs)` in a forked child under `bounds`: its result, or the exception it raised.

    Raises `TimeLimit` or `OutOfResources` when the child does not come back on its own.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_fd)
        _child(write_fd, work, args, kwargs, bounds)
    os.close(write_fd)
    status = 0
    try:
        payload, killed_hard = _collect(pid, read_fd, bounds)
    finally:
        os.close(read_fd)
        # The answer is in (or the wait was interrupted: a Celery time limit, a shutdown): the child goes now.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(pid, 0)
    return _outcome(payload, status, killed_hard, bounds)


def _collect(pid: int, read_fd: int, bounds: Bounds) -> tuple[bytes, bool]:
    """Read the child's answer until it closes the pipe, signalling it at the soft and hard deadlines."""
    started = time.monotonic()
    soft_sent = killed_hard = False
    demote_at = None if bounds.background else bounds.demote_after_s
    chunks: list[bytes] = []
    while True:
        elapsed = time.monotonic() - started
        if demote_at is not None and elapsed >= demote_at:
            _lowest_priority(pid)
            demote_at = None
        if elapsed >= bounds.hard_time_s:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed_hard = True
            break
        if elapsed >= bounds.soft_time_s and not soft_sent:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            soft_sent = True
        deadline = bounds.hard_time_s if soft_sent else bounds.soft_time_s
        if demote_at is not None:
            deadline = min(deadline, demote_at)
        ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - elapsed))
        if ready:
            chunk = os.read(read_fd, _READ_CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks), killed_hard


def _outcome(payload: bytes, status: int, killed_hard: bool, bounds: Bounds):
    if killed_hard:
        raise TimeLimit(f"stopped after {bounds.hard_time_s:g} s (the hard time limit)")
    try:
        kind, value = pickle.loads(payload)  # noqa: S301 - written by our own forked child
    except Exception:
        raise OutOfResources(_death(status, bounds)) from None
    if kind == "ok":
        return value
    if kind == "memory":
        raise OutOfResources(f"needed more than {bounds.memory_bytes // (1024 * 1024)} MiB of memory")
    if kind == "soft_time":
        raise TimeLimit(f"stopped after {bounds.soft_time_s:g} s (the time limit)")
    raise value


def _death(status: int, bounds: Bounds) -> str:
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        return f"its process was killed by {name} (out of memory above {bounds.memory_bytes // (1024 * 1024)} MiB?)"
    return f"its process exited with status {os.waitstatus_to_exitcode(status)} without an answer"


def _child(write_fd: int, work: Callable, args: tuple, kwargs: dict, bounds: Bounds) -> None:
    code = 1
    try:
        _enter_sandbox(bounds)
        try:
            answer: tuple[str, Any] = ("ok", work(*args, **kwargs))
        except MemoryError:
            answer = ("memory", None)
        except SoftTimeLimit:
            answer = ("soft_time", None)
        except Exception as exc:
            answer = ("error", exc)
        try:
            payload = pickle.dumps(answer)
        except Exception as exc:  # an unpicklable result or exception
            payload = pickle.dumps(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view) :]
        code = 0
    except BaseException:  # noqa: S110 - no answer is itself the answer (OutOfResources)
        pass
    finally:
        # Skip atexit handlers, finalizers and buffered writers that belong to the parent.
        os._exit(code)


def _enter_sandbox(bounds: Bounds) -> None:
    signal.signal(signal.SIGTERM, _raise_soft_time_limit)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    limit = _mapped_bytes() + bounds.memory_bytes
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft == resource.RLIM_INFINITY or limit < soft:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    if bounds.background:
        _lowest_priority()
    _refuse_database()
    _forget_storages()
    torch = sys.modules.get("torch")
    if torch is not None:
        # Forked after the parent may have started OpenMP threads, which do not exist here.
        torch.set_num_threads(1)


def _lowest_priority(pid: int = 0) -> None:
    """Nice 19 and the idle I/O class, for this process (0) or a child of it (raising niceness needs no privilege)."""
    with contextlib.suppress(ProcessLookupError):
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    with contextlib.suppress(Exception):  # gone, or no I/O classes on this kernel or platform: CPU priority alone
        import psutil

        psutil.Process(pid or os.getpid()).ionice(psutil.IOPRIO_CLASS_IDLE)


def _raise_soft_time_limit(signum, frame) -> None:
    raise SoftTimeLimit


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _refuse_database() -> None:
    """A query here would go over the parent's connection (a shared socket): make it an error instead."""
    if "django.db" not in sys.modules:
        return
    from django.db import connections

    def refuse(*args, **kwargs):
        raise RuntimeError("sandboxed work must not use the database")

    for connection in connections.all(initialized_only=True):
        connection.execute_wrappers.append(refuse)


def _forget_storages() -> None:
    """Storage clients (an S3 connection pool) are the parent's: build fresh ones here."""
    if "django.core.files.storage" not in sys.modules:
        return
    from django.core.files.storage import storages

    with contextlib.suppress(AttributeError):
        storages._storages = {}


@contextlib.contextmanager
def background_thread() -> Iterator[None]:
    """Run the block at the lowest CPU priority, in this thread only.

    For bulk work a request does in its own thread (parsing a tenant's large upload while it has a
    backlog): under ASGI, Django runs each request's synchronous code in a thread of the request's
    own, which ends with it. Linux keeps niceness per thread; raising it needs no privilege, lowering
    it again does, so the old value is restored where allowed and otherwise dies with the thread.
    The main thread (management commands, the test client) is left alone.
    """
    if threading.current_thread() is threading.main_thread():
        yield
        return
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, 19)
    try:
        yield
    finally:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, tid, before)
