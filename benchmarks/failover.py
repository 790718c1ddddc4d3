"""Failover on the two-host layout (devtools/fleet.py): what a node kill and a drain cost callers, and how few
revisions move when a node joins.

Two vLLM CPU engines (one CPU each), each with its own node agent and cache, the web server and a control
worker, sharing only PostgreSQL, Redis and a real S3-protocol server (moto). Every setting is the default but
MINT_ALIAS_READY_REPLICAS=2: one adapter is replicated on both hosts and `--solo` adapters have one replica each
(the per-adapter override), so each host holds some of them.

Per repeat, for the host whose engine is killed (the hosts take turns):
- `failed_replicated`: non-streamed requests to the replicated adapter that did not get a 200 while the engine
  is killed, the node is taken out and the engine comes back (target 0);
- `recovered_s`: seconds from the kill until each single-replica live revision that was on that host is ready
  on the other one (nobody acting), and `down_s`: until the node was marked down;
- `restart_s`: from the engine's restart until the replicated revision is ready on both hosts again.
Then one drain of a host under traffic to every adapter: `failed` requests (target 0) and the drain's seconds.
Hashing: over 10,000 revision names, the fraction whose rendezvous home changes when a node joins N → N+1
equal nodes (target ≤ 1.25/(N+1)), for N = 1 … 7.

    python -m benchmarks.failover [--quick] [--out DIR] [--repeats K] [--solo N]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    bench_database_url,
    bench_env,
    parser,
    print_logs,
    recreate_database,
    setup_django,
    write_result,
)
from benchmarks.stack import bench_tenant
from devtools.supervisor import Supervisor

NAME = "failover"
REPLICATED = "replicated"
BUCKET = "mint-bench-failover"
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "mint-bench", "AWS_SECRET_ACCESS_KEY": "mint-bench-secret"}


def hashing(names: int) -> list[dict]:
    """Fraction of `names` revision homes that move when a node joins N equal nodes, for N = 1 … 7."""
    from types import SimpleNamespace

    from serving.services.rendezvous import preference

    lora_names = [f"t{i % 97}-a{i}-r1" for i in range(names)]
    rows = []
    for count in range(1, 8):
        nodes = [SimpleNamespace(name=f"node-{i}", cpu_slots=16) for i in range(count + 1)]
        before = [preference(name, nodes[:count])[0].name for name in lora_names]
        after = [preference(name, nodes)[0].name for name in lora_names]
        moved = sum(b != a for b, a in zip(before, after, strict=True)) / names
        rows.append({"nodes_before": count, "nodes_after": count + 1, "moved": round(moved, 4)})
        rows[-1]["target"] = round(1.25 / (count + 1), 4)
        rows[-1]["met"] = moved <= rows[-1]["target"]
    return rows


class Bench:
    """The fleet, its tenant and adapters, and the measurements."""

    def __init__(self, *, work: Path, solo: int):
        self.work, self.solo = work, solo
        self.db_url = bench_database_url("mint_bench_failover")
        self.supervisor = Supervisor(work / "log")
        self.env: dict[str, str] = {}

    def prepare(self) -> None:
        """The S3 server, the benchmark's own database and Redis database, and Django in this process."""
        import boto3

        from devtools.fleet import start_s3_server

        s3_url = start_s3_server(self.supervisor)
        boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1", **_boto(S3_CREDENTIALS)).create_bucket(
            Bucket=BUCKET
        )
        self.env = bench_env(
            self.work,
            db_url=self.db_url,
            redis_db=12,
            MINT_STORAGE="s3",
            MINT_S3_BUCKET=BUCKET,
            MINT_S3_ENDPOINT_URL=s3_url,
            MINT_S3_REGION="us-east-1",
            MINT_ALIAS_READY_REPLICAS="2",
            **S3_CREDENTIALS,
        )
        os.environ.update(S3_CREDENTIALS)  # this process writes uploads to the store too
        recreate_database(self.db_url)
        setup_django(self.env)

    def start(self) -> None:
        from adapters.base_models import base_model_upsert
        from devtools.fleet import Fleet
        from devtools.tiny import make_tiny_model
        from tenants.access import Actor

        model_dir = make_tiny_model("dense", self.work / "models" / "tiny-llama")
        self.fleet = Fleet(self.supervisor, work=self.work / "fleet", env=self.env, model_dir=model_dir)
        self.fleet.start_engines()
        self.base = base_model_upsert(name="tiny-llama", path=model_dir, max_lora_rank=16, by=Actor.system())
        self.fleet.register_nodes(self.base)
        self.fleet.start()
        self.tenant, self.token = bench_tenant("failover")
        self.revisions = {REPLICATED: self._approved(REPLICATED, seed=1, replicas=None)}
        for i in range(self.solo):
            self.revisions[f"solo-{i}"] = self._approved(f"solo-{i}", seed=10 + i, replicas=1)
        for name in self.fleet.hosts:
            self.fleet.wait_engine(name)
        from serving.models import NodeState, ServingNode

        self.wait(lambda: ServingNode.objects.filter(state=NodeState.UP).count() == 2, "both nodes up", 60)
        from serving import services as serving_services

        for revision in self.revisions.values():  # reserved: failover places them again by itself
            serving_services.revision_activate(
                adapter=revision.adapter, revision=revision, by=Actor.system(), reserve=True
            )
        for name, revision in self.revisions.items():
            self.wait(lambda r=revision: self.live(r), f"{name} live", 180)
        self.wait(lambda: len(self.ready_nodes(self.revisions[REPLICATED])) == 2, "two replicas", 120)

    def _approved(self, name: str, *, seed: int, replicas: int | None):
        from adapters import services, store
        from adapters.models import Adapter, AdapterRevision
        from devtools.tiny import make_tiny_lora
        from tenants.access import Actor

        adapter = services.adapter_create(
            tenant=self.tenant, name=name, base_model=self.base, description="", by=Actor.system()
        )
        if replicas is not None:
            Adapter.objects.filter(id=adapter.id).update(replicas=replicas)
            adapter.refresh_from_db()
        local = self.work / "uploads" / name
        make_tiny_lora(self.base.spec, local, rank=8, seed=seed)
        prefix = f"{store.incoming_prefix(self.tenant.id)}/{name}"
        store.upload_dir(local, prefix)
        revision = services.revision_register(adapter=adapter, by=Actor.system(), source_uri=f"{prefix}/")
        self.wait(
            lambda: AdapterRevision.objects.get(id=revision.id).state in ("exported", "failed"), f"{name} exported", 180
        )
        revision.refresh_from_db()
        if revision.state != "exported":
            raise RuntimeError(f"{name}: {revision.failure_reason}")
        services.revision_request_approval(revision=revision, by=Actor.system())
        return services.revision_approve(revision=revision, by=Actor.system())

    @staticmethod
    def wait(predicate, what: str, timeout: float) -> None:
        from devtools.fleet import wait

        wait(predicate, timeout=timeout, what=what, interval=0.1)

    @staticmethod
    def live(revision) -> bool:
        from serving.models import Alias

        return Alias.objects.filter(adapter_id=revision.adapter_id, revision=revision).exists()

    @staticmethod
    def ready_nodes(revision) -> set[str]:
        from serving.models import NodeState, Placement, PlacementState

        return set(
            Placement.objects.filter(
                revision=revision, state=PlacementState.READY, node__state=NodeState.UP
            ).values_list("node__name", flat=True)
        )

    def traffic(self, model: str):
        from devtools.fleet import Traffic

        return Traffic(self.fleet.web_url, self.token, model, pause_s=0.02)

    def kill(self, host: str) -> dict:
        """Kill `host`'s engine under traffic to the replicated adapter; wait for recovery, restart, reconcile."""
        from serving.models import NodeState, ServingNode

        other = next(name for name in self.fleet.hosts if name != host)
        there = [name for name, r in self.revisions.items() if name != REPLICATED and self.ready_nodes(r) == {host}]
        with self.traffic(REPLICATED) as steady:
            self.wait(lambda: len(steady.outcomes) >= 20, "traffic", 60)
            killed = time.monotonic()
            self.fleet.kill_engine(host)
            recovered: dict[str, float] = {}
            down_s = None
            deadline = killed + 300
            while (len(recovered) < len(there) or down_s is None) and time.monotonic() < deadline:
                now = time.monotonic()
                if down_s is None and ServingNode.objects.get(name=host).state == NodeState.DOWN:
                    down_s = now - killed
                for name in there:
                    if name not in recovered and other in self.ready_nodes(self.revisions[name]):
                        recovered[name] = now - killed
                time.sleep(0.1)
            restarted = time.monotonic()
            self.fleet.start_engine(host)
            self.fleet.wait_engine(host)
            self.wait(lambda: len(self.ready_nodes(self.revisions[REPLICATED])) == 2, "second replica again", 300)
            back = time.monotonic()
            time.sleep(1)
        during = steady.between(killed, back)
        return {
            "host": host,
            "single_replica_revisions_there": len(there),
            "recovered_s": sorted(round(s, 2) for s in recovered.values()),
            "not_recovered": sorted(set(there) - set(recovered)),
            "down_s": round(down_s, 2) if down_s is not None else None,
            "restart_s": round(back - restarted, 2),
            "requests_replicated": len(during),
            "failed_replicated": len(steady.failures(killed, back)),
            "failed_by_status": _by_status(steady.failures(killed, back)),
        }

    def drain(self, host: str) -> dict:
        """Drain `host` under traffic to every adapter; count what failed, time the drain."""
        from serving import services as serving_services
        from serving.models import Placement, ServingNode
        from tenants.access import Actor

        clients = [self.traffic(name) for name in self.revisions]
        for client in clients:
            client.__enter__()
        try:
            self.wait(lambda: all(len(c.outcomes) >= 5 for c in clients), "traffic", 60)
            started = time.monotonic()
            serving_services.node_drain(node=ServingNode.objects.get(name=host), by=Actor.system())
            self.wait(lambda: not Placement.objects.filter(node__name=host).exists(), f"{host} drained", 600)
            ended = time.monotonic()
            time.sleep(1)
        finally:
            for client in clients:
                client.stop()
        failures = [o for c in clients for o in c.failures(started, ended + 1)]
        # `mint_node undrain`: the node serves again.
        serving_services.node_set_state(node=ServingNode.objects.get(name=host), state="up", by=Actor.system())
        return {
            "host": host,
            "drain_s": round(ended - started, 2),
            "requests": sum(len(c.between(started, ended + 1)) for c in clients),
            "failed": len(failures),
            "failed_by_status": _by_status(failures),
        }

    def stop(self, failed: bool) -> None:
        if failed:
            print_logs(self.supervisor, "web", "control", *(f"agent-{h}" for h in ("host-a", "host-b")))
        self.supervisor.stop_all()


def _boto(credentials: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": credentials["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": credentials["AWS_SECRET_ACCESS_KEY"],
    }


def _by_status(outcomes) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        key = f"{outcome.status} {outcome.code}".strip()
        counts[key] = counts.get(key, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=None, help="node kills (default 4; --quick 1)")
    p.add_argument("--solo", type=int, default=None, help="single-replica adapters (default 4; --quick 2)")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 4)
    solo = args.solo or (2 if args.quick else 4)
    work = Path(tempfile.mkdtemp(prefix="mint-bench-failover-"))
    bench = Bench(work=work, solo=solo)
    failed = True
    try:
        bench.prepare()
        figures: dict = {"hashing": hashing(2_000 if args.quick else 10_000)}
        bench.start()
        hosts = list(bench.fleet.hosts)
        kills = [bench.kill(hosts[i % len(hosts)]) for i in range(repeats)]
        drain = bench.drain(hosts[0])
        failed = False
    finally:
        bench.stop(failed)
        shutil.rmtree(work, ignore_errors=True)
    recovered = [s for k in kills for s in k["recovered_s"]]
    figures |= {
        "kills": kills,
        "drain": drain,
        "failed_replicated_total": sum(k["failed_replicated"] for k in kills),
        "requests_replicated_total": sum(k["requests_replicated"] for k in kills),
        "recovered_s_median": round(statistics.median(recovered), 2) if recovered else None,
        "recovered_s_max": max(recovered) if recovered else None,
        "not_recovered_total": sum(len(k["not_recovered"]) for k in kills),
        "drain_failed": drain["failed"],
        "hash_moved_max_ratio_to_target": max(r["moved"] / r["target"] for r in figures["hashing"]),
        "layout": {
            "hosts": 2,
            "engine_cpus": "one each",
            "replicated_adapter_replicas": 2,
            "single_replica_adapters": solo,
            "store": "S3 (moto server)",
            "settings": "defaults, MINT_ALIAS_READY_REPLICAS=2",
        },
        "target": {"failed_replicated_total": 0, "drain_failed": 0, "hash_moved": "≤ 1.25/N"},
    }
    path = write_result(NAME, figures, quick=args.quick, out_dir=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
