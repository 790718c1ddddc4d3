"""The supervisor's placement of a child: CPUs and niceness, inherited by what it starts."""

from __future__ import annotations

import os
import time
from pathlib import Path

from devtools.supervisor import Supervisor


def _child_running(pid: int, cmdline: bytes) -> int:
    """The pid of the process `pid` started that runs `cmdline` (NUL-separated, as in /proc)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                try:
                    if Path(f"/proc/{child}/cmdline").read_bytes() == cmdline:
                        return int(child)
                except FileNotFoundError:
                    pass
        time.sleep(0.02)
    raise TimeoutError(f"the child did not start {cmdline!r}")


def test_cpus_and_nice_reach_the_child_and_what_it_starts(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    supervisor = Supervisor(tmp_path)
    # The shell starts `sleep` only after the supervisor has placed it.
    process = supervisor.start("probe", ["sh", "-c", "sleep 0.2; sleep 30 & wait"], cpus={cpu}, nice=7)
    try:
        for pid in (process.pid, _child_running(process.pid, b"sleep\x0030\x00")):
            assert os.sched_getaffinity(pid) == {cpu}
            assert os.getpriority(os.PRIO_PROCESS, pid) == 7
    finally:
        supervisor.stop_all()


def test_a_plain_start_changes_nothing(tmp_path):
    supervisor = Supervisor(tmp_path)
    process = supervisor.start("probe", ["sleep", "30"])
    try:
        assert os.sched_getaffinity(process.pid) == os.sched_getaffinity(0)
        assert os.getpriority(os.PRIO_PROCESS, process.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        supervisor.stop_all()
