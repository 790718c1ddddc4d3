"""A private MinT serving stack for the serving benchmarks: its own PostgreSQL database and Redis
database, a vLLM CPU engine on the generated tiny Llama, the web server, a control worker (with beat) and
a node agent. The benchmark process itself talks to the database through the ORM.

Where the machine has two CPUs or more, the stack is laid out as it is deployed: vLLM on one half of
the CPUs, which stand for the serving node's accelerator; the web server with the gateway, the
benchmark's client, the control worker and the node agent on the other. vLLM's engine processes
busy-poll their shared-memory queues for a second after every step; sharing CPUs with them would
measure how the gateway is starved, not what it costs. The node agent belongs to the node host, but
on a GPU node it shares the host's CPUs, never the accelerator that serves; on the engine's own CPU
here its copies, checksums and Celery bookkeeping (tens of milliseconds of CPU a prewarm) were charged
to every request in flight. Workers run at the niceness `make run` gives them, and so does the
benchmark's own control-plane work (`Stack.as_control_plane`). The machine's PostgreSQL and Redis
servers stand for hosts of their own: for the stack's lifetime they are moved off the engine's CPUs
and to the workers' niceness (`BackingServers`; restored on exit), or every query a worker made ran
on the accelerator beside vLLM at the gateway's priority. `placement` records the layout in every
result.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from benchmarks.common import bench_database_url, bench_env, print_logs, recreate_database, setup_django, wait_http
from devtools.launcher import web_argv, worker_argv, worker_nice
from devtools.supervisor import Supervisor, free_port

NODE = "bench"


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(front, node): the CPUs for the web server and clients, and those for the serving node; None on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


class BackingServers:
    """The machine's PostgreSQL and Redis server processes, moved to `cpus` at `nice` while in use.

    Every thread of theirs is moved, and so are processes started meanwhile (PostgreSQL forks a
    backend per connection from its postmaster, which passes its CPU set and niceness on). On
    exit each returns to what its server had before. Only root may give the niceness back, so
    for anyone else they are left alone and `moved` says so.
    """

    NAMES = ("postgres", "redis-server")

    def __init__(self, cpus: set[int], nice: int):
        self.cpus, self.nice = cpus, nice
        self._before: dict[str, tuple[set[int], int]] = {}
        self.moved = False

    @classmethod
    def threads(cls) -> Iterator[tuple[str, int]]:
        """(server name, thread id) of every thread of every server process."""
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with suppress(OSError):  # gone meanwhile
                    name = (proc / "comm").read_text().strip()
                    if name in cls.NAMES:
                        yield from ((name, int(task.name)) for task in (proc / "task").iterdir())

    def _apply(self, settings: dict[str, tuple[set[int], int]]) -> None:
        for name, tid in self.threads():
            if name in settings:
                cpus, nice = settings[name]
                with suppress(ProcessLookupError):
                    os.sched_setaffinity(tid, cpus)
                    os.setpriority(os.PRIO_PROCESS, tid, nice)

    def __enter__(self) -> BackingServers:
        if os.geteuid() != 0:
            return self
        for name, tid in self.threads():
            with suppress(OSError):
                self._before.setdefault(name, (os.sched_getaffinity(tid), os.getpriority(os.PRIO_PROCESS, tid)))
        self._apply({name: (self.cpus, max(nice, self.nice)) for name, (_, nice) in self._before.items()})
        self.moved = bool(self._before)
        return self

    def __exit__(self, *exc) -> None:
        if self.moved:
            self._apply(self._before)
            self.moved = False


class Stack:
    def __init__(
        self,
        name: str,
        *,
        cpu_slots: int = 48,
        max_loras: int = 4,
        redis_db: int = 13,
        env: dict[str, str] | None = None,
        engine_flags: list[str] | None = None,
    ):
        """`redis_db`: the stack's Redis database; `env`: more MINT_* settings for every process of the stack;
        `engine_flags`: more vLLM flags, which the node's record names too."""
        self.work = Path(tempfile.mkdtemp(prefix=f"mint-bench-{name}-"))
        self.db_url = bench_database_url(f"mint_bench_{name}")
        self.env = bench_env(
            self.work,
            db_url=self.db_url,
            redis_db=redis_db,
            MINT_HEARTBEAT_S="1",
            MINT_GATEWAY_CACHE_S="1.0",
            **(env or {}),
        )
        self.cpu_slots, self.max_loras = cpu_slots, max_loras
        self.engine_flags = list(engine_flags or ())
        self.supervisor = Supervisor(self.work / "log")
        self.vllm_url = self.web_url = ""
        self.cpus = split_cpus()
        self._own_cpus = os.sched_getaffinity(0)
        front, node = self.cpus or (None, None)
        self.backing = BackingServers(front, worker_nice(self.env)) if front else None
        layout = {"front_cpus": sorted(front), "node_cpus": sorted(node)} if self.cpus else {"cpus": "all shared"}
        self.placement = layout | {
            "front": "web (gateway), benchmark client, control worker, node agent",
            "node": "vLLM (the node's accelerator)",
            "worker_nice": worker_nice(self.env),
        }

    def __enter__(self) -> Stack:
        recreate_database(self.db_url)
        setup_django(self.env)
        try:
            if self.backing:
                self.backing.__enter__()
                self.placement["database_and_redis"] = (
                    "front CPUs, workers' niceness" if self.backing.moved else "not moved (needs root)"
                )
            self._start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _start(self) -> None:
        front, node = self.cpus or (None, None)
        if front:
            os.sched_setaffinity(0, front)  # the benchmark's client runs where the gateway's callers would
        from adapters.base_models import base_model_upsert
        from devtools.local_node import start_engine
        from devtools.tiny import make_tiny_model
        from serving import services
        from tenants.access import Actor

        model_dir = make_tiny_model("dense", self.work / "models" / "tiny-llama")
        self.base = base_model_upsert(name="tiny-llama", path=model_dir, max_lora_rank=16, by=Actor.system())
        vllm_port, web_port = free_port(), free_port()
        start_engine(
            self.supervisor,
            "vllm",
            model_dir=model_dir,
            port=vllm_port,
            served_name="tiny-llama",
            max_loras=self.max_loras,
            max_cpu_loras=self.cpu_slots,
            max_lora_rank=16,
            cpus=node,
            extra=self.engine_flags,
        )
        self.vllm_url, self.web_url = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{web_port}"
        services.node_register(
            name=NODE,
            base_model=self.base,
            url=self.vllm_url,
            served_model_name="tiny-llama",
            gpu_slots=self.max_loras,
            cpu_slots=self.cpu_slots,
            max_lora_rank=16,
            cache_dir=str(self.work / "node-cache"),
            engine_flags=self.engine_flags,
            by=Actor.system(),
        )
        self.supervisor.start("web", web_argv("127.0.0.1", web_port), env=self.env, cpus=front)
        self._start_workers()
        wait_http(f"{self.vllm_url}/health", timeout=400)
        wait_http(f"{self.web_url}/healthz", timeout=60)
        from serving.models import ServingNode

        self.wait(lambda: ServingNode.objects.get(name=NODE).state == "up", what="node up", timeout=60)

    def _start_workers(self) -> None:
        """The control plane's worker (with beat) and the node agent off the engine's CPUs, both at the CPU
        priority `make run` gives workers."""
        front = self.cpus[0] if self.cpus else None
        nice = worker_nice(self.env)
        self.supervisor.start(
            "worker",
            worker_argv("control", beat_schedule=self.work / "beat-schedule", log_level="warning"),
            env=self.env,
            cpus=front,
            nice=nice,
        )
        self.supervisor.start(
            "agent",
            worker_argv(f"node.{NODE}", log_level="warning"),
            env=self.env,
            cpus=front,
            nice=nice,
        )

    def restart_workers(self, **env: str) -> None:
        """Start the worker and the node agent again with more settings (a setting known only once the stack
        runs, such as a size measured on its first exports)."""
        self.env.update(env)
        for name in ("agent", "worker"):
            self.supervisor.stop(name)
        self._start_workers()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            print_logs(self.supervisor, "vllm", "web", "worker", "agent")
        self.supervisor.stop_all()
        if self.backing:
            self.backing.__exit__()
        os.sched_setaffinity(0, self._own_cpus)
        shutil.rmtree(self.work, ignore_errors=True)

    @contextmanager
    def as_control_plane(self) -> Iterator[None]:
        """Run the benchmark's own control-plane work (activating through the ORM, polling for the
        result) at the workers' CPU priority, as the API server and workers it stands in for would
        run: it shares the front CPUs with the gateway it measures. Linux keeps niceness per thread;
        this thread's is restored after (where the process may raise it again)."""
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, max(before, worker_nice(self.env)))
        try:
            yield
        finally:
            with suppress(PermissionError):
                os.setpriority(os.PRIO_PROCESS, 0, before)

    @staticmethod
    def wait(predicate, *, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise TimeoutError(f"timed out waiting for {what}")

    def tenant(self, slug: str = "bench"):
        return bench_tenant(slug)

    def approved_revision(self, tenant, name: str, *, seed: int):
        """An adapter with one revision taken through validation and export by the worker, then approved."""
        adapter, (revision,) = self.approved_revisions(tenant, name, [seed])
        return adapter, revision

    def pending_revision(self, tenant, name: str, *, seed: int):
        """An adapter whose new revision the worker validated and exported, awaiting approval (a revision under
        four-eyes that nobody may call yet)."""
        adapter, (revision,) = self.pending_revisions(tenant, name, [seed])
        return adapter, revision

    def approved_revisions(self, tenant, name: str, seeds: list[int]):
        """`pending_revisions`, each then approved."""
        from adapters import services
        from tenants.access import Actor

        adapter, revisions = self.pending_revisions(tenant, name, seeds)
        for revision in revisions:
            services.revision_approve(revision=revision, by=Actor.system())
        return adapter, revisions

    def pending_revisions(self, tenant, name: str, seeds: list[int]):
        """Adapter `name` (created if need be) and a new revision of it per seed, registered at once (one at a time,
        forty take minutes), validated and exported by the worker, awaiting approval; in number order."""
        from adapters import services
        from adapters.models import Adapter, AdapterRevision
        from devtools.tiny import make_tiny_lora
        from tenants.access import Actor

        adapter = Adapter.objects.filter(tenant=tenant, name=name).first() or services.adapter_create(
            tenant=tenant, name=name, base_model=self.base, description="", by=Actor.system()
        )
        ids = []
        for seed in seeds:
            source = f"t/{tenant.id}/incoming/{name}-{seed}"
            make_tiny_lora(self.base.spec, self.work / "artifacts" / source, rank=8, seed=seed)
            ids.append(services.revision_register(adapter=adapter, by=Actor.system(), source_uri=f"{source}/").id)
        self.wait(
            lambda: not AdapterRevision.objects.filter(id__in=ids).exclude(state__in=("exported", "failed")).exists(),
            what=f"{len(ids)} revisions of {name} exported",
            timeout=120 + 10 * (len(ids) - 1),
        )
        if failed := AdapterRevision.objects.filter(id__in=ids, state="failed").count():
            raise RuntimeError(f"{failed} of {name}'s revisions failed validation or export")
        revisions = list(AdapterRevision.objects.filter(id__in=ids).order_by("number"))
        for revision in revisions:
            services.revision_request_approval(revision=revision, by=Actor.system())
            revision.refresh_from_db()
        return adapter, revisions

    def activate(self, adapter, revision, *, reserve: bool = False) -> None:
        from serving import services
        from tenants.access import Actor

        services.revision_activate(adapter=adapter, revision=revision, by=Actor.system(), reserve=reserve)

    def wait_live(self, adapter, revision, timeout: float = 120) -> None:
        from serving.models import Alias

        self.wait(
            lambda: Alias.objects.filter(adapter=adapter, revision=revision).exists(),
            what=f"{adapter.name} live",
            timeout=timeout,
        )


def bench_tenant(slug: str = "bench"):
    """A tenant (four-eyes relaxed, no rate, pin or in-flight limit to speak of) and an all-scope key token."""
    from tenants import services
    from tenants.access import Actor
    from tenants.management.lookups import get_or_create_user
    from tenants.models import Tenant

    owner, _ = get_or_create_user(f"{slug}-owner")
    tenant = services.tenant_create(slug=slug, owner=owner, by=Actor.system())
    Tenant.objects.filter(id=tenant.id).update(
        four_eyes=False,
        rate_limit_rpm=1_000_000,
        max_adapters=10_000,
        max_ready_revisions=10_000,
        max_inflight_requests=100_000,
    )
    tenant.refresh_from_db()
    _, token = services.api_key_create(
        tenant=tenant, name="bench", scopes=["inference", "pipeline", "deploy"], created_by=owner, by=Actor.system()
    )
    return tenant, token
