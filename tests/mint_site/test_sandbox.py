"""Work on untrusted input runs in a child process that answers, or is stopped, within its bounds."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from mint_site.sandbox import Bounds, OutOfResources, TimeLimit, run_bounded

MiB = 1024 * 1024
QUICK = Bounds(soft_time_s=1.0, hard_time_s=2.0, memory_bytes=256 * MiB)


def test_the_result_and_the_exception_of_the_work_come_back():
    assert run_bounded(lambda a, b=0: {"sum": a + b}, 2, b=40, bounds=QUICK) == {"sum": 42}
    with pytest.raises(ValueError, match="bad input"):
        run_bounded(lambda: (_ for _ in ()).throw(ValueError("bad input")), bounds=QUICK)


def test_the_work_runs_in_another_process():
    assert run_bounded(os.getpid, bounds=QUICK) != os.getpid()


def test_past_the_soft_limit_the_work_is_stopped_and_its_cleanup_runs(tmp_path: Path):
    marker = tmp_path / "cleaned"

    def slow() -> None:
        try:
            time.sleep(30)
        finally:
            marker.write_text("yes")

    started = time.monotonic()
    with pytest.raises(TimeLimit, match="time limit"):
        run_bounded(slow, bounds=QUICK)
    assert time.monotonic() - started < 20  # a hang timeout: the sleep alone is 30 s
    assert marker.read_text() == "yes"


def test_work_that_ignores_the_soft_limit_is_killed_at_the_hard_one():
    def stubborn() -> None:
        while True:
            with contextlib.suppress(BaseException):  # what hostile work does with a polite request to stop
                time.sleep(30)

    with pytest.raises(TimeLimit, match="hard time limit"):
        run_bounded(stubborn, bounds=QUICK)


def test_work_that_needs_more_memory_than_allowed_ends_out_of_resources():
    with pytest.raises(OutOfResources, match="256 MiB"):
        run_bounded(lambda: len(bytearray(1024 * MiB)), bounds=QUICK)
    # The parent is unharmed and may allocate as before.
    assert len(bytearray(64 * MiB)) == 64 * MiB


def test_a_child_killed_outright_ends_out_of_resources_and_the_parent_lives_on():
    with pytest.raises(OutOfResources, match="SIGKILL"):
        run_bounded(lambda: os.kill(os.getpid(), signal.SIGKILL), bounds=QUICK)
    assert run_bounded(lambda: "still working", bounds=QUICK) == "still working"


@pytest.mark.django_db
def test_the_work_may_not_use_the_parents_database_connection(tenant_a):
    from tenants.models import Tenant

    assert Tenant.objects.filter(id=tenant_a.tenant.id).exists()  # the parent's connection is open
    with pytest.raises(RuntimeError, match="must not use the database"):
        run_bounded(lambda: Tenant.objects.count(), bounds=QUICK)
    assert Tenant.objects.filter(id=tenant_a.tenant.id).exists()  # and still works


def test_long_work_is_demoted_to_the_lowest_priority_and_short_work_is_not():
    def niceness_after(seconds: float) -> int:
        time.sleep(seconds)
        return os.getpriority(os.PRIO_PROCESS, 0)

    before = os.getpriority(os.PRIO_PROCESS, 0)
    demoting = Bounds(soft_time_s=5, hard_time_s=6, memory_bytes=256 * MiB, demote_after_s=0.2)
    assert run_bounded(niceness_after, 0.0, bounds=demoting) == before
    assert run_bounded(niceness_after, 1.0, bounds=demoting) == 19
    background = Bounds(soft_time_s=5, hard_time_s=6, memory_bytes=256 * MiB, background=True)
    assert run_bounded(niceness_after, 0.0, bounds=background) == 19
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the parent keeps its own
