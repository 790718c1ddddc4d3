"""The handoff benchmark's baselines and projections (benchmarks/handoff.py runs them after its MinT stack is gone).

- Merged reload (the MinT paper's comparison): the step's LoRA merged into the base weights (peft
  `merge_and_unload`), saved as a full model, and served by a new vLLM engine: from the merge to the first
  streamed token.
- In-place update: vLLM's own weight reload into a running engine (`reload_weights` from a directory, through
  `/collective_rpc` with VLLM_SERVER_DEV_MODE=1), the weights written first: from the merge to the first token. RL
  frameworks reach about 0.18 s at 0.6B on GPU with NCCL/CUDA-IPC transfers; vLLM CPU 0.32 has none of those
  (its weight-transfer backends are NCCL and CUDA IPC), so the disk reload is what CPU offers.
- Byte costs, measured on this machine on 64 MiB: SHA-256, a file copy, a safetensors load; the handoff's and
  the full-weight paths' seconds at bigger shapes are projected from them (`project`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from devtools.local_node import engine_dtype, vllm_env
from devtools.supervisor import free_port

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
BF16 = 2  # bytes per parameter

# The shapes projected (parameters from the models' configs; LoRA as the table says).
SHAPES = {
    "qwen3-4b": {"hidden": 2560, "layers": 36, "q": 4096, "kv": 1024, "mlp": 9728, "vocab": 151936, "tied": True},
    "qwen3-30b-a3b": {
        "hidden": 2048,
        "layers": 48,
        "q": 4096,
        "kv": 512,
        "experts": 128,
        "expert_mlp": 768,
        "vocab": 151936,
        "tied": False,
    },
}
LORA_RANK, EXPERT_LORA_RANK = 16, 1  # dense: rank 16 on q,k,v,o,gate,up,down; MoE experts: rank 1 (the paper's)


def shape_bytes(shape: dict) -> tuple[int, int]:
    """(LoRA bytes, full-weight bytes) of a shape in bfloat16."""
    h, q, kv, r = shape["hidden"], shape["q"], shape["kv"], LORA_RANK
    attention = h * q * 2 + h * kv * 2
    attention_lora = r * ((h + q) * 2 + (h + kv) * 2)
    if "experts" in shape:
        e, m = shape["experts"], shape["expert_mlp"]
        mlp, mlp_lora = e * 3 * h * m + h * e, e * 3 * EXPERT_LORA_RANK * (h + m)
    else:
        m = shape["mlp"]
        mlp, mlp_lora = 3 * h * m, 3 * r * (h + m)
    embeddings = shape["vocab"] * h * (1 if shape["tied"] else 2)
    full = embeddings + shape["layers"] * (attention + mlp)
    lora = shape["layers"] * (attention_lora + mlp_lora)
    return lora * BF16, full * BF16


def byte_costs(work: Path, size: int = 64 * 1024 * 1024) -> dict[str, float]:
    """Seconds per byte of the byte-proportional work a handoff does, measured here (median of 3)."""
    import torch
    from safetensors.torch import load, save_file

    work.mkdir(parents=True, exist_ok=True)
    src = work / "blob.safetensors"
    save_file({"w": torch.zeros(size // BF16, dtype=torch.bfloat16)}, str(src))

    def timed(fn) -> float:
        runs = []
        for _ in range(3):
            started = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - started)
        return sorted(runs)[1] / size

    def sha() -> None:
        with open(src, "rb") as f:
            digest = hashlib.sha256()
            while chunk := f.read(1 << 20):
                digest.update(chunk)

    def copy() -> None:
        shutil.copyfile(src, work / "copy.safetensors")
        os.sync()

    costs = {
        "sha256_s_per_byte": timed(sha),
        "copy_s_per_byte": timed(copy),
        # Read and deserialize every byte (load_file maps the file and reads nothing until a tensor is used).
        "load_s_per_byte": timed(lambda: load(src.read_bytes())),
    }
    shutil.rmtree(work, ignore_errors=True)
    return costs


def project(
    *,
    costs: dict,
    handoff_p50_s: float,
    merged_p50_s: float | None,
    inplace_p50_s: float | None,
    tiny_lora: int,
    tiny_full: int,
    tiny_model: str,
) -> dict:
    """Per shape: its bytes, and the seconds the handoff and a merged reload would take at the measured costs.

    A handoff moves the LoRA through one upload, three SHA-256 passes (registration, validation, the node's check)
    and three copies (into the store, the export, the node's cache), then one load; a merged reload writes the
    full weights once and loads them once, and so does an in-place reload. What does not scale with bytes is the
    measured time minus the tiny
    model's bytes at these costs. GPU-side costs (moving weights to device memory, CUDA graphs) are not modelled.
    """
    c_lora = 3 * costs["sha256_s_per_byte"] + 4 * costs["copy_s_per_byte"] + costs["load_s_per_byte"]
    c_full = costs["copy_s_per_byte"] + costs["load_s_per_byte"]
    fixed_handoff = max(0.0, handoff_p50_s - tiny_lora * c_lora)
    fixed_merged = None if merged_p50_s is None else max(0.0, merged_p50_s - tiny_full * c_full)
    fixed_inplace = None if inplace_p50_s is None else max(0.0, inplace_p50_s - tiny_full * c_full)
    shapes = {tiny_model: (tiny_lora, tiny_full)} | {name: shape_bytes(s) for name, s in SHAPES.items()}
    return {
        name: {
            "lora_bytes": lora,
            "full_bytes": full,
            "handoff_s": round(fixed_handoff + lora * c_lora, 3),
            "merged_reload_s": None if fixed_merged is None else round(fixed_merged + full * c_full, 3),
            "inplace_update_s": None if fixed_inplace is None else round(fixed_inplace + full * c_full, 3),
        }
        for name, (lora, full) in shapes.items()
    }


# ---------------------------------------------------------------- engines without LoRA


def merge(model_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """The base with the adapter merged in, saved as a full model (what a trainer without LoRA serving ships)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    return out


def _start(model_dir: Path, port: int, cpus: set[int] | None, *, dev: bool = False) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "policy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--dtype",
        engine_dtype(),
    ]
    env = vllm_env() | ({"VLLM_SERVER_DEV_MODE": "1"} if dev else {})
    if cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cpus)))
        argv = ["taskset", "-c", ",".join(map(str, sorted(cpus))), *argv]
    log = tempfile.NamedTemporaryFile("w", prefix="handoff-vllm-", suffix=".log", delete=False)  # noqa: SIM115
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(engine: subprocess.Popen) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(engine.pid, signal.SIGKILL)
    engine.wait()


def first_token(url: str, prompt: str = "Hello", timeout: float = 600) -> float:
    """Wait for the engine to answer, then stream one completion: the moment its first token arrived."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not start")
        time.sleep(0.05)
    body = {"model": "policy", "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return time.perf_counter()
    raise RuntimeError("the engine streamed no token")


def merged_reload(model_dir: Path, adapters: list[Path], work: Path, cpus: set[int] | None) -> list[dict]:
    """Per adapter: merge + save, then a new engine on the merged weights until its first token."""
    found = []
    for i, adapter in enumerate(adapters):
        started = time.perf_counter()
        merged = merge(model_dir, adapter, work / f"merged-{i}")
        written = time.perf_counter()
        port = free_port()
        engine = _start(merged, port, cpus)
        try:
            token = first_token(f"http://127.0.0.1:{port}")
        finally:
            _stop(engine)
        found.append({"merge_s": round(written - started, 3), "to_first_token_s": round(token - started, 3)})
        shutil.rmtree(merged, ignore_errors=True)
    return found


def inplace_update(model_dir: Path, adapters: list[Path], work: Path, cpus: set[int] | None) -> tuple[list[dict], str]:
    """Per adapter: merge + save, then vLLM's reload_weights into one running engine, until the first token.
    Returns the runs and, when the engine cannot do it, why (its error)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = _start(model_dir, port, cpus, dev=True)
    found: list[dict] = []
    try:
        first_token(url)
        for i, adapter in enumerate(adapters):
            started = time.perf_counter()
            merged = merge(model_dir, adapter, work / f"inplace-{i}")
            written = time.perf_counter()
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(merged)}, "timeout": 300}
            answer = httpx.post(f"{url}/collective_rpc", json=rpc, timeout=320)
            if answer.status_code != 200:
                return found, f"POST /collective_rpc reload_weights: {answer.status_code} {answer.text[:300]}"
            reloaded = time.perf_counter()
            token = first_token(url)
            found.append(
                {
                    "merge_s": round(written - started, 3),
                    "reload_s": round(reloaded - written, 3),
                    "to_first_token_s": round(token - started, 3),
                }
            )
    except (httpx.HTTPError, RuntimeError, TimeoutError) as exc:
        return found, f"{type(exc).__name__}: {exc}"
    finally:
        _stop(engine)
    return found, ""
