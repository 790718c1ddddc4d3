"""Live events: time from a committed state change to the message arriving at a dashboard WebSocket.

A private stack (its own PostgreSQL and Redis databases, the web server, one Celery worker) and a
WebSocket client signed in as a tenant member, connected to `ws/live/` like the dashboard:

(a) changes made by Celery tasks: revisions registered with a tiny adapter go through
    validation and export on the worker; each revision.state event is timed from its own
    `at` stamp (taken inside the committing transaction, so this slightly over-counts).
(b) changes made in this process through the services (request approval, approve): timed
    from the moment the transaction committed (the first on-commit callback) to arrival.

Target: p95 <= 250 ms.

    python -m benchmarks.live_events [--quick] [--database NAME]
"""

from __future__ import annotations

import asyncio
import json
import queue
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from benchmarks.common import (
    bench_database_url,
    bench_env,
    parser,
    recreate_database,
    scratch,
    setup_django,
    start_web,
    summary_ms,
    supervised,
    write_result,
)
from benchmarks.report.plots import plot_result
from devtools.launcher import worker_argv

TARGET_P95_MS = 250.0
DB_NAME = "mint_bench_live_events"
REDIS_DB = 12  # registration uses 14, the serving stack 13, catalog 11


class Listener:
    """A WebSocket client on its own thread and event loop; puts (arrival wall time, event) on a queue."""

    def __init__(self, url: str, *, cookie: str, origin: str):
        self.url, self.headers = url, {"Cookie": cookie, "Origin": origin}
        self.events: queue.Queue[tuple[float, dict]] = queue.Queue()
        self.connected = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._listen()), daemon=True)
        self.thread.start()
        if not self.connected.wait(30):
            raise RuntimeError(f"WebSocket did not connect: {self.failure!r}")

    async def _listen(self) -> None:
        from websockets.asyncio.client import connect

        try:
            async with connect(self.url, additional_headers=self.headers) as socket:
                self.connected.set()
                async for raw in socket:
                    self.events.put((time.time(), json.loads(raw)))
        except BaseException as exc:  # reported by the waiting side
            self.failure = exc
            self.connected.set()

    def take(self, predicate, *, timeout: float = 30) -> tuple[float, dict]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                arrived, event = self.events.get(timeout=left)
            except queue.Empty:
                break
            if predicate(event):
                return arrived, event
        raise TimeoutError(f"no matching event within {timeout} s ({self.failure!r})")

    def drain(self) -> list[tuple[float, dict]]:
        items = []
        while not self.events.empty():
            items.append(self.events.get_nowait())
        return items


def setup_world(work: Path):
    """A tenant with a member signed in (session cookie), an adapter on a shape-only base model."""
    from django.conf import settings
    from django.test import Client

    from adapters import services as adapters
    from adapters.models import BaseModel
    from tenants import services
    from tenants.access import Actor
    from tenants.management.lookups import get_or_create_user
    from tenants.models import Tenant

    owner, _ = get_or_create_user("bench-owner")
    tenant = services.tenant_create(slug="bench", owner=owner, by=Actor.system())
    Tenant.objects.filter(id=tenant.id).update(four_eyes=False)
    base = BaseModel.objects.create(
        name="bench-base",
        architecture="dense",
        max_lora_rank=16,
        config={
            "architecture": "dense",
            "num_layers": 2,
            "num_experts": 0,
            "module_shapes": {"q_proj": [64, 64], "v_proj": [64, 32]},
            "expert_module_shapes": {},
        },
    )
    adapter = adapters.adapter_create(tenant=tenant, name="live", base_model=base, description="", by=Actor.system())
    browser = Client()
    browser.force_login(owner)
    cookie = f"{settings.SESSION_COOKIE_NAME}={browser.cookies[settings.SESSION_COOKIE_NAME].value}"
    return tenant, owner, adapter, cookie


def worker_changes(listener: Listener, tenant, adapter, work: Path, count: int) -> tuple[list[float], list]:
    """Register `count` revisions; the worker validates and exports them. Latency of every task-made event."""
    from adapters import services
    from devtools.tiny import make_tiny_lora
    from tenants.access import Actor

    latencies, revisions = [], []
    for i in range(count):
        rel = f"t/{tenant.id}/incoming/live-{i}"
        make_tiny_lora(adapter.base_model.spec, work / "artifacts" / rel, rank=4, seed=i)
        revision = services.revision_register(adapter=adapter, by=Actor.system(), source_uri=f"{rel}/")
        revisions.append(revision)
        while True:  # the worker's events for this revision, up to `exported`
            arrived, event = listener.take(lambda e, r=revision: e["type"] == "revision.state" and e["id"] == r.id)
            if event["state"] != "registered":  # `registered` is committed by this process, not the worker
                latencies.append(arrived - datetime.fromisoformat(event["at"]).timestamp())
            if event["state"] in ("exported", "failed"):
                if event["state"] == "failed":
                    raise RuntimeError(f"revision failed: {event}")
                break
    return latencies, revisions


def service_changes(listener: Listener, revisions: list, owner) -> list[float]:
    """Request approval and approve each revision here; time from commit to arrival."""
    from django.db import transaction

    from adapters import services
    from tenants.access import Actor

    latencies = []
    for revision in revisions:
        for change, state in (
            (services.revision_request_approval, "pending_approval"),
            (services.revision_approve, "approved"),
        ):
            committed: list[float] = []
            with transaction.atomic():
                transaction.on_commit(lambda c=committed: c.append(time.time()))  # first to run after COMMIT
                revision = change(revision=revision, by=Actor.system())
            arrived, _ = listener.take(lambda e, r=revision, s=state: e["id"] == r.id and e["state"] == s)
            latencies.append(arrived - committed[0])
    return latencies


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--database", default=DB_NAME, help=f"the benchmark's database name (default {DB_NAME})")
    args = p.parse_args()
    count = 5 if args.quick else 100
    with scratch("live") as work, supervised(work, "web", "worker") as supervisor:
        db_url = bench_database_url(args.database)
        recreate_database(db_url)
        env = bench_env(work, db_url=db_url, redis_db=REDIS_DB, MINT_LOCAL_NODE="0")
        setup_django(env)
        supervisor.start("worker", worker_argv("control", concurrency=1, log_level="warning"), env=env)
        base = start_web(supervisor, env)
        tenant, owner, adapter, cookie = setup_world(work)
        ws = base.replace("http://", "ws://")
        listener = Listener(f"{ws}/ws/live/?tenant={tenant.slug}", cookie=cookie, origin=base)
        from_worker, revisions = worker_changes(listener, tenant, adapter, work, count)
        from_service = service_changes(listener, revisions, owner)

    worker_summary, service_summary = summary_ms(from_worker), summary_ms(from_service)
    figures = {
        "worker_task_changes": worker_summary,
        "service_changes": service_summary,
        "target_p95_ms": TARGET_P95_MS,
        "met": max(worker_summary["p95_ms"], service_summary["p95_ms"]) <= TARGET_P95_MS,
    }
    path = write_result("live_events", figures, quick=args.quick, out_dir=args.out)
    plot_result(path)
    print(json.dumps(figures, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
