"""Redis flushed and restarted mid-traffic loses nothing: real workers, a real Redis of the test's own, real vLLM.

The database is the source of truth. While a client keeps calling the live adapter, the test leaves work in
the broker only (a prewarm for a node agent that is down, a validation behind an export the control worker is
busy with), then flushes and restarts Redis, as a restart of a Redis without persistence does. Every
revision and placement must still reach the state it would have reached: the lost hand-offs are driven
again once a probe shows their queue moved past them (MINT_TASK_PICKUP_S), the export the worker was running
is not handed over twice, the alias flips, and the client sees only 200s and 503s.

The Redis is private (its own redis-server on a free port), so flushing it touches nobody else's. The test
process enqueues nothing itself: every action goes through the real web server, which, with the workers,
uses that Redis; the test process's own cache and channel layer are pointed at it too.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
from django.db import connection

from adapters.models import Adapter, AdapterRevision
from devtools.supervisor import free_port, redis_ok, wait_for
from serving.models import Alias, NodeState, Placement, ServingNode
from tenants.models import AuditEvent, Tenant
from tests.e2e.conftest import log_of, make_peft_adapter
from tests.e2e.world import session_node, wait, worker_stacks

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

ADAPTER = "support-bot"
PICKUP_S = 2


class PrivateRedis:
    """A redis-server of this test only, without persistence: restarting it empties it."""

    def __init__(self, supervisor):
        self.supervisor = supervisor
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.supervisor.start("redis", argv)
        wait_for(lambda: redis_ok(self.port), timeout=15, what="redis-server")

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def holds(self, queue: str, task: str, **kwargs: int) -> bool:
        """Whether a message of `task` with these arguments waits in `queue` (kombu's JSON envelope)."""
        with self.client() as client:
            headers = [json.loads(raw)["headers"] for raw in client.lrange(queue, 0, -1)]
        wanted = [f"'{name}': {value}" for name, value in kwargs.items()]
        return any(h["task"] == task and all(w in h["kwargsrepr"] for w in wanted) for h in headers)

    def flush_and_restart(self) -> None:
        with self.client() as client:
            client.flushall()
        self.supervisor.stop("redis")
        self.start()


class Traffic(threading.Thread):
    """Calls the live adapter through the gateway until stopped, recording each answer's status."""

    def __init__(self, web: str, token: str):
        super().__init__(daemon=True)
        self.web, self.token = web, token
        self.statuses: list[tuple[float, int | str]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.web, headers={"Authorization": f"Bearer {self.token}"}, timeout=60) as http:
            while not self.halt.is_set():
                try:
                    body = {"model": ADAPTER, "prompt": "hello", "max_tokens": 1, "temperature": 0}
                    status: int | str = http.post("/v1/completions", json=body).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self.statuses.append((time.monotonic(), status))
                time.sleep(0.25)  # a few requests a second: well inside the plan's rate limit

    def stop(self) -> list[tuple[float, int | str]]:
        self.halt.set()
        self.join(timeout=90)
        return self.statuses


def upload(api: httpx.Client, directory: Path) -> int:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(directory.rglob("*")) if p.is_file()]
    response = api.post(f"/api/v1/adapters/{ADAPTER}/revisions/", files=files)
    assert response.status_code == 201, response.text
    return response.json()["number"]


def database_activity() -> list[tuple]:
    """What every other connection to the test database is doing, and which of them wait on a lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, state, wait_event_type, pg_blocking_pids(pid), now() - xact_start, left(query, 300)"
            " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND state <> 'idle'"
        )
        return cursor.fetchall()


def revision(number: int) -> AdapterRevision:
    return AdapterRevision.objects.get(adapter__name=ADAPTER, number=number)


def test_redis_flushed_and_restarted_mid_traffic_loses_nothing(
    tenant_a, engine, tiny_llama_dir, artifact_root, tmp_path, supervisor, start_worker, start_web, settings
):
    private = PrivateRedis(supervisor)
    private.start()
    settings.REDIS_URL = private.url
    settings.CACHES = {"default": settings.CACHES["default"] | {"LOCATION": private.url}}
    layer = settings.CHANNEL_LAYERS["default"]
    settings.CHANNEL_LAYERS = {
        "default": layer
        | {"CONFIG": layer["CONFIG"] | {"hosts": [layer["CONFIG"]["hosts"][0] | {"address": private.url}]}}
    }
    env = {
        "REDIS_URL": private.url,
        "MINT_ARTIFACT_ROOT": str(artifact_root),
        "MINT_HEARTBEAT_S": "1",
        "MINT_TASK_PICKUP_S": str(PICKUP_S),
        "MINT_NODE_PREWARM_DUTY": "1",
    }
    # One key registers and approves; two of the tenant's revisions may be worked on at once (r3 and r4 below).
    Tenant.objects.filter(id=tenant_a.tenant.id).update(four_eyes=False, max_concurrent_tasks=2)
    base, node = session_node(engine, tiny_llama_dir, tmp_path)
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name=ADAPTER, base_model=base)
    # The control worker writes exports slowly (each file then 2 s), so that one is still running at the flush.
    worker = start_worker("control", name="control", extra_env=env | {"MINT_TEST_EXPORT_DELAY_MS": "2000"}, beat=True)
    start_worker("node.e2e", name="agent", extra_env=env)
    web = start_web(env)
    _, token = tenant_a.key("pipeline", "deploy", "inference")
    api = httpx.Client(base_url=web, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def logs() -> str:
        placements = list(Placement.objects.values("revision__number", "state", "attempts", "failure_reason"))
        revisions = list(AdapterRevision.objects.values("number", "state", "deliveries", "dispatched_at"))
        parts = [f"placements: {placements}", f"revisions: {revisions}", f"database: {database_activity()}"]
        worker_stacks(supervisor, "control")
        for name in ("control", "agent", "agent-again", "web"):
            lines = log_of(supervisor, name).splitlines()
            text = "\n".join(line for line in lines if "GET /" not in line and "Sending due task" not in line)
            keep = 12000 if name == "control" else 4000  # the control worker's stacks, when asked for
            parts.append(f"--- {name}\n{text[-keep:]}")
        return "\n".join(parts)

    wait(lambda: ServingNode.objects.get(id=node.id).state == NodeState.UP, timeout=60, what="heartbeat", logs=logs)

    # r1 live and serving, r2 approved and ready to activate.
    for seed in (1, 2):
        upload(api, make_peft_adapter(tiny_llama_dir, tmp_path / f"peft-{seed}", seed=seed))
    for number in (1, 2):
        wait(lambda n=number: revision(n).state == "exported", timeout=90, what=f"r{number} exported", logs=logs)
        assert api.post(f"/api/v1/adapters/{ADAPTER}/revisions/{number}/request-approval/").status_code == 200
        assert api.post(f"/api/v1/adapters/{ADAPTER}/revisions/{number}/approve/", json={}).status_code == 200
    assert api.post(f"/api/v1/adapters/{ADAPTER}/activate/", json={"revision": "r1"}).status_code == 200
    production = Alias.objects.filter(adapter=adapter, name="production")
    wait(lambda: production.get().revision_id == revision(1).id, timeout=60, what="r1 live", logs=logs)
    traffic = Traffic(web, token)
    traffic.start()
    wait(lambda: any(s == 200 for _, s in traffic.statuses), timeout=30, what="r1 answering", logs=logs)

    # A prewarm that only the broker holds: the node agent is down when r2's activation claims its load.
    supervisor.stop("agent")
    assert api.post(f"/api/v1/adapters/{ADAPTER}/activate/", json={"revision": "r2"}).status_code == 200
    wait(
        lambda: Placement.objects.filter(revision=revision(2), state="loading").exists(),
        timeout=30,
        what="r2 claimed for loading",
        logs=logs,
    )
    # r3's export is running in the control worker; r4's validation waits behind it in the broker.
    upload(api, make_peft_adapter(tiny_llama_dir, tmp_path / "peft-3", seed=3))

    def exporting(number: int) -> bool:
        """Validated, and picked up since: its export began."""
        current = revision(number)
        return (
            current.state == "validated"
            and current.picked_up_at is not None
            and current.picked_up_at >= current.updated_at
        )

    wait(lambda: exporting(3), timeout=60, what="r3 exporting", logs=logs)
    upload(api, make_peft_adapter(tiny_llama_dir, tmp_path / "peft-4", seed=4))
    r4 = revision(4)
    assert r4.dispatched_at is not None and r4.picked_up_at is None
    loading = Placement.objects.get(revision=revision(2))
    assert private.holds("node.e2e", "serving.tasks.placement_prewarm", placement_id=loading.id)
    assert private.holds("control", "adapters.tasks.revision_validate", revision_id=r4.id)

    flushed = time.monotonic()
    private.flush_and_restart()
    start_worker("node.e2e", name="agent-again", extra_env=env)

    r2 = revision(2)
    wait(
        lambda: (
            all(revision(n).state == "exported" for n in (3, 4))
            and Placement.objects.filter(revision=r2, state="ready").exists()
            and production.get().revision_id == r2.id
        ),
        timeout=120,
        what="every revision and placement where it would have been",
        logs=logs,
    )
    recovered = time.monotonic()
    wait(
        lambda: any(s == 200 and t > recovered for t, s in traffic.statuses),
        timeout=30,
        what="r2 answering",
        logs=logs,
    )
    statuses = traffic.stop()

    placement = Placement.objects.get(revision=r2)
    assert placement.attempts == 2, logs()  # claimed again once: the lost prewarm was driven again, counted
    assert placement.failure_reason == "its task was lost before the node agent began it"
    requeued = {e.target for e in AuditEvent.objects.filter(action="revision.requeue")}
    assert f"revision:{ADAPTER}@r4" in requeued, logs()  # its lost validation was handed over again
    assert f"revision:{ADAPTER}@r3" not in requeued  # the export the worker was running was not handed over twice
    assert worker.poll() is None, "the control worker (and its beat) survived the restart and reconnected"
    assert {s for _, s in statuses} <= {200, 503}, [s for _, s in statuses if s not in (200, 503)][:20]
    assert any(s == 200 and t < flushed for t, s in statuses) and any(s == 200 and t > flushed for t, s in statuses)
