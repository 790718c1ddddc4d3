"""Set-up shared by end-to-end tests of the serving plane: a node on the session's vLLM, workers, the web server."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adapters.base_models import base_model_upsert
from adapters.models import Adapter, AdapterRevision, BaseModel
from serving import services as serving_services
from serving.models import Alias, NodeState, Placement, ServingNode
from tenants.access import Actor
from tests.adapters.fixtures import uploads_of
from tests.e2e.conftest import log_of, make_peft_adapter


def wait(predicate: Callable, *, timeout: float, what: str, logs: Callable[[], str] = lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{logs()}")


def worker_stacks(supervisor, name: str) -> None:
    """Ask the Celery worker `name` to write every thread's stack to its log (its SIGUSR1 handler), so that a
    timed-out wait shows where a stuck worker is stuck."""
    running = [p for child, p in supervisor.children if child == name and p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGUSR1)
    if running:
        time.sleep(1)  # the handler writes while the caller reads the log


def session_node(engine, tiny_llama_dir: Path, tmp_path: Path) -> tuple[BaseModel, ServingNode]:
    """The tiny Llama as a base model and node `e2e` on the session's vLLM, with its cache under `tmp_path`."""
    base = base_model_upsert(name="tiny-llama", path=tiny_llama_dir, max_lora_rank=16, by=Actor.system())
    node = serving_services.node_register(
        name="e2e",
        base_model=base,
        url=engine.url,
        served_model_name=engine.served_name,
        gpu_slots=engine.max_loras,
        cpu_slots=engine.max_cpu_loras,
        max_lora_rank=engine.max_lora_rank,
        cache_dir=str(tmp_path / "node-cache"),
        engine_flags=engine.extra_flags(),
        by=Actor.system(),
    )
    return base, node


@dataclass
class ServingWorld:
    adapter: Adapter
    node: ServingNode
    web: str  # base URL of the ASGI server
    logs: Callable[[], str]


def serving_world(
    *,
    tenant,
    engine,
    tiny_llama_dir: Path,
    tmp_path: Path,
    start_worker,
    start_web,
    supervisor,
    env: dict[str, str],
    adapter_name: str = "support-bot",
) -> ServingWorld:
    """A node `e2e` on the session's vLLM (up), an adapter of `tenant`, a worker with beat, the web server."""
    base, node = session_node(engine, tiny_llama_dir, tmp_path)
    adapter = Adapter.objects.create(tenant=tenant, name=adapter_name, base_model=base)
    start_worker("control", "node.e2e", extra_env=env, beat=True)
    web = start_web(env)

    def logs() -> str:
        placements = list(Placement.objects.values("revision__number", "state", "attempts", "failure_reason"))
        aliases = list(Alias.objects.values("name", "revision_id", "desired_revision_id"))
        worker = "\n".join(line for line in log_of(supervisor, "worker").splitlines() if "GET /" not in line)
        web_log = log_of(supervisor, "web")
        return f"placements: {placements}\naliases: {aliases}\n--- worker\n{worker[-6000:]}\n--- web\n{web_log[-3000:]}"

    wait(lambda: ServingNode.objects.get(id=node.id).state == NodeState.UP, timeout=30, what="heartbeat", logs=logs)
    return ServingWorld(adapter=adapter, node=node, web=web, logs=logs)


def register_peft_revisions(world: ServingWorld, client, tiny_llama_dir: Path, tmp_path: Path, seeds=(1, 2)) -> None:
    """Register one peft-made revision per seed through the REST API with `client`, and wait until each is exported."""
    name = world.adapter.name
    numbers = []
    for seed in seeds:
        files = uploads_of(make_peft_adapter(tiny_llama_dir, tmp_path / f"peft-{seed}", seed=seed))
        response = client.post(f"/api/v1/adapters/{name}/revisions/", {"files": files}, format="multipart")
        assert response.status_code == 201, response.content
        numbers.append(response.json()["number"])
    for number in numbers:
        wait(
            lambda n=number: AdapterRevision.objects.get(adapter=world.adapter, number=n).state == "exported",
            timeout=90,
            what=f"r{number} exported",
            logs=world.logs,
        )


def ready_nodes(revision: AdapterRevision) -> set[str]:
    """The names of the up nodes where `revision` is ready."""
    return set(
        Placement.objects.filter(revision=revision, state="ready", node__state=NodeState.UP).values_list(
            "node__name", flat=True
        )
    )


def register_and_approve(tenant, adapter: Adapter, tiny_llama_dir, tmp_path, seed: int, fleet) -> AdapterRevision:
    pipeline, approver = tenant.client_as("key:pipeline"), tenant.client_as("approver")
    files = uploads_of(make_peft_adapter(tiny_llama_dir, tmp_path / f"peft-{adapter.name}-{seed}", seed=seed))
    response = pipeline.post(f"/api/v1/adapters/{adapter.name}/revisions/", {"files": files}, format="multipart")
    assert response.status_code == 201, response.content
    number = response.json()["number"]
    revision = AdapterRevision.objects.get(adapter=adapter, number=number)
    wait(
        lambda: AdapterRevision.objects.get(id=revision.id).state in ("exported", "failed"),
        timeout=120,
        what=f"{adapter.name} r{number} exported",
        logs=fleet.logs,
    )
    revision.refresh_from_db()
    assert revision.state == "exported", (revision.failure_reason, fleet.logs())
    url = f"/api/v1/adapters/{adapter.name}/revisions/{number}"
    assert pipeline.post(f"{url}/request-approval/").status_code == 200
    assert approver.post(f"{url}/approve/", {}, format="json").status_code == 200
    return revision
