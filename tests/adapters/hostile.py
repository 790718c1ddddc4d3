"""Hostile uploads: inputs built to cost the control plane time or memory, each with the code it must end with.

Every builder writes one upload into an empty directory and returns the paths to upload
(one archive, or the files of an adapter directory, flat). `HOSTILE_CASES` lists them with
the `ArtifactError` code the validation task must end with under the default limits
(`ValidationLimits()`); `read_upload` reads an upload as the task does. The same corpus
drives tests/adapters/test_hostile_inputs.py, the end-to-end test through a Celery worker
and the benchmark, so builders stay fast (well under a few seconds) and compressed bombs
stay small on disk: what they expand to is never written out.

The bombs, and what reading them cost before the readers were bounded:
- target_modules regexes that backtrack for hours in Python's `re` on a 31-character path;
- a 415 KB .tar.gz whose GNU long name (or PAX header) is 400 MiB, which tarfile read whole
  (1.2 GiB peak);
- a 64 KiB PAX header of overlapping records, which tarfile's parser turned into 1 GiB of keys;
- a zip whose central directory lists 250,000 entries (12 MB), which zipfile made into
  95 MiB of ZipInfo objects before anyone could count them;
- JSON nested 100,000 deep, or a config of 5 MiB, and safetensors headers near the per-file
  limit in several files, each parsed in full.
"""

from __future__ import annotations

import json
import struct
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from adapters.artifacts.archive import archive_kind, extract_archive
from adapters.artifacts.spec import BaseModelSpec
from adapters.artifacts.validate import ValidatedAdapter, ValidationLimits, validate_adapter_dir
from tests.adapters.corpus import TINY_DENSE, lora_config, lora_tensors, write_adapter_files

MIB = 1024 * 1024
DEFAULTS = ValidationLimits()
SPEC: BaseModelSpec = TINY_DENSE  # the base model every hostile adapter is written for


@dataclass(frozen=True)
class HostileCase:
    """One hostile upload: how to build it and the `ArtifactError` code reading it must end with."""

    name: str
    code: str
    build: Callable[[Path], list[Path]]
    # Whether the refusal must also be cheap in memory (nothing it declares allocated whole).
    bounded_memory: bool = False
    # How long reading it may take before it counts as hung (a hang timeout, not a performance target).
    hang_timeout_s: float = 60.0
    note: str = ""


def read_upload(
    paths: list[Path], workdir: Path, spec: BaseModelSpec = SPEC, limits: ValidationLimits = DEFAULTS
) -> ValidatedAdapter:
    """Read an upload as the validation task does: one archive is unpacked under `workdir` first."""
    if len(paths) == 1 and archive_kind(paths[0]) is not None:
        unpacked = workdir / "unpacked"
        extract_archive(paths[0], unpacked, limits.archive)
        return validate_adapter_dir(unpacked, spec, limits)
    (root,) = {p.parent for p in paths}  # files are uploaded flat, by name
    return validate_adapter_dir(root, spec, limits)


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file())


# -- target_modules regexes --------------------------------------------------------------------

# Each fails to match every module path of the adapter (so the adapter ends target_modules_mismatch),
# and Python's re needs seconds at 24 characters and hours at 31 (model.layers.1.self_attn.v_proj).
CATASTROPHIC_PATTERNS: dict[str, str] = {
    "nested_star": r"(.*.*)*x",  # (.*.*)* : every split of the path between two stars, at every level
    "overlapping_alternation": r"(.|[a-z_.0-9])*!",  # (a|aa)*b: two branches take each character
    "adjacent_plus": r"([a-z_.0-9]+[a-z_.0-9]+)+!",  # (x+x+)+y
    "nested_plus": r"((.+)+)+!",  # nested quantifiers
}


def regex_adapter(pattern: str) -> Callable[[Path], list[Path]]:
    """A builder for a valid q_proj/v_proj adapter whose target_modules is `pattern`."""

    def build(dest: Path) -> list[Path]:
        tensors = lora_tensors(SPEC, targets=("q_proj", "v_proj"))
        return _files(write_adapter_files(dest, lora_config(targets=pattern), tensors))

    return build


# -- tar bombs -----------------------------------------------------------------------------------


def _gzip_of_repeats(head: bytes, fill: bytes, fill_bytes: int, tail: bytes) -> bytes:
    """The gzip of head + fill * n (fill_bytes in all) + tail, in milliseconds whatever fill_bytes is.

    The fill is compressed one MiB at a time with a full flush after each: a full flush resets
    deflate's state, so every full MiB compresses to the same bytes, computed once and repeated.
    """
    block = fill * (MIB // len(fill))
    whole, rest = divmod(fill_bytes, len(block))
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    out = [deflate.compress(head + block[:rest]) + deflate.flush(zlib.Z_FULL_FLUSH)]
    crc = zlib.crc32(head + block[:rest])
    if whole:
        piece = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
        out.append(piece * whole)
        for _ in range(whole):
            crc = zlib.crc32(block, crc)
    out.append(deflate.compress(tail) + deflate.flush())
    crc = zlib.crc32(tail, crc)
    size = len(head) + fill_bytes + len(tail)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"  # gzip, deflate, no name, mtime 0, max compression
    return header + b"".join(out) + struct.pack("<LL", crc & 0xFFFFFFFF, size & 0xFFFFFFFF)


def _header(name: str, *, kind: bytes = tarfile.REGTYPE, size: int = 0, fmt: int = tarfile.GNU_FORMAT) -> bytes:
    """One 512-byte tar header, exactly as given (no long-name or PAX headers added)."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    info.mode = 0o644
    return info.tobuf(format=fmt)


def _padding(size: int) -> bytes:
    return b"\0" * (-size % tarfile.BLOCKSIZE)


def _pax_record(key: str, value: str) -> bytes:
    """One PAX record, "<length> <key>=<value>\\n", whose length counts its own digits."""
    body = f" {key}={value}\n".encode()
    length = len(body)
    while length != len(str(length)) + len(body):
        length = len(str(length)) + len(body)
    return str(length).encode() + body


def _pax_member(path: Path, payload: bytes, *after: bytes) -> list[Path]:
    """A plain tar: a PAX extended header holding `payload`, then `after` (the member it applies to)."""
    return _plain_tar(
        path,
        _header("./PaxHeaders/x", kind=tarfile.XHDTYPE, size=len(payload), fmt=tarfile.USTAR_FORMAT),
        payload + _padding(len(payload)),
        *after,
    )


_END = b"\0" * (2 * tarfile.BLOCKSIZE)
BOMB_BYTES = 400 * MIB


def gnu_long_name_bomb(dest: Path) -> list[Path]:
    """A ~410 KB .tar.gz whose first member's GNU long name (type L) is 400 MiB of 'a'."""
    size = BOMB_BYTES + 1  # the name and its NUL
    head = _header("././@LongLink", kind=tarfile.GNUTYPE_LONGNAME, size=size)
    tail = b"\0" + _padding(size) + _header("adapter/x") + _END
    path = dest / "long-name.tar.gz"
    path.write_bytes(_gzip_of_repeats(head, b"a", BOMB_BYTES, tail))
    return [path]


def pax_header_bomb(dest: Path) -> list[Path]:
    """A ~410 KB .tar.gz whose first member has a 400 MiB PAX extended header (one `comment` record)."""
    prefix = f"{BOMB_BYTES} comment=".encode()
    head = _header("./PaxHeaders/x", kind=tarfile.XHDTYPE, size=BOMB_BYTES, fmt=tarfile.USTAR_FORMAT) + prefix
    tail = b"\n" + _padding(BOMB_BYTES) + _header("adapter/x", fmt=tarfile.USTAR_FORMAT) + _END
    path = dest / "pax-header.tar.gz"
    path.write_bytes(_gzip_of_repeats(head, b"a", BOMB_BYTES - len(prefix) - 1, tail))
    return [path]


def _plain_tar(path: Path, *blocks: bytes) -> list[Path]:
    path.write_bytes(b"".join(blocks) + _END)
    return [path]


def pax_overlapping_records(dest: Path) -> list[Path]:
    """A 64 KiB PAX header (within the size bound) of records "2 2 2 … =x": tarfile's regex read each as a new key."""
    payload = b"2 " * (32 * 1024 - 2) + b"=x\n"
    return _pax_member(dest / "pax-records.tar", payload, _header("adapter/x", fmt=tarfile.USTAR_FORMAT))


def pax_path_too_long(dest: Path) -> list[Path]:
    """A member whose PAX `path` is 10,000 bytes (within the PAX header bound, above the name bound)."""
    payload = _pax_record("path", "adapter/" + "d" * 9992)
    return _pax_member(dest / "pax-path.tar", payload, _header("adapter/x", fmt=tarfile.USTAR_FORMAT))


def long_name_chain(dest: Path) -> list[Path]:
    """Thirty GNU long-name headers in a row in front of one member (tarfile follows them by recursion)."""
    name = b"adapter/x\0"
    one = _header("././@LongLink", kind=tarfile.GNUTYPE_LONGNAME, size=len(name)) + name + _padding(len(name))
    return _plain_tar(dest / "chain.tar", one * 30, _header("adapter/x"))


def gnu_sparse_member(dest: Path) -> list[Path]:
    """An old-GNU sparse member (type S)."""
    return _plain_tar(
        dest / "sparse.tar",
        _header("adapter/sparse.bin", kind=tarfile.GNUTYPE_SPARSE, size=512),
        b"\0" * 512,
    )


def pax_gnu_sparse(dest: Path) -> list[Path]:
    """A PAX GNU sparse 1.0 member: tarfile would read as many map numbers as its first line claims."""
    records = {
        "GNU.sparse.major": "1",
        "GNU.sparse.minor": "0",
        "GNU.sparse.name": "adapter/sparse.bin",
        "GNU.sparse.realsize": str(1 << 40),
    }
    payload = b"".join(_pax_record(key, value) for key, value in records.items())
    sparse_map = b"99999999999\n"  # the number of map entries tarfile would go on reading
    return _pax_member(
        dest / "pax-sparse.tar",
        payload,
        _header("adapter/GNUSparseFile.0/sparse.bin", size=512, fmt=tarfile.USTAR_FORMAT),
        sparse_map + _padding(len(sparse_map)),
    )


def many_empty_files(dest: Path, count: int = DEFAULTS.archive.max_files) -> list[Path]:
    """A .tar.gz of `count` empty files (names many/000000 …), built from one header template.

    At the default `count` (exactly ArchiveLimits.max_files) the archive reader accepts it and
    writes 100,000 empty files; validation then finds no adapter_config.json.
    """
    template = bytearray(_header("many/000000"))
    template[148:156] = b"        "  # checksum field counts as spaces
    base = sum(template) - sum(b"many/000000")
    blocks = bytearray()
    for i in range(count):
        name = f"many/{i:06d}".encode()
        header = bytearray(template)
        header[0 : len(name)] = name
        header[148:156] = b"%06o\0 " % (base + sum(name))
        blocks += header
    path = dest / "many-empty.tar.gz"
    path.write_bytes(zlib.compress(bytes(blocks) + _END, 6, wbits=31))
    return [path]


# -- zip central directory -----------------------------------------------------------------------

ZIP_BOMB_ENTRIES = 250_000


def _zip_directory_only(path: Path, entries: int, claimed: int) -> list[Path]:
    """A zip of one empty member listed `entries` times in its central directory, whose end records claim `claimed`."""
    name = b"a"
    # Central directory entry: made by Unix 2.0, stored, no data, a regular file 0644 at offset 0.
    fields = {"made_by": (3 << 8) | 20, "needs": 20, "flags": 0, "method": 0, "time": 0, "date": 0x21}
    sizes = {"crc": 0, "compressed": 0, "size": 0, "name": len(name), "extra": 0, "comment": 0}
    placement = {"disk": 0, "internal": 0, "external": 0o100644 << 16, "offset": 0}
    entry = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", *fields.values(), *sizes.values(), *placement.values())
    directory = (entry + name) * entries
    # One local header up front, as every zip writer puts there (and as archive_kind looks for).
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, 0, 0, 0, len(name), 0) + name
    zip64_end = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, claimed, claimed, len(directory), len(local))
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, len(local) + len(directory), 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    path.write_bytes(local + directory + zip64_end + locator + end)
    return [path]


def zip_directory_bomb(dest: Path) -> list[Path]:
    """A 12 MB zip whose central directory lists (and claims) 250,000 entries."""
    return _zip_directory_only(dest / "directory.zip", ZIP_BOMB_ENTRIES, ZIP_BOMB_ENTRIES)


def zip_hidden_entries(dest: Path) -> list[Path]:
    """The same directory, but the end records claim one entry: zipfile reads entries by size, not by count."""
    return _zip_directory_only(dest / "hidden.zip", ZIP_BOMB_ENTRIES, 1)


# -- JSON ------------------------------------------------------------------------------------------

DEEP = 100_000


def _valid_adapter(dest: Path, config: dict | None = None) -> Path:
    return write_adapter_files(dest, config or lora_config(), lora_tensors(SPEC))


def deep_config(dest: Path) -> list[Path]:
    """An adapter whose adapter_config.json holds an array nested 100,000 deep (200 KB)."""
    _valid_adapter(dest)
    text = json.dumps(lora_config())[:-1] + ', "x": ' + "[" * DEEP + "]" * DEEP + "}"
    (dest / "adapter_config.json").write_text(text)
    return _files(dest)


def huge_config(dest: Path) -> list[Path]:
    """An adapter whose adapter_config.json is 5 MiB (a valid config with a long `notes` field)."""
    _valid_adapter(dest, {**lora_config(), "notes": "n" * (5 * MIB)})
    return _files(dest)


def _raw_safetensors(path: Path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def deep_header(dest: Path) -> list[Path]:
    """An adapter whose safetensors header holds an array nested 100,000 deep."""
    _valid_adapter(dest)
    _raw_safetensors(dest / "adapter_model.safetensors", b'{"a": ' + b"[" * DEEP + b"]" * DEEP + b"}")
    return _files(dest)


def near_limit_headers(dest: Path, files: int = 3, header_bytes: int = DEFAULTS.max_header_bytes - 4096) -> list[Path]:
    """A many-file adapter whose first `files` files each have a header just under the per-file limit.

    Each header is valid: the tensor's entry and a long `__metadata__` value (a training log,
    say). Together they pass `ValidationLimits.max_total_header_bytes` (3 x 32 MiB > 64 MiB).
    """
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "adapter_config.json").write_text(json.dumps(lora_config()))
    for i, (name, tensor) in enumerate(sorted(lora_tensors(SPEC).items())):
        path = dest / f"{i:05d}.safetensors"
        if i >= files:
            save_file({name: tensor}, path)
            continue
        entry = {"dtype": "F16", "shape": list(tensor.shape), "data_offsets": [0, tensor.numel() * 2]}
        empty = json.dumps({"__metadata__": {"log": ""}, name: entry}).encode()
        header = json.dumps({"__metadata__": {"log": "l" * (header_bytes - len(empty))}, name: entry}).encode()
        _raw_safetensors(path, header, tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return _files(dest)


HOSTILE_CASES: list[HostileCase] = [
    *[
        HostileCase(f"regex_{shape}", "target_modules_mismatch", regex_adapter(pattern))
        for shape, pattern in CATASTROPHIC_PATTERNS.items()
    ],
    HostileCase("regex_backreference", "bad_adapter_config", regex_adapter(r"(.*)\1(q|v)_proj")),
    HostileCase("regex_lookahead", "bad_adapter_config", regex_adapter(r"(?=.*q_proj).*")),
    HostileCase("regex_too_long", "bad_adapter_config", regex_adapter("(" + "|".join(["q_proj"] * 200) + ")")),
    HostileCase("tar_gnu_long_name_bomb", "archive_name_too_long", gnu_long_name_bomb, bounded_memory=True),
    HostileCase("tar_pax_header_bomb", "archive_header_too_large", pax_header_bomb, bounded_memory=True),
    HostileCase("tar_pax_overlapping_records", "bad_archive", pax_overlapping_records, bounded_memory=True),
    HostileCase("tar_pax_path_too_long", "archive_name_too_long", pax_path_too_long),
    HostileCase("tar_long_name_chain", "archive_header_too_large", long_name_chain),
    HostileCase("tar_gnu_sparse_member", "archive_sparse_file", gnu_sparse_member),
    HostileCase("tar_pax_gnu_sparse", "archive_sparse_file", pax_gnu_sparse),
    HostileCase(
        "tar_many_empty_files",
        "missing_adapter_config",
        many_empty_files,
        # Writing 100,000 files takes 20-40 s on a busy 2-core machine.
        hang_timeout_s=180.0,
        note="exactly ArchiveLimits.max_files members: unpacked, then no adapter_config.json",
    ),
    HostileCase("zip_directory_bomb", "archive_too_many_files", zip_directory_bomb, bounded_memory=True),
    HostileCase("zip_hidden_entries", "archive_too_many_files", zip_hidden_entries, bounded_memory=True),
    HostileCase("json_deep_config", "bad_adapter_config", deep_config, bounded_memory=True),
    HostileCase("json_huge_config", "bad_adapter_config", huge_config, bounded_memory=True),
    HostileCase("json_deep_header", "bad_safetensors", deep_header, bounded_memory=True),
    HostileCase("safetensors_near_limit_headers", "header_too_large", near_limit_headers),
]
