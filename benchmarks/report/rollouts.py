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
                f"{name}: bytes LoRA / full; projected handoff / merged reload",
                f"{fmt((shape.get('lora_bytes') or 0) / 1e6)} MB / {fmt((shape.get('full_bytes') or 0) / 1e9)} GB; "
                f"{fmt(shape.get('handoff_s'))} / {fmt(shape.get('merged_reload_s'))} s",
                "",
                None,
            )
        )
    return rows
