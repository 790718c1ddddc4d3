"""Writing a validated adapter in the layout the engine loads: PEFT adapter_config.json + one safetensors.

Dense adapters (and MoE adapters exported without a base model spec) keep their tensors as
they are; given a MoE base model's spec, per-expert tensors are packed into vLLM's 3-D PEFT
layout (see adapters.artifacts.packing), which loads several times faster, or, where the base
model opts in (`moe_layout_for`), into MinT's expert-major layout, which only nodes running
MinT's vLLM plugin load (the record's engine_flags name that capability, so placement never
sends such a revision to another node).

The output depends only on the adapter's config and tensor bytes, never on file names,
timestamps or the input layout, so exporting the same revision again gives byte-identical
files and a re-export can be checked against the hashes recorded the first time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from adapters.artifacts import packing
from adapters.artifacts.safetensors_io import SafetensorsHeader, read_header, tensor_bytes, write_safetensors
from adapters.artifacts.spec import BaseModelSpec
from adapters.artifacts.validate import CONFIG_NAME, PEFT_TENSOR_FILE, ValidatedAdapter

HASH_CHUNK_BYTES = 1024 * 1024
# PEFT and transformers write this; some loaders check it.
SAFETENSORS_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class ExportedFile:
    """One file of an export, as recorded in policy_record.json."""

    name: str
    sha256: str
    size_bytes: int


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def engine_config(adapter: ValidatedAdapter) -> dict:
    """The adapter_config.json to export: the uploaded one with rank, alpha, type and targets made exact."""
    config = dict(adapter.config)
    alpha = adapter.alpha
    config["r"] = adapter.rank
    config["lora_alpha"] = int(alpha) if float(alpha).is_integer() else alpha
    config["peft_type"] = "LORA"
    config["target_modules"] = list(adapter.target_modules)
    return config


@dataclass(frozen=True)
class EngineLayout:
    """How an export must be loaded: the layout name, the node flags it needs and the load request's extras."""

    name: str  # "peft" | packing.LAYOUT | packing.EXPERT_MAJOR
    engine_flags: list[str]
    load_request: dict
    min_max_lora_rank: int  # the node's --max-lora-rank must be at least this (vLLM rounds up to 1, 8, 16, …)

    def as_record(self) -> dict:
        return {
            "engine_layout": self.name,
            "engine_flags": list(self.engine_flags),
            "load_request": dict(self.load_request),
            "min_max_lora_rank": self.min_max_lora_rank,
        }


# BaseModel.config key choosing how MoE adapters of that base model are packed (absent: packing.LAYOUT).
MOE_LAYOUT_CONFIG_KEY = "moe_lora_layout"


def moe_layout_for(base_model_config: dict, frozen_record: dict | None = None) -> str:
    """The MoE layout an export of a revision uses.

    A revision already exported keeps its frozen layout (a re-export must give the same bytes);
    otherwise the base model's `config["moe_lora_layout"]` decides, default the 3-D PEFT layout
    plain vLLM nodes load. Opt a base model in to `mint_expert_major` only once nodes serving
    it run MinT's vLLM plugin and declare its capability in their engine_flags: placement needs
    a node with it.
    """
    frozen = (frozen_record or {}).get("engine_layout")
    if frozen in packing.LAYOUTS:
        return frozen
    chosen = (base_model_config or {}).get(MOE_LAYOUT_CONFIG_KEY) or packing.LAYOUT
    if chosen not in packing.LAYOUTS:
        raise ValueError(f"{MOE_LAYOUT_CONFIG_KEY} must be one of {packing.LAYOUTS}, not {chosen!r}")
    return chosen


def engine_layout(
    adapter: ValidatedAdapter, spec: BaseModelSpec | None, *, moe_layout: str = packing.LAYOUT
) -> EngineLayout:
    """The layout `write_engine_layout(adapter, dest, spec=spec, moe_layout=moe_layout)` writes, and what loading
    it needs."""
    headers = [_header(path) for path in adapter.tensor_files]
    if spec is not None and packing.needs_packing(spec, [name for h in headers for name in h.tensors]):
        if moe_layout == packing.EXPERT_MAJOR:
            # Stored at the adapter's own rank; nothing to read (gate and up are never merged).
            return EngineLayout(
                name=packing.EXPERT_MAJOR,
                engine_flags=list(packing.EXPERT_MAJOR_ENGINE_FLAGS),
                load_request={},
                min_max_lora_rank=adapter.rank,
            )
        described = packing.describe(spec, headers, rank=adapter.rank, dtype=adapter.dtype)
        return EngineLayout(
            name=packing.LAYOUT,
            engine_flags=list(packing.ENGINE_FLAGS),
            load_request=dict(packing.LOAD_REQUEST),
            min_max_lora_rank=described["packed_rank"],
        )
    return EngineLayout(name="peft", engine_flags=[], load_request={}, min_max_lora_rank=adapter.rank)


def _header(path: Path) -> SafetensorsHeader:
    # The headers were checked by validation; a header can be no longer than its file.
    return read_header(path, max_header_bytes=path.stat().st_size)


def write_engine_layout(
    adapter: ValidatedAdapter, dest: Path, *, spec: BaseModelSpec | None = None, moe_layout: str = packing.LAYOUT
) -> list[ExportedFile]:
    """Write adapter_config.json and adapter_model.safetensors into `dest`; return them sorted by name.

    Without `spec`, or for an adapter with no per-expert MoE tensors, tensors are copied with
    their names sorted, one at a time, as raw bytes (bit-identical, whatever the input
    layout). With a MoE `spec`, per-expert tensors are packed in `moe_layout` (one stacked tensor in memory
    at a time; `packing.unpack_moe` gives them back bit for bit). Each file is written to a
    temporary name and renamed, so a crash never leaves a half-written file under its final
    name. policy_record.json is the caller's.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)

    config_bytes = (json.dumps(engine_config(adapter), sort_keys=True, indent=2) + "\n").encode("utf-8")
    _write_atomic(dest / CONFIG_NAME, config_bytes)

    headers = [_header(path) for path in adapter.tensor_files]
    source: dict[str, SafetensorsHeader] = {name: header for header in headers for name in header.tensors}
    if spec is not None and packing.needs_packing(spec, list(source)):
        packing.write_packed(
            spec,
            headers,
            dest / PEFT_TENSOR_FILE,
            rank=adapter.rank,
            dtype=adapter.dtype,
            metadata=SAFETENSORS_METADATA,
            layout=moe_layout,
        )
        return _exported(dest)

    def tensors() -> Iterator[tuple[str, str, tuple[int, ...], bytes]]:
        for name in sorted(source):
            header = source[name]
            info = header.tensors[name]
            yield name, info.dtype, info.shape, tensor_bytes(header, name)

    write_safetensors(dest / PEFT_TENSOR_FILE, tensors(), metadata=SAFETENSORS_METADATA)
    return _exported(dest)


def _exported(dest: Path) -> list[ExportedFile]:
    return [
        ExportedFile(name=name, sha256=sha256_file(dest / name), size_bytes=(dest / name).stat().st_size)
        for name in sorted((CONFIG_NAME, PEFT_TENSOR_FILE))
    ]


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
