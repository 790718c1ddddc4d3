"""Ctrl-C stops everything `make run` started, within a bound, even from the background and with a hung child."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from devtools.supervisor import BASE_DIR

GRACE_S = 1.0
BOUND_S = 10.0  # the grace, then SIGKILL to each process group, with room for a busy machine


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for_line(path, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        output = path.read_text() if path.exists() else ""
        if text in output:
            return output
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {output!r}")


def test_sigint_to_a_background_supervisor_stops_every_child_even_one_that_ignores_sigterm(tmp_path):
    out = tmp_path / "out.txt"
    # A non-interactive shell starts its background jobs with SIGINT ignored.
    supervising_argv = [sys.executable, "-m", "tests.devtools.hung_children", str(tmp_path / "log"), str(GRACE_S)]
    shell = subprocess.Popen(
        ["sh", "-c", '"$@" >"$OUT" 2>&1 & wait', "sh", *supervising_argv],
        cwd=BASE_DIR,
        env={"OUT": str(out), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(BASE_DIR)},
    )
    try:
        output = _wait_for_line(out, "ready")
        assert "inherited SIGINT: ignored" in output
        (supervising,) = psutil.Process(shell.pid).children()
        children = supervising.children(recursive=True)
        assert len(children) >= 4, children  # hung's shell and two sleeps, plain's sleep

        supervising.send_signal(signal.SIGINT)
        started = time.monotonic()
        shell.wait(timeout=BOUND_S)
        while any(_alive(c) for c in children) and time.monotonic() - started < BOUND_S:
            time.sleep(0.05)
        elapsed = time.monotonic() - started
    finally:
        if shell.poll() is None:
            for process in psutil.Process(shell.pid).children(recursive=True):
                process.kill()
            shell.kill()

    assert "stopping" in out.read_text()
    assert not [c for c in children if _alive(c)], "children survived SIGINT"
    assert GRACE_S <= elapsed < BOUND_S, elapsed  # the hung child waited out the grace, and no longer
