"""A completion answer as vLLM 0.32 gives it with `--enable-return-routed-experts`, for the gateway's R3 tests.

vLLM CPU 0.32 cannot run an engine with that flag: it refuses to start with "AuxOutput Connector requires
Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.", and with VLLM_USE_V2_MODEL_RUNNER=1 with "Model Runner V2
requires Triton." (the CPU build has no Triton backend). So the answer is made the way the engine makes it,
from the same parts: the tiny Qwen3-MoE's own routers (transformers, `output_router_logits`) give each token's
top-k experts per layer, in the engine's order (highest router weight first) and dtype (uint8 for at most 256
experts: vllm/model_executor/layers/fused_moe/routed_experts_capturer.py), for the prompt from
`routed_experts_prompt_start` and the sampled tokens but the last (the last has not been forwarded yet); vLLM's
own response model (`CompletionResponse`) and encoder (`numpy2base64`, a base64 `.npy`) serialize it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def routing_of(model_dir: Path, token_ids: list[int]) -> Any:
    """`[len(token_ids), layers, top_k]` uint8: the experts each position is routed to, best first."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_router_logits=True)
    layers = [logits.reshape(len(token_ids), -1) for logits in out.router_logits]
    chosen = [torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1).indices for logits in layers]
    return np.stack([c.numpy() for c in chosen], axis=1).astype(np.uint8)


def engine_answer(model_dir: Path, *, lora: str, prompt: str, max_tokens: int = 4, prompt_start: int = 0) -> dict:
    """The engine's JSON answer to a greedy completion of `prompt`: text, token ids, logprobs, routed experts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionLogProbs,
        CompletionResponse,
        CompletionResponseChoice,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.utils.serial_utils import numpy2base64

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt_ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    sampled = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, sampled, strict=True)]
    tokens = [tokenizer.decode([t]) for t in sampled]
    routing = routing_of(model_dir, prompt_ids + sampled[:-1])[prompt_start:]
    choice = CompletionResponseChoice(
        index=0,
        text="".join(tokens),
        logprobs=CompletionLogProbs(
            text_offset=[],
            token_logprobs=logprobs,
            tokens=tokens,
            top_logprobs=[{t: lp} for t, lp in zip(tokens, logprobs, strict=True)],
        ),
        finish_reason="length",
        token_ids=sampled,
        routed_experts=numpy2base64(routing),
    )
    usage = UsageInfo(
        prompt_tokens=len(prompt_ids), completion_tokens=len(sampled), total_tokens=len(prompt_ids) + len(sampled)
    )
    return CompletionResponse(model=lora, choices=[choice], usage=usage).model_dump(mode="json")
