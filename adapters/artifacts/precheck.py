"""What registration can refuse at once, before a byte is stored or a revision number is spent.

Only what is cheap to see synchronously: the uploaded files' names, the adapter_config.json
(parsed with the bounded JSON reader, as validation parses it), an archive's first bytes and,
for a zip, its central directory (names only: nothing is decompressed). A tar is never walked
or decompressed here; validation unpacks it under the sandbox's bounds. Everything else (headers,
shapes, values) is validation's, in the background. The codes are validation's own, so a problem
reads the same whether it is seen now or later.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from adapters.artifacts.archive import HEAD_BYTES, ArchiveLimits, kind_of_head
from adapters.artifacts.archive_zip import zip_member_names
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.peft_config import MAX_CONFIG_BYTES, parse_adapter_config_data
from adapters.artifacts.validate import CONFIG_NAME, PEFT_TENSOR_FILE, PICKLE_SUFFIXES


@dataclass(frozen=True)
class Upload:
    """One uploaded file as registration will store it: its (clean, base) name and a seekable stream."""

    name: str
    stream: BinaryIO
    size: int


def precheck_upload(
    files: Sequence[Upload], *, sent_as_archive: bool, limits: ArchiveLimits, max_lora_rank: int | None = None
) -> None:
    """Raise `ArtifactError` if the upload obviously cannot be an adapter; return quietly otherwise.

    `sent_as_archive`: the one file came as the multipart `archive` field, so it must be an archive.
    A single file that is an archive (whatever its field) is checked as one. Streams are left at 0.
    """
    if len(files) == 1:
        kind = kind_of_head(_head(files[0]))
        if kind is not None:
            _check_archive(files[0], kind, limits)
            return
        if sent_as_archive:
            raise ArtifactError(
                "bad_archive", f"{files[0].name} is not a tar, tar.gz or zip archive; upload one of those as `archive`."
            )
    names = [f.name for f in files]
    _check_members(names, where="The upload")
    config = next(f for f in files if f.name == CONFIG_NAME)
    config.stream.seek(0)
    data = config.stream.read(MAX_CONFIG_BYTES + 1)
    config.stream.seek(0)
    parsed = parse_adapter_config_data(data, CONFIG_NAME)
    if max_lora_rank is not None and parsed.r > max_lora_rank:
        raise ArtifactError(
            "rank_too_high",
            f"{CONFIG_NAME} sets r = {parsed.r}, above this base model's limit of {max_lora_rank}; "
            f"train the adapter with rank {max_lora_rank} or less.",
        )


def _head(upload: Upload) -> bytes:
    upload.stream.seek(0)
    head = upload.stream.read(HEAD_BYTES)
    upload.stream.seek(0)
    return head


def _check_archive(upload: Upload, kind: str, limits: ArchiveLimits) -> None:
    if kind != "zip":
        return  # a tar is only unpacked by validation, under its bounds
    try:
        names = zip_member_names(
            upload.stream,
            upload.size,
            max_files=limits.max_files,
            max_directory_bytes=limits.max_zip_directory_bytes,
        )
    finally:
        upload.stream.seek(0)
    files = [name for name in names if name and not name.endswith("/")]
    _check_members(files, where=f"The archive {upload.name}")


def _check_members(paths: Sequence[str], *, where: str) -> None:
    """The names an adapter must (and must not) have: one adapter_config.json, safetensors next to it, no pickles."""
    pickles = sorted(p for p in paths if posixpath.basename(p).lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ArtifactError(
            "pickle_forbidden",
            f"{where} holds pickle-based checkpoints ({_listed(pickles)}), which can run code when loaded and are "
            "not accepted; export the adapter as safetensors (model.save_pretrained(..., safe_serialization=True)) "
            "and upload without the .bin/.pt files.",
        )
    configs = sorted(p for p in paths if posixpath.basename(p) == CONFIG_NAME)
    if not configs:
        raise ArtifactError(
            "missing_adapter_config",
            f"{where} has no {CONFIG_NAME} (it holds {_listed(sorted(paths))}); include the one PEFT's "
            "save_pretrained writes next to the adapter's safetensors.",
        )
    if len(configs) > 1:
        raise ArtifactError(
            "missing_adapter_config",
            f"{where} holds {len(configs)} {CONFIG_NAME} files ({_listed(configs)}); upload exactly one adapter.",
        )
    folder = posixpath.dirname(configs[0])
    if not any(p.endswith(".safetensors") and posixpath.dirname(p) == folder for p in paths):
        raise ArtifactError(
            "no_tensors",
            f"{where} has no .safetensors file next to {CONFIG_NAME}; upload the adapter's weights "
            f"({PEFT_TENSOR_FILE}, or one safetensors file per tensor) with it.",
        )


def _listed(names: Sequence[str], shown: int = 5) -> str:
    if not names:
        return "no files"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
