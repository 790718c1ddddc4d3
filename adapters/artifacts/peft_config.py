"""PEFT's adapter_config.json and LoRA tensor names, as far as MinT needs to understand them."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from adapters.artifacts.errors import ArtifactError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Real configs are a few KB; even per-module rank patterns of a large MoE stay far below this.
MAX_CONFIG_BYTES = 16 * 1024 * 1024

# Numbers without leading zeros, so "layers.01" and "layers.1" cannot name the same weight twice.
_NUMBER = r"(0|[1-9][0-9]*)"
_TENSOR_NAME = re.compile(
    rf"base_model\.model\.model\.layers\.{_NUMBER}\."
    r"(?:"
    rf"self_attn\.(?P<attn>{'|'.join(ATTENTION_MODULES)})"
    rf"|mlp\.experts\.(?P<expert>0|[1-9][0-9]*)\.(?P<expert_module>{'|'.join(MLP_MODULES)})"
    rf"|mlp\.(?P<mlp>{'|'.join(MLP_MODULES)})"
    r")\.lora_(?P<which>A|B)\.weight"
)


@dataclass(frozen=True)
class LoraConfig:
    """The fields of adapter_config.json that validation relies on, plus the whole file as `raw`."""

    r: int
    lora_alpha: float
    target_modules: list[str] | str
    peft_type: str
    raw: dict


def parse_adapter_config(path: Path) -> LoraConfig:
    """Read a PEFT adapter_config.json; `bad_adapter_config` unless it describes a LoRA adapter."""
    path = Path(path)

    def bad(reason: str) -> ArtifactError:
        return ArtifactError("bad_adapter_config", f"{path.name}: {reason}")

    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise bad(f"{size} bytes is far more than an adapter config needs (limit {MAX_CONFIG_BYTES}); upload PEFT's.")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise bad(f"not valid JSON ({exc}); save the adapter with PEFT's save_pretrained.") from exc
    if not isinstance(raw, dict):
        raise bad("must be a JSON object; save the adapter with PEFT's save_pretrained.")
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise bad(f'peft_type is {peft_type!r}; only LoRA adapters ("peft_type": "LORA") can be served.')
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad(f'"r" (the LoRA rank) must be a positive integer, got {r!r}.')
    alpha = raw.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise bad(f'"lora_alpha" must be a positive number, got {alpha!r}.')
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        if not targets:
            raise bad('"target_modules" is an empty string; list the adapted modules, e.g. ["q_proj", "v_proj"].')
        if targets != "all-linear":
            try:
                re.compile(targets)
            except re.error as exc:
                raise bad(f'"target_modules" is not a valid regular expression ({exc}).') from exc
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        targets = list(targets)
    else:
        raise bad(f'"target_modules" must list the adapted modules, e.g. ["q_proj", "v_proj"]; got {targets!r}.')
    return LoraConfig(r=r, lora_alpha=float(alpha), target_modules=targets, peft_type=peft_type, raw=raw)


@dataclass(frozen=True)
class TensorKey:
    """What a LoRA tensor name says: layer, expert (None outside MoE experts), module and A or B."""

    layer: int
    expert: int | None
    module: str
    which: str  # "A" | "B"

    @property
    def module_path(self) -> str:
        """The module's name inside the base model, as PEFT matches target_modules against it."""
        if self.expert is not None:
            return f"model.layers.{self.layer}.mlp.experts.{self.expert}.{self.module}"
        block = "self_attn" if self.module in ATTENTION_MODULES else "mlp"
        return f"model.layers.{self.layer}.{block}.{self.module}"


def parse_tensor_name(name: str) -> TensorKey | None:
    """Parse a PEFT LoRA tensor name (attention, dense MLP or MoE expert); None for anything else."""
    match = _TENSOR_NAME.fullmatch(name)
    if match is None:
        return None
    layer = int(match.group(1))
    if match.group("attn"):
        return TensorKey(layer=layer, expert=None, module=match.group("attn"), which=match.group("which"))
    if match.group("expert") is not None:
        return TensorKey(
            layer=layer,
            expert=int(match.group("expert")),
            module=match.group("expert_module"),
            which=match.group("which"),
        )
    return TensorKey(layer=layer, expert=None, module=match.group("mlp"), which=match.group("which"))
