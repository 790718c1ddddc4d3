"""What a base model looks like to a LoRA adapter: which modules exist and their shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BaseModelSpec:
    """The LoRA-relevant shape of a base model.

    `module_shapes` maps a per-layer module name (`q_proj`, `o_proj`, `gate_proj`, …) to
    `(in_features, out_features)`. For MoE models, `expert_module_shapes` does the same for
    the modules inside each expert (`gate_proj`, `up_proj`, `down_proj`), and dense MLP
    modules are absent from `module_shapes` unless the model also has them.
    A LoRA pair for a module of shape (in, out) and rank r is lora_A: [r, in], lora_B: [out, r].
    """

    architecture: str  # "dense" | "moe"
    num_layers: int
    module_shapes: dict[str, tuple[int, int]]
    max_lora_rank: int
    num_experts: int = 0
    expert_module_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict, *, max_lora_rank: int) -> BaseModelSpec:
        """From the JSON stored in `BaseModel.config` (see adapters.base_models.spec_config_from_hf)."""
        return cls(
            architecture=config["architecture"],
            num_layers=int(config["num_layers"]),
            module_shapes={k: (int(v[0]), int(v[1])) for k, v in config["module_shapes"].items()},
            num_experts=int(config.get("num_experts", 0)),
            expert_module_shapes={k: (int(v[0]), int(v[1])) for k, v in config.get("expert_module_shapes", {}).items()},
            max_lora_rank=max_lora_rank,
        )
