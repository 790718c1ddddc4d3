"""Fixtures for tests that run real processes: Celery workers, the `make run` launcher, vLLM."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from django.db import connection, connections

from devtools.launcher import web_argv, web_env, webhook_worker_argv, worker_argv
from devtools.supervisor import BASE_DIR, Supervisor, free_port, http_ok, wait_for
from tests.e2e import slowed_worker


def database_url_of_test_db() -> str:
    """The URL of the database this test session uses, for child processes to reach the same rows."""
    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def worker_main(env: dict[str, str]) -> str:
    """Celery's command line, or tests/e2e/slowed_worker.py's when the test asks for slowed work."""
    return "tests.e2e.slowed_worker" if any(env.get(name) for name in slowed_worker.DELAYS) else "celery"


@pytest.fixture
def supervisor(tmp_path: Path):
    sup = Supervisor(tmp_path / "log")
    yield sup
    sup.stop_all()


@pytest.fixture
def start_worker(supervisor, transactional_db):
    """Start a real Celery worker process on the given queues, against the test database."""

    def start(*queues: str, name: str = "worker", extra_env: dict[str, str] | None = None, beat: bool = False):
        env = os.environ | {"DATABASE_URL": database_url_of_test_db()} | (extra_env or {})
        argv = worker_argv(
            ",".join(queues),
            concurrency=1,
            beat_schedule=supervisor.log_dir / f"{name}-beat-schedule" if beat else None,
            extra=("--pool", "solo", "-n", f"{name}@%h", "--without-mingle", "--without-gossip"),
            main_module=worker_main(env),
        )
        return supervisor.start(name, argv, env=env)

    return start


@pytest.fixture
def start_control_worker(supervisor, transactional_db):
    """Start the control worker as `make run` does (prefork, two processes), against the test database."""

    def start(name: str = "worker", extra_env: dict[str, str] | None = None):
        env = os.environ | {"DATABASE_URL": database_url_of_test_db()} | (extra_env or {})
        argv = worker_argv(
            "control",
            concurrency=2,
            extra=("-n", f"{name}@%h", "--without-mingle", "--without-gossip"),
            main_module=worker_main(env),
        )
        return supervisor.start(name, argv, env=env)

    return start


@pytest.fixture
def start_webhook_worker(supervisor, transactional_db):
    """Start the worker of webhook deliveries (queue `webhooks`) as `make run` does, against the test database."""

    def start(name: str = "webhooks", extra_env: dict[str, str] | None = None, threads: int = 2):
        env = os.environ | {"DATABASE_URL": database_url_of_test_db()} | (extra_env or {})
        return supervisor.start(name, webhook_worker_argv(threads=threads, name=name), env=env)

    return start


def pool_processes(worker) -> list:
    """The pool processes of a prefork Celery worker (psutil.Process objects)."""
    import psutil

    return psutil.Process(worker.pid).children()


@pytest.fixture
def start_web(supervisor, transactional_db):
    """Start the real ASGI server (uvicorn) against the test database. Returns its base URL.

    `processes` > 1 serves it as `make run` does with MINT_WEB_PROCESSES: that many processes on one port, in
    prometheus_client's multiprocess mode (in `<log dir>/prometheus-<port>`, the `PROMETHEUS_MULTIPROC_DIR` of its
    environment).
    """

    def start(extra_env: dict[str, str] | None = None, *, processes: int = 1) -> str:
        port = free_port()
        env = os.environ | {"DATABASE_URL": database_url_of_test_db()} | (extra_env or {})
        env = web_env(env, processes=processes, metrics_dir=supervisor.log_dir / f"prometheus-{port}")
        supervisor.start("web", web_argv("127.0.0.1", port, processes=processes), env=env)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_ok(f"{base}/healthz"), timeout=60, what="web server")
        return base

    return start


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from devtools.tiny import make_tiny_model

    return make_tiny_model("dense", tmp_path_factory.mktemp("models") / "tiny-llama")


def make_peft_adapter(model_dir: Path, dest: Path, *, seed: int) -> Path:
    """A LoRA adapter made by the `peft` library for the tiny model, with random (non-zero) weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(dest)
    return dest


class Engine:
    """One real vLLM CPU server for the whole test session (it takes about a minute to start)."""

    served_name = "tiny-llama"
    max_loras, max_cpu_loras, max_lora_rank = 4, 8, 16

    def __init__(self, supervisor: Supervisor, model_dir: Path):
        self.supervisor = supervisor
        self.model_dir = model_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def extra_flags(self) -> list[str]:
        from serving.engine_flags import PRIORITY_SCHEDULING_FLAG

        return [PRIORITY_SCHEDULING_FLAG]  # as `make run`'s node: evaluations go below inference

    def start(self) -> None:
        from devtools.local_node import start_engine

        start_engine(
            self.supervisor,
            "vllm",
            model_dir=self.model_dir,
            port=self.port,
            served_name=self.served_name,
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
            max_lora_rank=self.max_lora_rank,
            extra=self.extra_flags(),
        )

    def wait_ready(self, timeout: float = 300) -> None:
        from devtools.local_node import STARTUP_TIMEOUT_S

        wait_for(lambda: http_ok(f"{self.url}/health"), timeout=max(timeout, STARTUP_TIMEOUT_S), what="vLLM")

    def kill(self) -> None:
        for name, process in list(self.supervisor.children):
            if name == "vllm":
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                self.supervisor.children.remove((name, process))

    def log(self) -> str:
        return log_of(self.supervisor, "vllm")[-5000:]


class MoeEngine(Engine):
    """A vLLM CPU server on the tiny Qwen3-MoE with the flags a node needs for packed MoE adapters.

    `--max-lora-rank 8` covers packed rank-4 adapters (gate and up keep their own rows: rank 8).
    Load only: a forward pass with a MoE LoRA fails on CPU.
    """

    served_name = "tiny-qwen3-moe"
    max_loras, max_cpu_loras, max_lora_rank = 1, 4, 8

    def extra_flags(self) -> list[str]:
        from adapters.artifacts.packing import ENGINE_FLAGS

        return list(ENGINE_FLAGS)


def _running(engine_class: type[Engine], log_dir: Path, model_dir: Path):
    """Start an engine, wait until it answers, and stop it when the session ends."""
    sup = Supervisor(log_dir)
    eng = engine_class(sup, model_dir)
    eng.start()
    try:
        eng.wait_ready()
    except TimeoutError:
        sup.stop_all()
        raise AssertionError(f"vLLM ({engine_class.served_name}) did not start:\n{eng.log()}") from None
    yield eng
    sup.stop_all()


@pytest.fixture(scope="session")
def engine(tmp_path_factory, tiny_llama_dir):
    yield from _running(Engine, tmp_path_factory.mktemp("engine") / "log", tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    from devtools.tiny import make_tiny_model

    return make_tiny_model("moe", tmp_path_factory.mktemp("models") / "tiny-qwen3-moe")


@pytest.fixture(scope="session")
def moe_engine(tmp_path_factory, tiny_moe_dir):
    yield from _running(MoeEngine, tmp_path_factory.mktemp("moe-engine") / "log", tiny_moe_dir)


@pytest.fixture
def make_fleet(tmp_path, supervisor, transactional_db, tiny_llama_dir, s3_store):
    """`make(env)`: two hosts on this machine (devtools/fleet.py), each a vLLM CPU engine and its node agent, the
    control worker and the web server, sharing PostgreSQL, Redis and a real S3-protocol server; `env` on top."""
    from adapters.base_models import base_model_upsert
    from devtools.fleet import Fleet
    from tenants.access import Actor
    from tests.s3 import CREDENTIALS, REGION

    def make(extra_env: dict[str, str]) -> Fleet:
        env = (
            os.environ
            | {
                "DATABASE_URL": database_url_of_test_db(),
                "MINT_STORAGE": "s3",
                "MINT_S3_BUCKET": s3_store.bucket,
                "MINT_S3_ENDPOINT_URL": s3_store.server.url,
                "MINT_S3_REGION": REGION,
                "AWS_ACCESS_KEY_ID": CREDENTIALS["access_key"],
                "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret_key"],
                "MINT_HEARTBEAT_S": "1",
                "MINT_NODE_PREWARM_DUTY": "1",  # no pacing: these tests are about where revisions go, not how fast
            }
            | extra_env
        )
        fleet = Fleet(supervisor, work=tmp_path / "fleet", env=env, model_dir=tiny_llama_dir)
        fleet.start_engines()  # 30-50 s: the rest is set up meanwhile
        fleet.base = base_model_upsert(name="tiny-llama", path=tiny_llama_dir, max_lora_rank=16, by=Actor.system())
        fleet.nodes = fleet.register_nodes(fleet.base)
        fleet.start()
        return fleet

    return make


@pytest.fixture
def make_serving_world(engine, tiny_llama_dir, tmp_path, start_worker, start_web, supervisor):
    """`make(tenant, env)`: a node on the session's vLLM, an adapter, a worker with beat and the web server."""
    from tests.e2e.world import serving_world

    def make(tenant, env: dict[str, str]):
        return serving_world(
            tenant=tenant,
            engine=engine,
            tiny_llama_dir=tiny_llama_dir,
            tmp_path=tmp_path,
            start_worker=start_worker,
            start_web=start_web,
            supervisor=supervisor,
            env=env,
        )

    return make


def platform_followers() -> int:
    """How many channels are in the platform group (each gateway process's event feed joins it)."""
    import redis
    from django.conf import settings

    from mint_site.events import PLATFORM_GROUP

    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        prefix = settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"]
        return client.zcard(f"{prefix}:group:{PLATFORM_GROUP}")
    finally:
        client.close()


def log_of(supervisor: Supervisor, name: str) -> str:
    path = supervisor.log_dir / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


__all__ = ["BASE_DIR", "log_of"]


# Debian's Chromium: the browser tests never download one.
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture
def launch_browser(monkeypatch):
    """Starts Chromium when called, after the set-up (whose ORM calls must not run in a thread with a running
    event loop: Playwright's sync API keeps one in the thread that starts it)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    started = []

    def launch():
        # Playwright's sync API runs an event loop in this thread; the ORM reads after this are plain blocking ones.
        monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        manager = sync_playwright()
        playwright = manager.start()
        started.append(manager)
        return playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-background-networking"],
        )

    yield launch
    # Django's connections are context-local while Playwright's loop runs: close the ones opened meanwhile,
    # or the test database cannot be dropped at the end of the session.
    connections.close_all()
    for manager in started:
        manager.__exit__(None, None, None)
