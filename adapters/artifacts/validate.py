"""Validation of an unpacked LoRA adapter directory against a base model, without unpickling anything.

Checks run in a fixed order, cheapest and most telling first, so the reason a person sees
is the one to fix first: forbidden pickle files, the config, the files, every header, every
tensor's name, dtype and shape, LoRA pairs and target modules, and only then the values
(read a chunk at a time, so memory stays at one chunk whatever the size of a tensor).
Every read of tenant data is bounded before it allocates: headers per file and per adapter,
the config's size and nesting, the target_modules pattern's length and matching time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from adapters.artifacts.archive import ArchiveLimits
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.peft_config import LoraConfig, TensorKey, parse_adapter_config, parse_tensor_name
from adapters.artifacts.safetensors_header import HeaderBudget
from adapters.artifacts.safetensors_io import SafetensorsHeader, TensorInfo, first_non_finite, read_header
from adapters.artifacts.spec import BaseModelSpec

CONFIG_NAME = "adapter_config.json"
PEFT_TENSOR_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
ALLOWED_DTYPES = ("F16", "BF16", "F32")


def adapter_member(name: str) -> bool:
    """Whether a file of this base name can matter to validation: the config, weights, or a refused pickle."""
    return name == CONFIG_NAME or name.endswith(".safetensors") or name.lower().endswith(PICKLE_SUFFIXES)


@dataclass(frozen=True)
class ValidationLimits:
    """Bounds on what one adapter may be; the archive limits apply when it arrives as an archive."""

    # One safetensors header: 200,000 tensors with long MoE names fit in about 30 MB.
    max_header_bytes: int = 32 * 1024 * 1024
    # The headers of all the adapter's files together (read and held parsed at once).
    max_total_header_bytes: int = 64 * 1024 * 1024
    max_tensors: int = 200_000
    archive: ArchiveLimits = ArchiveLimits()  # noqa: RUF009 - frozen, so one shared instance is safe


@dataclass(frozen=True)
class ValidatedAdapter:
    """An adapter that passed every check, with what export and the catalog need to know about it."""

    root: Path  # the directory holding adapter_config.json
    config: dict  # the raw adapter_config.json
    rank: int
    alpha: float
    target_modules: list[str]  # module names present, sorted (expert modules by their name too)
    layout: str  # "peft" (one adapter_model.safetensors) | "many_file"
    tensor_files: list[Path]  # sorted
    tensor_count: int
    size_bytes: int  # every file under root
    dtype: str  # e.g. "F16"


def validate_adapter_dir(
    root: Path, spec: BaseModelSpec, limits: ValidationLimits = ValidationLimits()
) -> ValidatedAdapter:
    """Check an adapter upload under `root` against `spec`; raise `ArtifactError` on the first problem.

    `root` may hold the adapter directly or nested in folders (as archives often do); the
    directory with the one adapter_config.json is the adapter's root.
    """
    root = Path(root)
    adapter_root = _find_adapter_root(root)
    size_bytes = _total_size(adapter_root)
    if size_bytes > limits.archive.max_total_bytes:
        raise ArtifactError(
            "archive_too_large",
            f"The adapter's files total {size_bytes} bytes, above the limit of {limits.archive.max_total_bytes}; "
            "upload only adapter_config.json and the adapter's safetensors.",
        )

    config = parse_adapter_config(adapter_root / CONFIG_NAME)
    if config.r > spec.max_lora_rank:
        raise ArtifactError(
            "rank_too_high",
            f"{CONFIG_NAME} sets r = {config.r}, above this base model's limit of {spec.max_lora_rank}; "
            f"train the adapter with rank {spec.max_lora_rank} or less.",
        )

    files, layout = _tensor_files(adapter_root)
    headers = _read_headers(files, limits)
    keys, dtype = _check_tensors(headers, spec, config)
    _check_pairs(keys)
    present = _check_targets(keys, config)
    for header in headers:
        name = first_non_finite(header)
        if name is not None:
            raise ArtifactError(
                "non_finite",
                f"Tensor {name} in {header.path.name} contains NaN or infinite values; "
                "fix the training run (e.g. lower the learning rate) and export the adapter again.",
            )

    return ValidatedAdapter(
        root=adapter_root,
        config=config.raw,
        rank=config.r,
        alpha=config.lora_alpha,
        target_modules=present,
        layout=layout,
        tensor_files=files,
        tensor_count=len(keys),
        size_bytes=size_bytes,
        dtype=dtype,
    )


def _find_adapter_root(root: Path) -> Path:
    configs: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            if filename.lower().endswith(PICKLE_SUFFIXES):
                raise ArtifactError(
                    "pickle_forbidden",
                    f"{path.relative_to(root)} is a pickle-based checkpoint, which can run code when loaded and "
                    "is not accepted; export the adapter as safetensors "
                    "(model.save_pretrained(..., safe_serialization=True)) and upload without the .bin/.pt files.",
                )
            if filename == CONFIG_NAME:
                configs.append(path)
    if not configs:
        raise ArtifactError(
            "missing_adapter_config",
            f"No {CONFIG_NAME} was found in the upload; include the one PEFT's save_pretrained writes "
            "next to the adapter's safetensors.",
        )
    if len(configs) > 1:
        listed = ", ".join(str(c.relative_to(root)) for c in configs)
        raise ArtifactError(
            "missing_adapter_config",
            f"The upload holds {len(configs)} {CONFIG_NAME} files ({listed}); upload exactly one adapter.",
        )
    return configs[0].parent


def _total_size(root: Path) -> int:
    total = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            total += os.lstat(os.path.join(dirpath, filename)).st_size
    return total


def _tensor_files(adapter_root: Path) -> tuple[list[Path], str]:
    files = sorted(p for p in adapter_root.iterdir() if p.name.endswith(".safetensors") and p.is_file())
    if not files:
        raise ArtifactError(
            "no_tensors",
            f"No .safetensors file sits next to {CONFIG_NAME}; upload the adapter's weights "
            f"({PEFT_TENSOR_FILE}, or one safetensors file per tensor) in the same folder.",
        )
    names = [p.name for p in files]
    if PEFT_TENSOR_FILE in names:
        if len(files) > 1:
            others = ", ".join(n for n in names if n != PEFT_TENSOR_FILE)
            raise ArtifactError(
                "bad_safetensors",
                f"{PEFT_TENSOR_FILE} must be the only .safetensors file next to {CONFIG_NAME}, but the upload "
                f"also has {others}; remove the other files.",
            )
        return files, "peft"
    return files, "many_file"


def _read_headers(files: list[Path], limits: ValidationLimits) -> list[SafetensorsHeader]:
    headers: list[SafetensorsHeader] = []
    owner: dict[str, Path] = {}
    budget = HeaderBudget(limits.max_total_header_bytes)
    for path in files:
        header = read_header(path, max_header_bytes=limits.max_header_bytes, budget=budget)
        for name in header.tensors:
            if name in owner:
                where = "twice" if owner[name] == path else f"in both {owner[name].name} and {path.name}"
                raise ArtifactError(
                    "bad_safetensors", f"Tensor {name} appears {where}; keep exactly one copy of each tensor."
                )
            owner[name] = path
            if len(owner) > limits.max_tensors:
                raise ArtifactError(
                    "too_many_tensors",
                    f"The adapter has more than {limits.max_tensors} tensors (reached in {path.name}); "
                    "target fewer modules or merge tensors.",
                )
        headers.append(header)
    if not owner:
        raise ArtifactError(
            "no_tensors", f"The adapter's safetensors files ({', '.join(p.name for p in files)}) hold no tensors."
        )
    return headers


def _check_tensors(
    headers: list[SafetensorsHeader], spec: BaseModelSpec, config: LoraConfig
) -> tuple[dict[TensorKey, TensorInfo], str]:
    keys: dict[TensorKey, TensorInfo] = {}
    first_dtype: tuple[str, str] | None = None  # (dtype, tensor)
    for header in headers:
        where = header.path.name
        for name in sorted(header.tensors):
            info = header.tensors[name]
            if info.dtype not in ALLOWED_DTYPES:
                raise ArtifactError(
                    "bad_dtype",
                    f"Tensor {name} in {where} is {info.dtype}; LoRA weights must be F16, BF16 or F32. "
                    "Cast the adapter (e.g. model.half()) before saving.",
                )
            if first_dtype is None:
                first_dtype = (info.dtype, name)
            elif info.dtype != first_dtype[0]:
                raise ArtifactError(
                    "bad_dtype",
                    f"Tensor {name} in {where} is {info.dtype} but {first_dtype[1]} is {first_dtype[0]}; "
                    "save every tensor of the adapter in one dtype.",
                )
            key = parse_tensor_name(name)
            shapes = _module_shapes(key, spec) if key is not None else None
            if key is None or shapes is None:
                raise ArtifactError("unexpected_tensor", _unexpected_message(name, where, key, spec))
            in_features, out_features = shapes
            got = list(info.shape)
            if key.which == "A":
                rank = got[0] if len(got) == 2 else None
                ok = len(got) == 2 and got[1] == in_features
                expected = f"[r, {in_features}]"
            else:
                rank = got[1] if len(got) == 2 else None
                ok = len(got) == 2 and got[0] == out_features
                expected = f"[{out_features}, r]"
            if not ok:
                raise ArtifactError(
                    "shape_mismatch",
                    f"Tensor {name} in {where} has shape {got}, expected {expected} for {key.module} "
                    f"(in {in_features}, out {out_features}) of this base model; "
                    "check the adapter was trained on this base model.",
                )
            if rank != config.r:
                raise ArtifactError(
                    "rank_mismatch",
                    f"Tensor {name} in {where} has rank {rank} (shape {got}) but {CONFIG_NAME} says r = {config.r}; "
                    "save the adapter again so its config and weights agree.",
                )
            keys[key] = info
    assert first_dtype is not None  # _read_headers refuses an adapter without tensors
    return keys, first_dtype[0]


def _module_shapes(key: TensorKey, spec: BaseModelSpec) -> tuple[int, int] | None:
    if key.layer >= spec.num_layers:
        return None
    if key.expert is None:
        return spec.module_shapes.get(key.module)
    if spec.architecture != "moe" or key.expert >= spec.num_experts:
        return None
    return spec.expert_module_shapes.get(key.module)


def _unexpected_message(name: str, where: str, key: TensorKey | None, spec: BaseModelSpec) -> str:
    if key is None:
        reason = (
            "it is not a LoRA weight of an attention, MLP or expert projection "
            "(expected names like base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)"
        )
    elif key.layer >= spec.num_layers:
        reason = f"this base model has {spec.num_layers} layers (0-{spec.num_layers - 1})"
    elif key.expert is not None and spec.architecture != "moe":
        reason = "this base model is dense and has no experts"
    elif key.expert is not None and key.expert >= spec.num_experts:
        reason = f"this base model has {spec.num_experts} experts (0-{spec.num_experts - 1})"
    elif key.expert is not None:
        reason = f"experts of this base model have no {key.module} (they have {', '.join(spec.expert_module_shapes)})"
    else:
        reason = f"this base model has no {key.module} outside its experts"
    return f"Tensor {name} in {where} is not part of this base model: {reason}; remove it or pick the right base model."


def _check_pairs(keys: dict[TensorKey, TensorInfo]) -> None:
    for key in sorted(keys, key=lambda k: (k.layer, -1 if k.expert is None else k.expert, k.module, k.which)):
        other = TensorKey(layer=key.layer, expert=key.expert, module=key.module, which="B" if key.which == "A" else "A")
        if other not in keys:
            present = keys[key].name
            missing = present[: -len(f"lora_{key.which}.weight")] + f"lora_{other.which}.weight"
            raise ArtifactError(
                "unpaired_lora",
                f"Tensor {present} has no partner {missing}; every LoRA module needs both lora_A and lora_B.",
            )


def _check_targets(keys: dict[TensorKey, TensorInfo], config: LoraConfig) -> list[str]:
    # The pattern was compiled (for RE2, linear-time) once, when the config was read; each module
    # path is matched once, though its lora_A and lora_B both name it.
    covered: dict[str, bool] = {}
    for key in sorted(keys, key=lambda k: keys[k].name):
        path = key.module_path
        if path not in covered:
            covered[path] = config.targets(path)
        if not covered[path]:
            raise ArtifactError(
                "target_modules_mismatch",
                f"Tensor {keys[key].name} adapts {path}, which {CONFIG_NAME}'s target_modules "
                f"{config.target_modules!r} does not cover; add {key.module!r} to target_modules or remove those "
                "tensors.",
            )
    return sorted({key.module for key in keys})
