"""The serving benchmarks' stack keeps the machine's database and Redis servers off the engine's CPUs."""

from __future__ import annotations

import os

from benchmarks.stack import BackingServers


def _settings() -> dict[int, tuple[set[int], int]]:
    return {
        tid: (os.sched_getaffinity(tid), os.getpriority(os.PRIO_PROCESS, tid)) for _, tid in BackingServers.threads()
    }


def test_database_and_redis_move_to_the_front_cpus_and_come_back():
    before = _settings()
    names = {name for name, _ in BackingServers.threads()}
    assert names == {"postgres", "redis-server"}, "the suite runs against this machine's PostgreSQL and Redis"
    front = {min(os.sched_getaffinity(0))}
    with BackingServers(front, nice=7) as backing:
        during = _settings()
        if os.geteuid() == 0:
            assert backing.moved
            assert all(cpus == front and nice >= 7 for cpus, nice in during.values())
        else:  # only root may give the niceness back: nothing is touched
            assert not backing.moved
            assert during == before
    after = _settings()
    assert {tid: after[tid] for tid in before if tid in after} == {tid: before[tid] for tid in before if tid in after}
