"""MoE adapter packing at the MinT paper's shape: reading the tensors, and live loads into vLLM.

A generated Qwen3-MoE-architecture model with 48 layers and 128 experts (hidden 64,
moe_intermediate 2752, so each expert carries the real 8,448 rank-1 values; config and
tokenizer only, served with `--load-format dummy`) and a rank-1 adapter on gate/up/down of
every expert plus q/k/v/o: 37,248 tensors, bf16 like the base.

(a) read every tensor with safetensors: one file per tensor, the per-expert PEFT file, the
    packed export; and a raw read of the packed file's bytes (the physical limit);
(b) `POST /v1/load_lora_adapter` latency of per-expert vs packed on a real vLLM CPU server,
    once with a generic node's flags and once with flags sized to what the node serves; and on a
    rank-1 node with MinT's vLLM plugin, the expert-major export of the same untied adapter.
Targets: live load >= 10x faster than per-expert, read >= 55x.

    python -m benchmarks.packing [--quick] [--engine] [--repeats N]

`--quick` alone reads a tiny shape and never starts an engine; `--engine` adds (b).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adapters.artifacts.export import engine_layout, write_engine_layout
from adapters.artifacts.packing import (
    ENGINE_FLAGS,
    EXPERT_MAJOR,
    LOAD_REQUEST,
    node_max_lora_rank,
    read_description,
)
from adapters.artifacts.spec import BaseModelSpec
from adapters.artifacts.validate import ValidationLimits, validate_adapter_dir
from benchmarks.common import parser, summary_ms, write_result
from devtools.supervisor import Supervisor, free_port

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT = ("gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model.model.layers"


@dataclass(frozen=True)
class Shape:
    layers: int
    experts: int
    hidden: int = 64
    inter: int = 2752
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64

    def spec(self, max_lora_rank: int = 16) -> BaseModelSpec:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return BaseModelSpec(
            architecture="moe",
            num_layers=self.layers,
            module_shapes={"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv)}
            | {"o_proj": (q, self.hidden)},
            num_experts=self.experts,
            expert_module_shapes={
                "gate_proj": (self.hidden, self.inter),
                "up_proj": (self.hidden, self.inter),
                "down_proj": (self.inter, self.hidden),
            },
            max_lora_rank=max_lora_rank,
        )


PAPER = Shape(layers=48, experts=128)
QUICK = Shape(layers=2, experts=8, inter=128)


def make_model_dir(shape: Shape, dest: Path) -> Path:
    """config.json and tokenizer of a Qwen3-MoE of `shape`; no weights (served with --load-format dummy)."""
    from devtools.tiny import make_tiny_model

    tiny = make_tiny_model("moe", dest.parent / "tiny-qwen3-moe")
    dest.mkdir(parents=True, exist_ok=True)
    for path in tiny.iterdir():
        if not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy(path, dest / path.name)
    config = json.loads((tiny / "config.json").read_text())
    config |= {
        "hidden_size": shape.hidden,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": shape.layers,
        "num_experts": shape.experts,
        "num_local_experts": shape.experts,  # transformers 5 writes this name
        "num_experts_per_tok": 8 if shape.experts >= 8 else 2,
        "moe_intermediate_size": shape.inter,
        "intermediate_size": shape.inter,
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def adapter_tensors(
    shape: Shape, *, rank: int, dtype: torch.dtype, experts: bool = True, tied: bool = False, seed: int = 0
):
    """Random rank-`rank` LoRA weights on q/k/v/o and (with `experts`) gate/up/down of every expert.

    `tied`: each expert's up_proj lora_A equals its gate_proj lora_A (as when trained on a fused gate_up).
    """
    gen = torch.Generator().manual_seed(seed)
    spec = shape.spec()
    tensors: dict[str, torch.Tensor] = {}

    def pair(prefix: str, in_f: int, out_f: int) -> None:
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) * 0.02).to(dtype)
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * 0.02).to(dtype)

    for layer in range(shape.layers):
        for module in ATTENTION:
            pair(f"{PREFIX}.{layer}.self_attn.{module}", *spec.module_shapes[module])
        for expert in range(shape.experts if experts else 0):
            for module in EXPERT:
                pair(f"{PREFIX}.{layer}.mlp.experts.{expert}.{module}", *spec.expert_module_shapes[module])
            if tied:
                gate = f"{PREFIX}.{layer}.mlp.experts.{expert}.gate_proj.lora_A.weight"
                tensors[gate.replace("gate_proj", "up_proj")] = tensors[gate].clone()
    return tensors


def write_adapter(dest: Path, tensors: dict[str, torch.Tensor], *, rank: int, many_file: bool = False) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.split(".")[-3] for name in tensors})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    config |= {"lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if many_file:
        for i, name in enumerate(sorted(tensors)):
            save_file({name: tensors[name]}, str(dest / f"{i:06d}.safetensors"))
    else:
        save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dest


def read_all(files: list[Path]) -> int:
    """Read every tensor of `files` with safetensors, as vLLM's loader does; return the tensor count."""
    count = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                f.get_tensor(name)
                count += 1
    return count


def raw_reader(path: Path):
    """Read the file's bytes into one buffer allocated up front: the copy alone, no parsing, no page faults."""
    buffer = bytearray(path.stat().st_size)

    def read() -> int:
        with open(path, "rb", buffering=0) as f:
            return f.readinto(buffer)

    return read


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm the page cache: every variant is measured from memory, none from disk
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def measure_reads(adapters: dict[str, Path], repeats: int) -> dict:
    many = sorted(adapters["many_file"].glob("*.safetensors"))
    per_expert = adapters["per_expert"] / "adapter_model.safetensors"
    packed = adapters["packed"] / "adapter_model.safetensors"
    runs = {
        "many_file": timed(lambda: read_all(many), max(3, repeats // 3)),
        "per_expert": timed(lambda: read_all([per_expert]), repeats),
        "packed": timed(lambda: read_all([packed]), repeats),
        "packed_raw_bytes": timed(raw_reader(packed), repeats),
    }
    with safe_open(str(packed), framework="pt") as f:
        packed_count = len(list(f.keys()))
    result = {name: summary_ms(times) for name, times in runs.items()}
    base = result["per_expert"]["p50_ms"]
    for name in result:
        result[name]["speedup_vs_per_expert"] = round(base / result[name]["p50_ms"], 2)
    result["packed"]["vs_raw_read"] = round(result["packed"]["p50_ms"] / result["packed_raw_bytes"]["p50_ms"], 2)
    result["file_bytes"] = {"per_expert": per_expert.stat().st_size, "packed": packed.stat().st_size}
    result["tensor_counts"] = {"many_file": len(many), "per_expert": read_all([per_expert]), "packed": packed_count}
    return result


def live_loads(model_dir: Path, adapters: dict[str, Path], *, node: dict, repeats: int, work: Path) -> dict:
    """Start one vLLM CPU server with `node`'s flags, time loads of each adapter under fresh names, stop it."""
    from devtools.local_node import STARTUP_TIMEOUT_S, start_engine

    supervisor = Supervisor(work / f"log-{node['name']}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    start_engine(
        supervisor,
        "vllm",
        model_dir=model_dir,
        port=port,
        served_name="bench-moe",
        max_loras=node["max_loras"],
        max_cpu_loras=node["max_loras"] + 1,
        max_lora_rank=node["max_lora_rank"],
        extra=["--load-format", "dummy", *node.get("engine_flags", ENGINE_FLAGS)],
        dtype="bfloat16",  # the adapters' dtype; loads only, so the local node's float16 workaround is not needed
    )
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S * 2
            while True:
                if (dead := supervisor.dead_child()) is not None:
                    raise RuntimeError(f"vLLM exited ({dead}); see {supervisor.log_dir}")
                try:
                    if http.get("/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("vLLM did not start")
                time.sleep(1)
            startup_s = time.perf_counter() - started
            times: dict[str, list[float]] = {name: [] for name in adapters}
            # Round -1 is a warm-up (first touches of the slot buffers, lazy imports): not counted.
            for i in range(-1, repeats):  # interleaved, so drift hits every variant alike
                for name, (path, extra) in adapters.items():
                    lora = f"{name}-{i + 1}"
                    t0 = time.perf_counter()
                    response = http.post(
                        "/v1/load_lora_adapter", json={"lora_name": lora, "lora_path": str(path)} | extra
                    )
                    elapsed = time.perf_counter() - t0
                    if response.status_code != 200:
                        raise RuntimeError(f"load {lora}: {response.status_code} {response.text[:500]}")
                    if i >= 0:
                        times[name].append(elapsed)
                    http.post("/v1/unload_lora_adapter", json={"lora_name": lora})
    finally:
        supervisor.stop_all()
    result = {name: summary_ms(t) for name, t in times.items()}
    base = result["per_expert"]["p50_ms"]
    for name in result:
        result[name]["speedup_vs_per_expert"] = round(base / result[name]["p50_ms"], 2)
    return {"flags": node, "startup_s": round(startup_s, 1), "loads": result}


def engine_runs(shape: Shape, work: Path, adapters: dict[str, Path], *, rank: int, repeats: int) -> dict:
    """Live loads on four nodes, one at a time: generic flags, flags sized to the packed rank, rank 1 (tied
    adapter, 3-D PEFT), and rank 1 with MinT's plugin (the untied adapter, expert-major)."""
    spec, limits = shape.spec(), ValidationLimits(max_tensors=200_000)

    def packed(name: str, **kwargs) -> tuple[Path, int]:
        source = write_adapter(work / f"{name}-source", adapter_tensors(shape, rank=rank, **kwargs), rank=rank)
        checked = validate_adapter_dir(source, spec, limits)
        write_engine_layout(checked, work / name, spec=spec)
        return work / name, engine_layout(checked, spec).min_max_lora_rank

    attn = write_adapter(
        work / "attention-only", adapter_tensors(shape, rank=rank, dtype=torch.bfloat16, experts=False), rank=rank
    )
    f32, _ = packed("packed-f32", dtype=torch.float32, seed=1)
    tied, tied_rank = packed("packed-tied", dtype=torch.bfloat16, tied=True, seed=2)
    packed_rank = read_description(adapters["packed"] / "adapter_model.safetensors")["packed_rank"]
    common = {"attention_only": (attn, {}), "per_expert": (adapters["per_expert"], {})}
    nodes = [
        ({"name": "generic", "max_lora_rank": 16, "max_loras": 2}, {"packed": (adapters["packed"], LOAD_REQUEST)}),
        (
            {"name": "sized", "max_lora_rank": node_max_lora_rank(packed_rank), "max_loras": 1},
            {"packed": (adapters["packed"], LOAD_REQUEST), "packed_f32": (f32, LOAD_REQUEST)},
        ),
        (
            {"name": "rank1_tied", "max_lora_rank": node_max_lora_rank(tied_rank), "max_loras": 1},
            {"packed_tied": (tied, LOAD_REQUEST)},
        ),
        (
            # The plugin needs no vLLM flag; the node's rank is the adapter's own.
            {"name": "rank1_plugin", "max_lora_rank": node_max_lora_rank(rank), "max_loras": 1, "engine_flags": []},
            {"expert_major": (adapters["expert_major"], {})},
        ),
    ]
    model_dir = make_model_dir(shape, work / "model")
    runs = {}
    for node, variants in nodes:
        runs[node["name"]] = live_loads(model_dir, common | variants, node=node, repeats=repeats, work=work)
        print(node["name"], json.dumps(runs[node["name"]]["loads"], indent=1), flush=True)
    return runs


NODE_ORDER = ("generic", "sized", "rank1_tied", "rank1_plugin")


def plot(figures: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = figures.get("live_load", {})
    order = [k for k in NODE_ORDER if k in runs] + [k for k in runs if k not in NODE_ORDER]
    engines = {k: runs[k] for k in order}
    fig, axes = plt.subplots(1, 1 + len(engines), figsize=(5 * (1 + len(engines)), 4), squeeze=False)
    reads = figures["read"]
    names = ["many_file", "per_expert", "packed", "packed_raw_bytes"]
    ax = axes[0][0]
    ax.bar(names, [reads[n]["p50_ms"] for n in names], color=["#999", "#c44", "#4a4", "#48c"])
    ax.set_yscale("log")
    ax.set_ylabel("median ms (log)")
    ax.set_title(f"read all tensors ({figures['tensors']['per_expert']} vs {figures['tensors']['packed']})")
    for i, n in enumerate(names):
        ax.annotate(f"{reads[n]['p50_ms']:.1f}", (i, reads[n]["p50_ms"]), ha="center", va="bottom", fontsize=8)
    for ax, (label, run) in zip(axes[0][1:], engines.items(), strict=True):
        loads = run["loads"]
        ax.bar(list(loads), [loads[n]["p50_ms"] for n in loads], color="#c84")
        ax.set_ylabel("median ms")
        flags = run["flags"]
        ax.set_title(f"live load, {label} (rank<={flags['max_lora_rank']}, loras={flags['max_loras']})", fontsize=9)
        for i, n in enumerate(loads):
            ax.annotate(
                f"{loads[n]['p50_ms']:.0f}\n{loads[n]['speedup_vs_per_expert']}x",
                (i, loads[n]["p50_ms"]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--engine", action="store_true", help="also measure live loads on a real vLLM CPU server")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per variant")
    p.add_argument("--work", type=Path, default=None, help="keep generated files here (default: a temp dir)")
    args = p.parse_args()
    shape = QUICK if args.quick else PAPER
    repeats = args.repeats or (3 if args.quick else 9)
    rank = 1
    work = args.work or Path(tempfile.mkdtemp(prefix="mint-bench-packing-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tensors = adapter_tensors(shape, rank=rank, dtype=torch.bfloat16)
        adapters = {
            "per_expert": write_adapter(work / "per-expert", tensors, rank=rank),
            "many_file": write_adapter(work / "many-file", tensors, rank=rank, many_file=True),
        }
        tensor_count = len(tensors)
        del tensors
        limits = ValidationLimits(max_tensors=200_000)
        checked = validate_adapter_dir(adapters["many_file"], shape.spec(), limits)
        started = time.perf_counter()
        write_engine_layout(checked, work / "packed", spec=shape.spec())
        pack_s = time.perf_counter() - started
        adapters["packed"] = work / "packed"
        figures: dict = {
            "shape": shape.__dict__ | {"rank": rank, "dtype": "BF16"},
            "tensors": {"per_expert": tensor_count},
            "pack_s": round(pack_s, 2),
        }
        figures["read"] = measure_reads(adapters, repeats)
        write_engine_layout(checked, work / "expert-major", spec=shape.spec(), moe_layout=EXPERT_MAJOR)
        adapters["expert_major"] = work / "expert-major"
        figures["tensors"]["packed"] = figures["read"]["tensor_counts"]["packed"]
        print(json.dumps(figures["read"], indent=1), flush=True)

        if args.engine:
            loads = 2 if args.quick else max(3, repeats // 2)
            figures["live_load"] = engine_runs(shape, work, adapters, rank=rank, repeats=loads)
            runs = figures["live_load"]
            best = min(run["loads"][v]["p50_ms"] for run in runs.values() for v in run["loads"] if "packed" in v)
            figures["live_load_summary"] = {
                "per_expert_generic_ms": runs["generic"]["loads"]["per_expert"]["p50_ms"],
                "best_packed_ms": best,
                "best_packed_vs_generic_per_expert": round(runs["generic"]["loads"]["per_expert"]["p50_ms"] / best, 2),
                "packed_vs_per_expert_same_sized_node": runs["sized"]["loads"]["packed"]["speedup_vs_per_expert"],
                "tied_vs_per_expert_same_rank1_node": runs["rank1_tied"]["loads"]["packed_tied"][
                    "speedup_vs_per_expert"
                ],
            }
            plugin = runs["rank1_plugin"]["loads"]
            figures["live_load_summary"] |= {
                "expert_major_ms": plugin["expert_major"]["p50_ms"],
                "per_expert_plugin_node_ms": plugin["per_expert"]["p50_ms"],
                "expert_major_vs_per_expert_same_plugin_node": plugin["expert_major"]["speedup_vs_per_expert"],
                "expert_major_vs_generic_per_expert": round(
                    runs["generic"]["loads"]["per_expert"]["p50_ms"] / plugin["expert_major"]["p50_ms"], 2
                ),
            }
        figures["targets"] = {"read_speedup": 55, "live_load_speedup": 10}
        path = write_result("packing", figures, quick=args.quick, out_dir=args.out)
        png = plot(figures, args.out / "packing.png")
        print(f"wrote {path}" + (f" and {args.out / 'packing.png'}" if png else " (no matplotlib: no plot)"))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
