"""benchmarks/handoff's verdict rows and its introduction in docs/benchmarks.md (its figure is its own: OWN_PLOTS)."""

from __future__ import annotations

from benchmarks.report.data import fmt, get
from benchmarks.report.row import Row, check

INTRO = (
    "On the serving stack (vLLM CPU on the tiny Llama with `--max-loras 8`, the gateway, the control worker, the "
    "node agent), four-eyes on and nobody approving: an RL-shaped loop where each step moves a peft LoRA, writes it"
    " with `save_pretrained`, registers it through the SDK with `prewarm` and waits until a one-token sample "
    "answers (`register` + `wait_until_sampleable`, what `push(ready_to_sample=True)` does before its last read), "
    "then samples 8 completions. *Handoff*: from the registration's first byte to that first sampled token. "
    "Baselines on the node's CPUs once the stack is stopped: the same steps' LoRAs merged into the base and served "
    "by a new engine (the paper's comparison), and merged and reloaded in place by a running engine "
    "(`reload_weights` through `/collective_rpc`; vLLM CPU has no NCCL or CUDA-IPC transfer). *Multi-policy*: one "
    "rollout round (8 prompts, n 4) for each of 8 policies, all at once against one after another, sampled tokens "
    "per second. *Projected*: bytes per handoff at each shape, and seconds at the byte costs measured on this "
    "machine."
)


def rows_handoff(d: dict) -> list[Row]:
    target = get(d, "target", default={}) or {}
    paper = get(d, "paper", default={}) or {}
    p50, speedup = get(d, "handoff_p50_s"), get(d, "handoff_speedup")
    multi, approvals = get(d, "multi_policy_throughput_ratio"), get(d, "approvals_needed")
    inplace = get(d, "inplace_update_p50_s")
    projected = get(d, "projected", default={}) or {}
    rows = [
        Row(
            f"handoff p50 / p95, registration → first sampled token ({fmt(get(d, 'steps'), digits=0)} steps)",
            f"{fmt(p50)} / {fmt(get(d, 'handoff_p95_s'))} s",
            f"p50 ≤ {fmt(target.get('handoff_p50_s', 1.0))} s",
            check(p50, "<=", target.get("handoff_p50_s", 1.0)),
        ),
        Row(
            "merged + new engine to the first token, p50; speedup (merged ÷ handoff)",
            f"{fmt(get(d, 'merged_reload_p50_s'))} s; {fmt(speedup)}x",
            "",
            None,
            paper=f"{fmt(paper.get('handoff_speedup'))}x at 4B",
        ),
        Row(
            "merged + in-place reload (vLLM reload_weights) to the first token, p50",
            f"{fmt(inplace)} s" if inplace is not None else f"null: {get(d, 'inplace_update_null_reason')}",
            "",
            None,
            paper="about 0.18 s at 0.6B on GPU (RL frameworks)",
        ),
        Row(
            "multi-policy tokens/s, 8 rounds at once ÷ one after another",
            multi,
            "",
            None,
            paper=f"{fmt(paper.get('multi_policy_throughput_ratio'))}x (multi-policy GRPO)",
        ),
        Row("approvals needed", approvals, "0", approvals == 0 if approvals is not None else None),
    ]
    for name, shape in projected.items():
        rows.append(
            Row(
                f"{name}: bytes LoRA / full; projected seconds, handoff / merged reload / in-place reload",
                f"{_size(shape.get('lora_bytes'))} / {_size(shape.get('full_bytes'))}; "
                f"{fmt(shape.get('handoff_s'))} / {fmt(shape.get('merged_reload_s'))} / "
                f"{fmt(shape.get('inplace_update_s'))} s",
                "",
                None,
            )
        )
    return rows


def _size(value) -> str:
    size = value or 0
    return f"{fmt(size / 1e9)} GB" if size >= 1e9 else f"{fmt(size / 1e6)} MB"


# Findings that explain the figures (docs/benchmarks.md prints them under the section).
NOTES = [
    "**Reading the figures (2026-12-05, three full runs on main, a 2-core machine shared with other engineers' "
    "test runs and vLLM engines: load average 15-25).** Handoff p50 1.74, 3.26 and 1.84 s (the committed run, "
    "load 19-22): the 1.0 s target is missed on this machine under this load. Where the committed run's p50 goes: "
    "the registration request 0.26 s, validation 0.37 s and export 0.47 s (control worker: two tasks, each a "
    "sandboxed child), export → placement queued 0.22 s, the node agent's fetch and load 0.33 s, its warm-up "
    "completion 0.13 s, ready → the held probe's token 0.27 s. Every stage is a hand-off between processes "
    "(web, control worker, node agent, engine, gateway), and under a load of 20 each hand-off waits for a CPU: "
    "the same stages took 1.1-1.8x longer than in the first run (load 15), and about 2x in the second (load 25).",
    "**The ideas, measured.** The prewarm flag (placement as soon as the export is published): 1.84 s with it, "
    "4.28 s without (the first sample then asks for the load, as any cold request does). The others are bounded "
    "by the stage they would remove: the first sample as the warm-up, at most 0.13 s; validation while the "
    "upload streams, at most 0.37 s; no export for dense adapters, at most 0.47 s (both keep the untrusted files "
    "out of the web process and the artifact frozen, which is why they are not done). The new revision's node "
    "is its parent's here: one node.",
    "**Baselines.** A new vLLM CPU engine on the merged weights took 195-339 s to its first token in these runs "
    "(30-50 s on a quiet machine: the start is CPU-bound, and shared here); the speedups of 94-124x over it are "
    "this machine's, not the paper's 18.3x (GPU, 4B). vLLM's in-place `reload_weights` into a running CPU engine "
    "took 0.67 s p50 at the tiny Llama (4.4 MB of weights: merge 0.25-0.37 s, reload 0.08-0.21 s), faster than "
    "the LoRA path at that size; projected at the measured byte costs it is 21 s at Qwen3-4B (8 GB) and 155 s at "
    "Qwen3-30B-A3B (61 GB) against 2.4 and 3.0 s for the handoff (66 and 131 MB of LoRA). RL frameworks' 0.18 s "
    "at 0.6B moves weights GPU to GPU with NCCL or CUDA IPC, which the CPU build lacks.",
    "**Multi-policy.** 8 rounds at once ÷ one after another: 1.09, 1.50 and 1.25 across the runs (the paper's "
    "1.77x is on GPU, where batching several LoRAs costs little); vLLM CPU runs the engine on one core here, so "
    "concurrent rounds gain only what batching saves per step. No run needed an approval.",
]
