"""PEFT's adapter_config.json and LoRA tensor names, as far as MinT needs to understand them."""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import re2

from adapters.artifacts.bounded_json import JsonBoundExceeded, loads_bounded, read_json_file
from adapters.artifacts.errors import ArtifactError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Real configs are a few KB; a large MoE's per-module rank_pattern reaches about 1 MB.
MAX_CONFIG_BYTES = 4 * 1024 * 1024
# PEFT's configs nest three levels at most (layer_replication: [[0, 4], [2, 6]] inside the object).
MAX_CONFIG_DEPTH = 32
# A string target_modules is a regular expression that validation matches against every module
# path. It is matched with RE2 (linear in the path's length, no backtracking), its length is
# bounded, and so is the memory RE2 may spend compiling it and caching its automaton.
MAX_TARGET_PATTERN_CHARS = 1000
TARGET_PATTERN_MAX_MEM = 8 * 1024 * 1024
# PEFT's shorthand for "every linear layer", compared case-insensitively as PEFT does.
ALL_LINEAR = "all-linear"

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


class _FullMatcher(Protocol):
    def fullmatch(self, text: str) -> object | None: ...


@dataclass(frozen=True)
class LoraConfig:
    """The fields of adapter_config.json that validation relies on, plus the whole file as `raw`."""

    r: int
    lora_alpha: float
    target_modules: list[str] | str
    peft_type: str
    raw: dict
    # A string target_modules compiled once (None for a list or "all-linear").
    target_pattern: _FullMatcher | None = field(default=None, compare=False, repr=False)

    def targets(self, module_path: str) -> bool:
        """Whether PEFT adapts the module at `module_path` (e.g. model.layers.0.self_attn.q_proj) under this config.

        PEFT's rule: a string is "all-linear" or a regular expression the whole path must match;
        a list names modules by their name or by a dotted suffix of their path.
        """
        if isinstance(self.target_modules, str):
            if self.target_modules.lower() == ALL_LINEAR:
                return True
            return self.target_pattern is not None and self.target_pattern.fullmatch(module_path) is not None
        return any(module_path == t or module_path.endswith("." + t) for t in self.target_modules)


def parse_adapter_config(path: Path) -> LoraConfig:
    """Read a PEFT adapter_config.json; `bad_adapter_config` unless it describes a LoRA adapter."""
    path = Path(path)
    return _lora_config(lambda: read_json_file(path, max_bytes=MAX_CONFIG_BYTES, max_depth=MAX_CONFIG_DEPTH), path.name)


def parse_adapter_config_data(data: bytes, name: str = "adapter_config.json") -> LoraConfig:
    """`parse_adapter_config` of a config's bytes (registration checks an uploaded one before storing it).

    `data` may be the first MAX_CONFIG_BYTES + 1 bytes of a longer file: that is refused for its size.
    """
    return _lora_config(lambda: loads_bounded(data, max_bytes=MAX_CONFIG_BYTES, max_depth=MAX_CONFIG_DEPTH), name)


def _lora_config(read: Callable[[], object], name: str) -> LoraConfig:
    def bad(reason: str) -> ArtifactError:
        return ArtifactError("bad_adapter_config", f"{name}: {reason}")

    try:
        raw = read()
    except JsonBoundExceeded as exc:
        if exc.what == "size":
            raise bad(
                f"{exc.found} bytes is far more than an adapter config needs (limit {exc.limit}); "
                "upload the adapter_config.json PEFT's save_pretrained writes."
            ) from exc
        raise bad(
            f"nested more than {exc.limit} levels deep, which no PEFT config is; "
            "upload the adapter_config.json PEFT's save_pretrained writes."
        ) from exc
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
    pattern = None
    if isinstance(targets, str):
        if not targets:
            raise bad('"target_modules" is an empty string; list the adapted modules, e.g. ["q_proj", "v_proj"].')
        if targets.lower() != ALL_LINEAR:
            pattern = _compile_target_pattern(targets, bad)
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        targets = list(targets)
    else:
        raise bad(f'"target_modules" must list the adapted modules, e.g. ["q_proj", "v_proj"]; got {targets!r}.')
    return LoraConfig(
        r=r, lora_alpha=float(alpha), target_modules=targets, peft_type=peft_type, raw=raw, target_pattern=pattern
    )


def _compile_target_pattern(pattern: str, bad: Callable[[str], ArtifactError]) -> _FullMatcher:
    """Compile a string target_modules for matching with RE2; `bad(reason)` builds the refusal.

    PEFT matches it with Python's `re.fullmatch`, which backtracks: `(.*.*)*x` takes hours on a
    30-character path. RE2 matches the same language in linear time but has no backreferences
    or lookaround, so a pattern must compile in both: Python's `re` (PEFT must be able to load
    the adapter; compiling does not backtrack) and RE2 (what validation matches with).
    """
    if len(pattern) > MAX_TARGET_PATTERN_CHARS:
        raise bad(
            f'"target_modules" is a {len(pattern)}-character regular expression, above the limit of '
            f'{MAX_TARGET_PATTERN_CHARS}; list the adapted modules instead, e.g. ["q_proj", "v_proj"].'
        )
    try:
        with warnings.catch_warnings():
            # Python warns about constructs it may read differently one day ("[[" …); RE2 decides below.
            warnings.simplefilter("ignore")
            re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise bad(f'"target_modules" is not a valid regular expression ({exc}).') from exc
    options = re2.Options()
    options.max_mem = TARGET_PATTERN_MAX_MEM
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise bad(
            '"target_modules" must be a regular expression without backreferences or lookaround, one that can '
            f"be matched in linear time ({reason}); rewrite it, or list the adapted modules instead, "
            'e.g. ["q_proj", "v_proj"].'
        ) from exc


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
