"""MinT's production layout played on one machine: serving hosts, a web host, shared services.

Each serving *host* is a vLLM CPU engine confined to CPUs of its own (they stand for the host's
accelerator) with its node agent beside it: a Celery worker on `node.<host>` only, whose node cache and
`MINT_VAR_DIR` are the host's own directories. The *web host* runs the control worker (queue `control`, with
beat), the worker of webhook deliveries (queue `webhooks`) and the web server with the gateway. They share
nothing but what real hosts share: PostgreSQL, Redis and the artifact store, which must be S3 here (no host can
read another's disk). tests/e2e/test_fleet.py and benchmarks/failover.py use it; docs/operations.md "Several hosts"
describes the layout it plays.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from devtools.launcher import web_argv, web_env, webhook_worker_argv, worker_argv
from devtools.local_node import STARTUP_TIMEOUT_S, start_engine
from devtools.supervisor import Supervisor, free_port, http_ok, wait_for

# What every test and benchmark of the fleet runs: the shape of the session engine of tests/e2e.
MAX_LORAS, MAX_CPU_LORAS, MAX_LORA_RANK = 4, 8, 16
SERVED_NAME = "tiny-llama"


@dataclass(frozen=True)
class Host:
    """One serving host: its engine's port and CPUs, and its own disk."""

    name: str
    port: int
    cpus: frozenset[int] | None
    root: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cache_dir(self) -> Path:
        return self.root / "node-cache"

    @property
    def engine(self) -> str:
        return f"vllm-{self.name}"

    @property
    def agent(self) -> str:
        return f"agent-{self.name}"


def engine_cpus(count: int) -> list[frozenset[int] | None]:
    """One CPU per engine, in turn over the CPUs this process may use (None on a one-CPU machine)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return [None] * count
    return [frozenset({cpus[i % len(cpus)]}) for i in range(count)]


class Fleet:
    """Serving hosts and a web host as processes of this machine, under `supervisor`.

    `env` is the environment every process shares (DATABASE_URL, REDIS_URL, the S3 store's MINT_STORAGE=s3
    settings and credentials, MINT_* settings); each process adds what is its own host's.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        *,
        work: Path,
        env: dict[str, str],
        model_dir: Path,
        hosts: tuple[str, ...] = ("host-a", "host-b"),
    ) -> None:
        if env.get("MINT_STORAGE") != "s3":
            raise ValueError("a fleet shares its artifacts through S3: set MINT_STORAGE=s3 and the MINT_S3_* settings")
        self.supervisor = supervisor
        self.work = work
        self.env = env
        self.model_dir = model_dir
        self.hosts = {
            name: Host(name=name, port=free_port(), cpus=cpus, root=work / name)
            for name, cpus in zip(hosts, engine_cpus(len(hosts)), strict=True)
        }
        self.web_url = ""

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def host_env(self, root: Path) -> dict[str, str]:
        """The shared environment, with this host's own var/ and scratch directories."""
        (root / "var").mkdir(parents=True, exist_ok=True)
        (root / "work").mkdir(parents=True, exist_ok=True)
        return self.env | {"MINT_VAR_DIR": str(root / "var"), "MINT_WORK_DIR": str(root / "work")}

    # ------------------------------------------------------------------ engines

    def start_engine(self, name: str) -> None:
        host = self.hosts[name]
        start_engine(
            self.supervisor,
            host.engine,
            model_dir=self.model_dir,
            port=host.port,
            served_name=SERVED_NAME,
            max_loras=MAX_LORAS,
            max_cpu_loras=MAX_CPU_LORAS,
            max_lora_rank=MAX_LORA_RANK,
            cpus=set(host.cpus) if host.cpus else None,
        )

    def start_engines(self) -> None:
        """Start every host's engine at once (each takes 30-50 s to come up)."""
        for name in self.hosts:
            self.start_engine(name)

    def wait_engine(self, name: str, *, timeout: float = STARTUP_TIMEOUT_S) -> None:
        url = self.hosts[name].url
        wait_for(lambda: http_ok(f"{url}/health"), timeout=timeout, what=f"vLLM of {name}")

    def kill_engine(self, name: str) -> None:
        """`kill -9` a host's engine and everything it started, as a crashed machine would go."""
        engine = self.hosts[name].engine
        for child_name, process in list(self.supervisor.children):
            if child_name == engine:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                self.supervisor.children.remove((child_name, process))

    def served(self, name: str) -> float:
        """How many requests a host's engine finished, by its own count (vLLM's Prometheus metrics)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.hosts[name].url}/metrics", timeout=5) as response:  # noqa: S310
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "vllm:request_success_total"
        )

    # ------------------------------------------------------------------ the control plane's processes

    def register_nodes(self, base_model) -> dict[str, object]:
        """Register every host as a serving node of `base_model` (Django must be set up in this process)."""
        from serving import services
        from tenants.access import Actor

        return {
            name: services.node_register(
                name=name,
                base_model=base_model,
                url=host.url,
                served_model_name=SERVED_NAME,
                gpu_slots=MAX_LORAS,
                cpu_slots=MAX_CPU_LORAS,
                max_lora_rank=MAX_LORA_RANK,
                cache_dir=str(host.cache_dir),
                by=Actor.system(),
            )
            for name, host in self.hosts.items()
        }

    def start_agent(self, name: str) -> subprocess.Popen:
        """A host's node agent: a Celery worker on that host's queue only, with the host's own disk."""
        host = self.hosts[name]
        argv = worker_argv(
            f"node.{name}",
            concurrency=1,
            extra=("--pool", "solo", "-n", f"{host.agent}@%h", "--without-mingle", "--without-gossip"),
        )
        return self.supervisor.start(host.agent, argv, env=self.host_env(host.root))

    def start_control(self) -> subprocess.Popen:
        """The web host's control worker (validation, export, reconcile) with the beat scheduler."""
        root = self.work / "web-host"
        argv = worker_argv(
            "control",
            concurrency=1,
            beat_schedule=root / "beat-schedule",
            extra=("--pool", "solo", "-n", "control@%h", "--without-mingle", "--without-gossip"),
        )
        return self.supervisor.start("control", argv, env=self.host_env(root))

    def start_webhooks(self) -> subprocess.Popen:
        """The web host's worker of webhook deliveries (queue `webhooks`), apart from the control worker."""
        root = self.work / "web-host"
        return self.supervisor.start("webhooks", webhook_worker_argv(threads=2), env=self.host_env(root))

    def start_web(self, *, processes: int = 2, timeout: float = 60) -> str:
        """The web host's ASGI server (API, dashboard, gateway), in `processes` processes on one port, as in
        production. Returns its base URL."""
        port = free_port()
        root = self.work / "web-host"
        env = web_env(self.host_env(root), processes=processes, metrics_dir=root / "var" / "prometheus")
        self.supervisor.start("web", web_argv("127.0.0.1", port, processes=processes), env=env)
        self.web_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_ok(f"{self.web_url}/healthz"), timeout=timeout, what="the web server")
        return self.web_url

    def start(self) -> None:
        """Every host's agent, the control worker and the web server (engines are started apart: they are slow)."""
        for name in self.hosts:
            self.start_agent(name)
        self.start_control()
        self.start_webhooks()
        self.start_web()

    def log(self, name: str, tail: int = 4000) -> str:
        path = self.supervisor.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def logs(self) -> str:
        hosts = self.hosts.values()
        names = ["control", "webhooks", "web", *(h.agent for h in hosts), *(h.engine for h in hosts)]
        return "\n".join(f"--- {name}\n{self.log(name)}" for name in names)


def start_s3_server(supervisor: Supervisor, *, timeout: float = 60) -> str:
    """moto's standalone S3 server on a free local port (the `dev` extra), for a fleet outside the test suite."""
    import httpx

    port = free_port()
    supervisor.start("s3", [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)])
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        return httpx.get(f"{url}/moto-api/", timeout=1).status_code < 500

    wait_for(answers, timeout=timeout, what="the S3 server (moto)")
    return url


def wait(predicate, *, timeout: float, what: str, interval: float = 0.25):
    """Poll `predicate` until it returns something true (returned), or raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


@dataclass(frozen=True)
class Outcome:
    """One request a `Traffic` client sent: when it ended, its HTTP status (0: no answer), its error code."""

    at: float
    status: int
    code: str = ""
    seconds: float = 0.0


class Traffic:
    """A steady client: one thread sending non-streamed completions for `model` back to back through the
    official openai client (no retries of its own), recording every outcome, until `stop()`."""

    def __init__(self, base_url: str, token: str, model: str, *, pause_s: float = 0.05, max_tokens: int = 4) -> None:
        import threading

        import openai

        self.model = model
        self.outcomes: list[Outcome] = []
        self._client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0, timeout=60)
        self._pause_s, self._max_tokens = pause_s, max_tokens
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"traffic {model}", daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=90)

    def _run(self) -> None:
        import openai

        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._client.completions.create(
                    model=self.model, prompt="the quick brown fox", max_tokens=self._max_tokens, temperature=0
                )
                outcome = Outcome(time.monotonic(), 200, seconds=time.monotonic() - started)
            except openai.APIStatusError as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                outcome = Outcome(time.monotonic(), exc.status_code, str(body.get("code", "")))
            except openai.APIError as exc:  # no answer at all (connection refused, timed out)
                outcome = Outcome(time.monotonic(), 0, type(exc).__name__)
            self.outcomes.append(outcome)
            self._stop.wait(self._pause_s)

    def between(self, start: float, end: float = float("inf")) -> list[Outcome]:
        return [o for o in list(self.outcomes) if start <= o.at <= end]

    def failures(self, start: float = 0.0, end: float = float("inf")) -> list[Outcome]:
        return [o for o in self.between(start, end) if o.status != 200]

    def wait_ok(self, *, after: float, timeout: float) -> float:
        """Wait for a 200 that ended after `after`; return when it did."""
        found = wait(
            lambda: next((o.at for o in self.between(after) if o.status == 200), None), timeout=timeout, what=self.model
        )
        return float(found)
