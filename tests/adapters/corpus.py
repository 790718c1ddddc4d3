"""Test adapters and archives, good and bad, built on the fly for tiny base models.

Shared by the artifact tests and by any test that needs an adapter on disk. Everything is
small and fast: the tiny models have 2 layers and hidden size 64.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from adapters.artifacts.archive import ArchiveLimits, archive_kind, extract_archive
from adapters.artifacts.safetensors_io import read_header, tensor_bytes
from adapters.artifacts.spec import BaseModelSpec
from adapters.artifacts.validate import ValidatedAdapter, ValidationLimits, validate_adapter_dir

ATTENTION_SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64)}

TINY_DENSE = BaseModelSpec(
    architecture="dense",
    num_layers=2,
    module_shapes={**ATTENTION_SHAPES, "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)},
    max_lora_rank=16,
)

TINY_MOE = BaseModelSpec(
    architecture="moe",
    num_layers=2,
    module_shapes=dict(ATTENTION_SHAPES),
    num_experts=4,
    expert_module_shapes={"gate_proj": (64, 32), "up_proj": (64, 32), "down_proj": (32, 64)},
    max_lora_rank=16,
)

SMALL_LIMITS = ValidationLimits(
    max_header_bytes=64 * 1024,
    max_tensors=100,
    archive=ArchiveLimits(max_files=200, max_total_bytes=1024 * 1024, max_compression_ratio=50.0),
)

PREFIX = "base_model.model.model.layers"


def tensor_name(layer: int, module: str, which: str, expert: int | None = None) -> str:
    """The PEFT name of a LoRA weight."""
    if expert is not None:
        return f"{PREFIX}.{layer}.mlp.experts.{expert}.{module}.lora_{which}.weight"
    block = "self_attn" if module in ATTENTION_SHAPES else "mlp"
    return f"{PREFIX}.{layer}.{block}.{module}.lora_{which}.weight"


DEFAULT_LIMITS = ValidationLimits()


def validate_upload(
    upload: Path, spec: BaseModelSpec, workdir: Path, limits: ValidationLimits = DEFAULT_LIMITS
) -> ValidatedAdapter:
    """What the validation task does with an upload: unpack it if it is one archive file, then validate."""
    if upload.is_file() and archive_kind(upload) is not None:
        unpacked = workdir / "unpacked"
        extract_archive(upload, unpacked, limits.archive)
        return validate_adapter_dir(unpacked, spec, limits)
    return validate_adapter_dir(upload, spec, limits)


def lora_config(*, rank: int = 4, alpha: float = 8.0, targets: list[str] | str = ("q_proj", "v_proj")) -> dict:
    """An adapter_config.json like PEFT's save_pretrained writes."""
    return {
        "base_model_name_or_path": "tiny",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "peft_type": "LORA",
        "r": rank,
        "target_modules": targets if isinstance(targets, str) else sorted(targets),
        "task_type": "CAUSAL_LM",
    }


def lora_tensors(
    spec: BaseModelSpec,
    *,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    expert_targets: tuple[str, ...] = (),
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random finite LoRA weights (lora_B non-zero) for every layer, target (and expert)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def pair(layer: int, module: str, shape: tuple[int, int], expert: int | None) -> None:
        in_features, out_features = shape
        a = torch.randn(rank, in_features, generator=gen) * 0.02
        b = torch.randn(out_features, rank, generator=gen) * 0.02 + 0.001
        tensors[tensor_name(layer, module, "A", expert)] = a.to(dtype)
        tensors[tensor_name(layer, module, "B", expert)] = b.to(dtype)

    for layer in range(spec.num_layers):
        for module in targets:
            pair(layer, module, spec.module_shapes[module], None)
        for expert in range(spec.num_experts if expert_targets else 0):
            for module in expert_targets:
                pair(layer, module, spec.expert_module_shapes[module], expert)
    return tensors


def write_adapter_files(dest: Path, config: dict, tensors: dict[str, torch.Tensor], layout: str = "peft") -> Path:
    """Write a config and tensors as a PEFT directory or as one safetensors file per tensor."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if layout == "peft":
        save_file(tensors, dest / "adapter_model.safetensors", metadata={"format": "pt"})
    elif layout == "many_file":
        for i, (name, tensor) in enumerate(sorted(tensors.items())):
            save_file({name: tensor.contiguous()}, dest / f"{i:05d}-{name.split('.')[-3]}.safetensors")
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return dest


def write_lora_adapter(
    dest: Path,
    spec: BaseModelSpec,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    expert_targets: tuple[str, ...] = (),
    dtype: torch.dtype = torch.float16,
    layout: str = "peft",
    seed: int = 0,
) -> Path:
    """Write a valid LoRA adapter for `spec` into `dest` and return `dest`."""
    tensors = lora_tensors(spec, rank=rank, targets=targets, expert_targets=expert_targets, dtype=dtype, seed=seed)
    config = lora_config(rank=rank, alpha=alpha, targets=tuple(sorted(set(targets) | set(expert_targets))))
    return write_adapter_files(dest, config, tensors, layout)


def make_archive(src_dir: Path, dest: Path, kind: str) -> Path:
    """Pack the contents of `src_dir` (paths relative to it) as "tar", "tar.gz" or "zip" at `dest`."""
    files = sorted(p for p in src_dir.rglob("*"))
    if kind in ("tar", "tar.gz"):
        with tarfile.open(dest, "w:gz" if kind == "tar.gz" else "w") as tar:
            for path in files:
                tar.add(path, arcname=path.relative_to(src_dir).as_posix(), recursive=False)
    elif kind == "zip":
        with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for path in files:
                zf.write(path, arcname=path.relative_to(src_dir).as_posix())
    else:
        raise ValueError(f"unknown archive kind {kind!r}")
    return dest


def write_many_empty_zip(path: Path, count: int) -> Path:
    """A zip of `count` empty files, written byte by byte (zipfile takes seconds for 100k members).

    Over 65,535 entries a zip needs the ZIP64 end records, which are written here too.
    """
    local = bytearray()
    central = bytearray()
    for i in range(count):
        name = f"many/{i:06d}".encode()
        offset = len(local)
        # Local header: version 2.0, no flags, stored, 1980-01-01, crc 0, sizes 0.
        local += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, 0, 0, 0, len(name), 0) + name
        # Central header: made by Unix (3) 2.0, regular file 0644.
        central += (
            struct.pack(
                "<4s6H3L5H2L",
                b"PK\x01\x02",
                (3 << 8) | 20,
                20,
                0,
                0,
                0,
                0x21,
                0,
                0,
                0,
                len(name),
                0,
                0,
                0,
                0,
                0o100644 << 16,
                offset,
            )
            + name
        )
    cd_offset = len(local)
    zip64_offset = cd_offset + len(central)
    zip64_end = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(central), cd_offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, zip64_offset, 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, len(central), cd_offset, 0)
    path.write_bytes(bytes(local) + bytes(central) + zip64_end + locator + end)
    return path


def add_tar_member(tar: tarfile.TarFile, name: str, data: bytes = b"", **fields: object) -> None:
    """Add a member with exactly this name and these TarInfo fields (tarfile.add would sanitise them)."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for field, value in fields.items():
        setattr(info, field, value)
    tar.addfile(info, io.BytesIO(data) if data else None)


BAD_CASES: dict[str, str] = {
    "truncated_file": "truncated_file",
    "header_too_large": "header_too_large",
    "bad_header_json": "bad_safetensors",
    "wrong_shape": "shape_mismatch",
    "rank_mismatch": "rank_mismatch",
    "rank_too_high": "rank_too_high",
    "nan": "non_finite",
    "inf": "non_finite",
    "pickle_file": "pickle_forbidden",
    "missing_config": "missing_adapter_config",
    "not_lora": "bad_adapter_config",
    "no_tensors": "no_tensors",
    "bad_dtype": "bad_dtype",
    "unexpected_tensor": "unexpected_tensor",
    "layer_out_of_range": "unexpected_tensor",
    "unpaired": "unpaired_lora",
    "untargeted_module": "target_modules_mismatch",
    "duplicate_tensor": "bad_safetensors",
    "archive_dotdot": "archive_path_traversal",
    "archive_absolute": "archive_absolute_path",
    "archive_symlink": "archive_link",
    "archive_hardlink": "archive_link",
    "archive_fifo": "archive_special_file",
    "archive_too_many_files": "archive_too_many_files",
    "archive_too_large": "archive_too_large",
    "compression_bomb": "archive_compression_ratio",
    "zip_symlink": "archive_link",
    "zip_dotdot": "archive_path_traversal",
    "archive_corrupt": "bad_archive",
}


def make_bad_adapter(case: str, workdir: Path, spec: BaseModelSpec = TINY_DENSE) -> Path:
    """Build the BAD_CASES entry `case` under `workdir`: a directory, or an archive file for archive cases."""
    if case not in BAD_CASES:
        raise KeyError(case)
    workdir.mkdir(parents=True, exist_ok=True)
    adapter = workdir / case
    targets = ("q_proj", "v_proj")
    tensors = lora_tensors(spec, targets=targets)
    config = lora_config(targets=targets)
    q_a = tensor_name(0, "q_proj", "A")

    if case.startswith(("archive_", "zip_")) or case == "compression_bomb":
        return _make_bad_archive(case, workdir, spec)

    if case == "truncated_file":
        write_adapter_files(adapter, config, tensors)
        target = adapter / "adapter_model.safetensors"
        data = target.read_bytes()
        target.write_bytes(data[: len(data) - 100])
    elif case == "header_too_large":
        write_adapter_files(adapter, config, {})
        # Declares a 1 TiB header in a 16-byte file.
        (adapter / "adapter_model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}      ")
    elif case == "bad_header_json":
        write_adapter_files(adapter, config, {})
        header = b'{"not json'
        (adapter / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    elif case == "wrong_shape":
        tensors[q_a] = torch.randn(4, 63).half()
        write_adapter_files(adapter, config, tensors)
    elif case == "rank_mismatch":
        write_adapter_files(adapter, lora_config(rank=8, targets=targets), tensors)
    elif case == "rank_too_high":
        big = lora_tensors(spec, rank=spec.max_lora_rank * 2, targets=targets)
        write_adapter_files(adapter, lora_config(rank=spec.max_lora_rank * 2, targets=targets), big)
    elif case in ("nan", "inf"):
        b = tensors[tensor_name(1, "v_proj", "B")].clone()
        b[3, 1] = float("nan") if case == "nan" else float("inf")
        tensors[tensor_name(1, "v_proj", "B")] = b
        write_adapter_files(adapter, config, tensors)
    elif case == "pickle_file":
        write_adapter_files(adapter, config, tensors)
        (adapter / "extra").mkdir()
        (adapter / "extra" / "adapter_model.bin").write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    elif case == "missing_config":
        write_adapter_files(adapter, config, tensors)
        (adapter / "adapter_config.json").unlink()
    elif case == "not_lora":
        write_adapter_files(adapter, {**config, "peft_type": "PREFIX_TUNING"}, tensors)
    elif case == "no_tensors":
        write_adapter_files(adapter, config, tensors)
        (adapter / "adapter_model.safetensors").unlink()
    elif case == "bad_dtype":
        write_adapter_files(adapter, config, {k: v.double() for k, v in tensors.items()})
    elif case == "unexpected_tensor":
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(4, 128).half()
        write_adapter_files(adapter, config, tensors)
    elif case == "layer_out_of_range":
        tensors[tensor_name(spec.num_layers, "q_proj", "A")] = torch.randn(4, 64).half()
        tensors[tensor_name(spec.num_layers, "q_proj", "B")] = torch.randn(64, 4).half()
        write_adapter_files(adapter, config, tensors)
    elif case == "unpaired":
        del tensors[tensor_name(1, "q_proj", "B")]
        write_adapter_files(adapter, config, tensors)
    elif case == "untargeted_module":
        write_adapter_files(adapter, lora_config(targets=("q_proj",)), tensors)
    elif case == "duplicate_tensor":
        write_adapter_files(adapter, config, tensors, layout="many_file")
        save_file({q_a: tensors[q_a]}, adapter / "zz-copy.safetensors")
    return adapter


def _make_bad_archive(case: str, workdir: Path, spec: BaseModelSpec) -> Path:
    good = write_lora_adapter(workdir / f"{case}-src" / "adapter", spec)
    src = good.parent
    if case.startswith("zip_"):
        path = make_archive(src, workdir / f"{case}.zip", "zip")
        with zipfile.ZipFile(path, "a") as zf:
            if case == "zip_symlink":
                info = zipfile.ZipInfo("adapter/link.safetensors")
                info.create_system = 3
                info.external_attr = (0o120777 << 16) | 0x20
                zf.writestr(info, "/etc/passwd")
            else:
                zf.writestr("adapter/../../escaped.txt", b"gotcha")
        return path

    path = workdir / f"{case}.tar.gz"
    if case == "archive_corrupt":
        make_archive(src, path, "tar.gz")
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
        return path
    if case == "archive_too_many_files":
        return write_many_empty_zip(workdir / f"{case}.zip", ArchiveLimits().max_files + 1)

    # The good adapter first, so extraction has written files when it meets the bad member.
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src / "adapter", arcname="adapter")
        if case == "archive_dotdot":
            add_tar_member(tar, "adapter/../../escaped.txt", b"gotcha")
        elif case == "archive_absolute":
            add_tar_member(tar, "/tmp/mint-absolute.txt", b"gotcha")
        elif case == "archive_symlink":
            add_tar_member(tar, "adapter/link.safetensors", type=tarfile.SYMTYPE, linkname="/etc/passwd")
        elif case == "archive_hardlink":
            add_tar_member(
                tar, "adapter/hard.safetensors", type=tarfile.LNKTYPE, linkname="adapter/adapter_config.json"
            )
        elif case == "archive_fifo":
            add_tar_member(tar, "adapter/pipe", type=tarfile.FIFOTYPE)
        elif case == "archive_too_large":
            # Declares 5 GiB; the data is never there, and never needed to refuse it.
            info = tarfile.TarInfo("adapter/huge.dat")
            info.size = 5 * 1024**3
            tar.fileobj.write(info.tobuf(format=tar.format, encoding=tar.encoding, errors=tar.errors))
        elif case == "compression_bomb":
            add_tar_member(tar, "adapter/zeros.dat", bytes(8 * 1024 * 1024))
        else:
            raise KeyError(case)
    return path


def source_bytes(adapter: ValidatedAdapter) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of a validated adapter as (dtype, shape, raw bytes), by name: what an export must preserve."""
    found = {}
    for path in adapter.tensor_files:
        header = read_header(path, max_header_bytes=64 * 1024 * 1024)
        for name, info in header.tensors.items():
            found[name] = (info.dtype, info.shape, tensor_bytes(header, name))
    return found
