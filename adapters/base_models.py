"""Base models: reading a Hugging Face `config.json` into the shapes adapters are checked against, and registering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.db import transaction

from adapters.artifacts import packing
from adapters.artifacts.export import MOE_LAYOUT_CONFIG_KEY
from adapters.artifacts.spec import BaseModelSpec
from adapters.models import BaseModel
from tenants.access import Actor
from tenants.services import audit_record

MOE_MODEL_TYPES = frozenset({"qwen3_moe", "qwen2_moe", "mixtral"})


def _positive_int(config: dict[str, Any], field: str, default: int | None = None) -> int:
    value = config.get(field, default)
    if value is None:
        raise ValueError(f"config.json has no {field!r}.")
    # JSON booleans are ints to Python; a layer count of `true` is a broken config, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json field {field!r} must be a positive integer, not {value!r}.")
    return value


def _expert_count(config: dict[str, Any]) -> int:
    for field in ("num_experts", "num_local_experts"):
        value = config.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"config.json field {field!r} must be a non-negative integer, not {value!r}.")
        if value > 0:
            return value
    return 0


def spec_config_from_hf(hf_config: dict) -> dict:
    """The JSON stored in `BaseModel.config` for a Hugging Face `config.json` (see `BaseModelSpec`).

    Shapes are `[in_features, out_features]` per layer module. Attention (`q_proj`, `k_proj`,
    `v_proj`, `o_proj`) comes from `hidden_size`, `num_attention_heads`, `num_key_value_heads`
    (default: the head count) and `head_dim` (default: hidden size / heads). A dense model also
    has `gate_proj`, `up_proj` and `down_proj` from `intermediate_size`.

    A model is MoE when its `model_type` is `qwen3_moe`, `qwen2_moe` or `mixtral`, or when
    `num_experts` / `num_local_experts` is above zero. Its `module_shapes` then hold only
    attention, and `expert_module_shapes` hold the modules inside each expert, under the
    Qwen-style names `gate_proj`, `up_proj`, `down_proj`, sized by `moe_intermediate_size`
    (Mixtral: `intermediate_size`). Mixtral's own expert names (`w1`, `w3`, `w2`), Qwen2-MoE's
    shared expert and Qwen3-MoE's dense `mlp_only_layers` are not described.

    A multimodal config whose language model sits under `text_config` is read from there.
    Raises `ValueError` naming the field when the config cannot be read.
    """
    if not isinstance(hf_config, dict):
        raise ValueError("config.json must hold a JSON object.")
    if "hidden_size" not in hf_config and isinstance(hf_config.get("text_config"), dict):
        hf_config = hf_config["text_config"]

    hidden = _positive_int(hf_config, "hidden_size")
    num_layers = _positive_int(hf_config, "num_hidden_layers")
    vocab_size = _positive_int(hf_config, "vocab_size")
    heads = _positive_int(hf_config, "num_attention_heads")
    kv_heads = _positive_int(hf_config, "num_key_value_heads", heads)
    if hf_config.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"config.json has no 'head_dim' and 'hidden_size' ({hidden}) is not a multiple of "
            f"'num_attention_heads' ({heads})."
        )
    head_dim = _positive_int(hf_config, "head_dim", hidden // heads)
    model_type = str(hf_config.get("model_type", ""))

    module_shapes: dict[str, list[int]] = {
        "q_proj": [hidden, heads * head_dim],
        "k_proj": [hidden, kv_heads * head_dim],
        "v_proj": [hidden, kv_heads * head_dim],
        "o_proj": [heads * head_dim, hidden],
    }
    expert_module_shapes: dict[str, list[int]] = {}
    num_experts = _expert_count(hf_config)
    if model_type in MOE_MODEL_TYPES or num_experts > 0:
        architecture = BaseModel.Architecture.MOE.value
        if num_experts == 0:
            raise ValueError(f"config.json of a {model_type} model has no 'num_experts' or 'num_local_experts'.")
        if model_type == "mixtral" or "moe_intermediate_size" not in hf_config:
            expert_inner = _positive_int(hf_config, "intermediate_size")
        else:
            expert_inner = _positive_int(hf_config, "moe_intermediate_size")
        expert_module_shapes = {
            "gate_proj": [hidden, expert_inner],
            "up_proj": [hidden, expert_inner],
            "down_proj": [expert_inner, hidden],
        }
    else:
        architecture = BaseModel.Architecture.DENSE.value
        inner = _positive_int(hf_config, "intermediate_size")
        module_shapes |= {
            "gate_proj": [hidden, inner],
            "up_proj": [hidden, inner],
            "down_proj": [inner, hidden],
        }

    return {
        "architecture": architecture,
        "model_type": model_type,
        "num_layers": num_layers,
        "hidden_size": hidden,
        "vocab_size": vocab_size,
        "num_experts": num_experts,
        "module_shapes": module_shapes,
        "expert_module_shapes": expert_module_shapes,
    }


def read_model_dir(path: Path) -> dict:
    """`spec_config_from_hf` of `path/config.json`. Raises `ValueError` when it is missing or unreadable."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json: is it a Hugging Face model directory?")
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_file} is not readable JSON: {exc}") from exc
    try:
        return spec_config_from_hf(hf_config)
    except ValueError as exc:
        raise ValueError(f"{config_file}: {exc}") from exc


def _audit_view(base_model: BaseModel) -> dict[str, Any]:
    return {
        "architecture": base_model.architecture,
        "model_type": base_model.config.get("model_type", ""),
        "num_layers": base_model.config.get("num_layers"),
        "num_experts": base_model.config.get("num_experts", 0),
        "max_lora_rank": base_model.max_lora_rank,
        "path": base_model.path,
    }


def base_model_upsert(
    *, name: str, path: Path, max_lora_rank: int, by: Actor, moe_lora_layout: str | None = None
) -> BaseModel:
    """Register the model directory at `path` as base model `name`, or update the row of that name.

    Reads `path/config.json` (outside the transaction) and stores its shapes, architecture and the
    resolved path. `moe_lora_layout` chooses how MoE adapters of this model are exported
    (adapters.artifacts.export.moe_layout_for); None keeps the current choice. Raises `ValueError`
    for a missing or unreadable config.json, a rank below 1 or an unknown layout.
    """
    if not name:
        raise ValueError("A base model needs a name.")
    if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or max_lora_rank < 1:
        raise ValueError(f"max_lora_rank must be a positive integer, not {max_lora_rank!r}.")
    path = Path(path).resolve()
    config = read_model_dir(path)
    BaseModelSpec.from_config(config, max_lora_rank=max_lora_rank)  # the stored JSON must stay readable
    if moe_lora_layout is not None and moe_lora_layout not in packing.LAYOUTS:
        raise ValueError(f"moe_lora_layout must be one of {', '.join(packing.LAYOUTS)}, not {moe_lora_layout!r}.")

    with transaction.atomic():
        base_model = BaseModel.objects.select_for_update().filter(name=name).first()
        before = _audit_view(base_model) if base_model is not None else None
        if base_model is None:
            base_model = BaseModel(name=name)
        base_model.architecture = config["architecture"]
        layout = moe_lora_layout or (base_model.config or {}).get(MOE_LAYOUT_CONFIG_KEY)
        if layout:
            config[MOE_LAYOUT_CONFIG_KEY] = layout
        base_model.config = config
        base_model.max_lora_rank = max_lora_rank
        base_model.path = str(path)
        base_model.save()
        audit_record(
            tenant=None,
            actor=by,
            action="base_model.upsert",
            target=f"base_model:{name}",
            before=before,
            after=_audit_view(base_model),
        )
    return base_model
