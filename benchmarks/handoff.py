"""Handoff: from a trainer's new LoRA to its first sampled token, in an RL-shaped loop, against the paper's baselines.

On the serving stack (benchmarks/stack.py: vLLM CPU on the tiny Llama with --max-loras 8, the web server with the
gateway, the control worker, the node agent), four-eyes on and nobody approving anything:

- The loop (`steps`, at least 20): each step changes the LoRA of a peft model of the tiny Llama and writes it with
  `save_pretrained` (as a trainer does), pushes it through the SDK (`Client.push(..., ready_to_sample=True)`: the
  registration asks for `prewarm`, so it is placed as soon as it is exported, and the call returns once a
  one-token sample answers), then samples 8 completions from it (`Client.sample`). `handoff_*`: from the push's
  first byte to that first sampled token. `stages_p50_s`: where the time goes (registration, validation, export,
  the placement's queue, load and warm-up), read from the rows' timestamps.
- Multi-policy (`multi_policy_throughput_ratio`): 8 of those policies each run one rollout round (8 prompts, n 4,
  `ignore_eos`-free sampling of `MAX_TOKENS` tokens), all rounds at once on the one node versus the same rounds one
  after another (each round's requests concurrent, as an RL loop sends them): sampled tokens per second, the
  median of REPEATS alternating pairs. The paper's multi-policy GRPO gain is 1.77x.
- Baselines (benchmarks/handoff_baselines.py), after the stack is stopped, on the node's CPUs: the same steps'
  LoRAs merged and served by a new engine (`merged_reload_p50_s`), and merged and reloaded in place by a running
  engine (`inplace_update_p50_s`, null with the reason where the engine cannot).
- Bytes (`projected`): LoRA and full weights at the tiny Llama's, Qwen3-4B's and Qwen3-30B-A3B's shapes, and the
  seconds each path would take at the byte costs measured here.

    python -m benchmarks.handoff [--quick] [--out DIR] [--steps N] [--baselines K]

MINT_BENCH_REDIS_DB picks the Redis database of the stack (default 13).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import handoff_baselines as baselines
from benchmarks.common import parser, percentile, write_result
from benchmarks.report.plots import plot_result
from benchmarks.stack import Stack

ADAPTER = "policy"
PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(8)]
MAX_TOKENS = 16
POLICIES, ROUND_N = 8, 4
REPEATS = 3
TARGET_HANDOFF_P50_S = 1.0
PAPER_SPEEDUP, PAPER_MULTI_POLICY = 18.3, 1.77


class Trainer:
    """A peft LoRA of the tiny Llama whose weights move a little each step, written with `save_pretrained`."""

    def __init__(self, model_dir: Path, out: Path, seed: int = 0):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
        self.model, self.out = get_peft_model(base, config), out

    def step(self, number: int) -> Path:
        import torch

        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if "lora_" in name:
                    parameter.add_(torch.randn_like(parameter) * 0.01)
        path = self.out / f"step-{number}"
        self.model.save_pretrained(path)
        return path


def stages(revision_ids: list[int]) -> dict[str, float]:
    """p50 seconds of each stage of the handoff, from the revisions' and their placements' timestamps."""
    from adapters.models import AdapterRevision
    from serving.models import Placement

    spans: dict[str, list[float]] = {}
    for revision in AdapterRevision.objects.filter(id__in=revision_ids):
        placement = Placement.objects.filter(revision=revision).order_by("id").first()
        marks = [
            ("validate", revision.created_at, revision.validated_at),
            ("export", revision.validated_at, revision.exported_at),
        ]
        if placement is not None:
            marks += [
                ("place", revision.exported_at, placement.started_at),
                ("load", placement.started_at, placement.loaded_at),
                ("warm", placement.loaded_at, placement.ready_at),
            ]
        for name, start, end in marks:
            if start is not None and end is not None:
                spans.setdefault(name, []).append((end - start).total_seconds())
    return {name: round(percentile(values, 50), 3) for name, values in spans.items()}


def client_stages(loop: list[dict]) -> dict[str, float]:
    """p50 seconds of the client's side: the registration request, and from the placement's ready to the token."""
    found = {}
    for key in ("register_s", "ready_to_token_s"):
        values = [r[key] for r in loop if r.get(key) is not None]
        if values:
            found[key.removesuffix("_s")] = round(percentile(values, 50), 3)
    return found


def ideas(breakdown: dict[str, float], handoff_p50: float, unflagged: list[float]) -> dict:
    """What each idea for a faster handoff is worth here: the prewarm flag measured (steps registered without it),
    the others bounded by the stage they would remove (p50 seconds)."""
    return {
        "prewarm_flag": {
            "with_p50_s": round(handoff_p50, 3),
            "without_p50_s": round(percentile(unflagged, 50), 3),
            "without": unflagged,
        },
        "first_sample_as_warmup_saves_up_to_s": breakdown.get("warm"),
        "validation_while_uploading_saves_up_to_s": breakdown.get("validate"),
        "no_export_for_dense_saves_up_to_s": breakdown.get("export"),
        "prefetch_to_parents_node": "one node here: every step already lands where its parent was served",
    }


def multi_policy(client, revisions: list[int]) -> dict:
    """Tokens per second of one rollout round per policy: all rounds at once ÷ one round after another."""

    def round_of(number: int) -> int:
        samples = client.sample(ADAPTER, number, PROMPTS, n=ROUND_N, max_tokens=MAX_TOKENS, concurrency=len(PROMPTS))
        return sum(len(s.token_ids) for s in samples)

    def sequential() -> float:
        started = time.perf_counter()
        tokens = sum(round_of(n) for n in revisions)
        return tokens / (time.perf_counter() - started)

    def concurrent() -> float:
        counts: list[int] = []
        threads = [threading.Thread(target=lambda n=n: counts.append(round_of(n))) for n in revisions]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(counts) / (time.perf_counter() - started)

    round_of(revisions[0])  # warm
    pairs = []
    for repeat in range(REPEATS):
        first, second = (sequential, concurrent) if repeat % 2 == 0 else (concurrent, sequential)
        a, b = first(), second()
        seq, con = (a, b) if first is sequential else (b, a)
        pairs.append({"sequential_tokens_per_s": round(seq, 1), "concurrent_tokens_per_s": round(con, 1)})
    ratio = statistics.median(p["concurrent_tokens_per_s"] / p["sequential_tokens_per_s"] for p in pairs)
    return {"ratio": round(ratio, 3), "pairs": pairs, "policies": len(revisions), "prompts": len(PROMPTS), "n": ROUND_N}


def run_loop(stack: Stack, trainer: Trainer, steps: int) -> tuple[list[dict], dict, int, list[float]]:
    from mint_client import Client

    from adapters import services
    from adapters.models import AdapterRevision, Approval
    from serving.models import Placement
    from tenants.access import Actor
    from tenants.models import Tenant

    tenant, token = stack.tenant()
    Tenant.objects.filter(id=tenant.id).update(four_eyes=True)  # approval stays the gate to applications
    with stack.as_control_plane():
        adapter = services.adapter_create(
            tenant=tenant, name=ADAPTER, base_model=stack.base, description="", by=Actor.system()
        )
    client = Client(stack.web_url, token, timeout=120)
    results, parent = [], None
    for step in range(1, steps + 1):
        path = trainer.step(step)
        # What push(ready_to_sample=True) does, up to the first sampled token (it then reads the revision once).
        started = time.perf_counter()
        revision = client.register(
            ADAPTER, path, training_step=step, parent=parent, run="bench", metrics={"step": step}, prewarm=True
        )
        registered = time.perf_counter()
        client.wait_until_sampleable(ADAPTER, revision.number, timeout=300)
        token, token_wall = time.perf_counter(), time.time()
        samples = client.sample(ADAPTER, revision.number, PROMPTS, max_tokens=MAX_TOKENS, seed=step)
        row = AdapterRevision.objects.get(adapter=adapter, number=revision.number)
        ready = Placement.objects.filter(revision=row, ready_at__isnull=False).order_by("ready_at").first()
        results.append(
            {
                "step": step,
                "revision": revision.number,
                "revision_id": row.id,
                "handoff_s": round(token - started, 3),
                "register_s": round(registered - started, 3),
                "ready_to_token_s": round(token_wall - ready.ready_at.timestamp(), 3) if ready else None,
                "rollout_s": round(time.perf_counter() - token, 3),
                "samples": len(samples),
            }
        )
        print(f"step {step}: handoff {token - started:.3f} s", flush=True)
        parent = revision.number
    # The prewarm flag, measured: the same steps registered without it (the first sample's probe then asks for
    # the load, as any cold request does, and is held until the revision is ready).
    unflagged = []
    for extra in range(steps + 1, steps + 1 + max(1, steps // 4)):
        path = trainer.step(extra)
        started = time.perf_counter()
        revision = client.register(ADAPTER, path, training_step=extra, parent=parent, run="bench-no-prewarm")
        client.wait_until_sampleable(ADAPTER, revision.number, timeout=300)
        unflagged.append(round(time.perf_counter() - started, 3))
        parent = revision.number
    numbers = [r["revision"] for r in results][-POLICIES:]
    multi = multi_policy(client, numbers)
    return results, multi, Approval.objects.filter(revision__adapter=adapter).count(), unflagged


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="steps of the loop (default 20; 3 with --quick)")
    p.add_argument("--baselines", type=int, default=None, help="merged and in-place runs each (default 3; quick 1)")
    args = p.parse_args(argv)
    steps = args.steps or (3 if args.quick else 20)
    runs = args.baselines or (1 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="mint-bench-handoff-"))
    from devtools.tiny import make_tiny_model

    model_dir = make_tiny_model(
        "dense", work / "tiny-llama"
    )  # the stack's base (the same seed): kept for the baselines
    redis_db = int(os.environ.get("MINT_BENCH_REDIS_DB", "13"))
    with Stack("handoff", max_loras=8, redis_db=redis_db) as stack:
        node_cpus = stack.cpus[1] if stack.cpus else None
        trainer = Trainer(model_dir, work / "trainer")
        loop, multi, approvals, unflagged = run_loop(stack, trainer, steps)
        breakdown = client_stages(loop) | stages([r["revision_id"] for r in loop])
        load_average = os.getloadavg()
    adapters = [work / "trainer" / f"step-{r['step']}" for r in loop[:runs]]
    merged = baselines.merged_reload(model_dir, adapters, work / "merged", node_cpus)
    inplace, inplace_error = baselines.inplace_update(model_dir, adapters, work / "inplace", node_cpus)
    costs = baselines.byte_costs(work / "costs")

    handoffs = [r["handoff_s"] for r in loop]
    handoff_p50 = percentile(handoffs, 50)
    merged_p50 = percentile([m["to_first_token_s"] for m in merged], 50) if merged else None
    inplace_p50 = percentile([m["to_first_token_s"] for m in inplace], 50) if inplace else None
    tiny_lora = sum(f.stat().st_size for f in (work / "trainer" / "step-1").glob("*.safetensors"))
    tiny_full = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    figures = {
        "steps": steps,
        "handoff_p50_s": round(handoff_p50, 3),
        "handoff_p95_s": round(percentile(handoffs, 95), 3),
        "merged_reload_p50_s": None if merged_p50 is None else round(merged_p50, 3),
        "inplace_update_p50_s": None if inplace_p50 is None else round(inplace_p50, 3),
        "inplace_update_null_reason": inplace_error or None,
        "projected": baselines.project(
            costs=costs,
            handoff_p50_s=handoff_p50,
            merged_p50_s=merged_p50,
            inplace_p50_s=inplace_p50,
            tiny_lora=tiny_lora,
            tiny_full=tiny_full,
            tiny_model="tiny-llama",
        ),
        "handoff_speedup": None if merged_p50 is None else round(merged_p50 / handoff_p50, 2),
        "multi_policy_throughput_ratio": multi["ratio"],
        "approvals_needed": approvals,
        "loop": loop,
        "stages_p50_s": breakdown,
        "multi_policy": multi,
        "ideas": ideas(breakdown, handoff_p50, unflagged),
        "merged_reload": merged,
        "inplace_update": inplace,
        "byte_costs": costs,
        "assumptions": {
            "lora": (
                f"rank {baselines.LORA_RANK} on q,k,v,o,gate,up,down; MoE experts rank {baselines.EXPERT_LORA_RANK}"
            ),
            "dtype": "bfloat16",
            "tiny_llama_lora": "rank 8 on q_proj, v_proj, o_proj (the loop's)",
        },
        "target": {"handoff_p50_s": TARGET_HANDOFF_P50_S, "approvals_needed": 0},
        "paper": {"handoff_speedup": PAPER_SPEEDUP, "multi_policy_throughput_ratio": PAPER_MULTI_POLICY},
        "placement": stack.placement,
        "load_average_1_5_15": [round(x, 1) for x in load_average],
    }
    path = write_result("handoff", figures, quick=args.quick, out_dir=args.out)
    plot_result(path)
    print(
        f"handoff p50 {figures['handoff_p50_s']} s, merged {figures['merged_reload_p50_s']} s, speedup "
        f"{figures['handoff_speedup']}, multi-policy {figures['multi_policy_throughput_ratio']}"
    )
    return 0


def plot(figures: dict, path: Path) -> bool:
    """Left: each step's handoff against the baselines. Right: projected seconds per shape, log scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    loop = figures.get("loop") or []
    left.bar(
        [r["step"] for r in loop],
        [r["handoff_s"] for r in loop],
        color="tab:blue",
        label="handoff (push → first token)",
    )
    for key, colour, label in (
        ("merged_reload_p50_s", "tab:red", "merged + new engine, p50"),
        ("inplace_update_p50_s", "tab:orange", "merged + in-place reload, p50"),
    ):
        if figures.get(key) is not None:
            left.axhline(figures[key], color=colour, linestyle="--", label=f"{label}: {figures[key]:.2f} s")
    left.axhline(TARGET_HANDOFF_P50_S, color="black", linestyle=":", label="target p50 ≤ 1 s")
    left.set_yscale("log")
    left.set_xlabel("RL step")
    left.set_ylabel("seconds")
    left.legend(fontsize=8)
    left.set_title(
        f"Handoff p50 {figures.get('handoff_p50_s')} s, {figures.get('handoff_speedup')}x the merged reload "
        f"(paper {PAPER_SPEEDUP}x)",
        fontsize=10,
    )
    projected = figures.get("projected") or {}
    names = list(projected)
    for offset, (key, label, colour) in enumerate(
        (
            ("handoff_s", "handoff", "tab:blue"),
            ("merged_reload_s", "merged + new engine", "tab:red"),
            ("inplace_update_s", "merged + in-place reload", "tab:orange"),
        )
    ):
        xs = [x + (offset - 1) * 0.27 for x in range(len(names))]
        right.bar(xs, [projected[n].get(key) or 0 for n in names], width=0.27, label=label, color=colour)

    def size(b: int) -> str:
        return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.2f} MB"

    labels = [f"{n}\nLoRA {size(projected[n]['lora_bytes'])}\nfull {size(projected[n]['full_bytes'])}" for n in names]
    right.set_xticks(list(range(len(names))), labels, fontsize=8)
    right.set_yscale("log")
    right.set_ylabel("projected seconds (measured byte costs)")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    right.set_title(
        f"Multi-policy tokens/s ratio {figures.get('multi_policy_throughput_ratio')} (paper {PAPER_MULTI_POLICY})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
