"""The framing of a safetensors file, read with bounds: 8 bytes little-endian length N, then N bytes of JSON.

The one place that reads a safetensors header off disk: `safetensors_io.read_header` parses
and checks what this returns (the control plane), and MinT's vLLM plugin scans it for the
expert-major description (mint_vllm_plugin.detect). Standard library only, so that the plugin
imports neither Django nor numpy nor torch through it.
"""

from __future__ import annotations

from pathlib import Path

from adapters.artifacts.errors import ArtifactError

# Bytes before the JSON header: its length, little-endian.
LENGTH_BYTES = 8


class HeaderBudget:
    """Header bytes still allowed across all the files of one adapter.

    Each file's header is bounded by itself; without a budget, many files each just under that
    bound would have their headers read and parsed again and again (and held, parsed, at once).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, path: Path, header_len: int) -> None:
        """Charge one file's declared header length; `header_too_large` once the adapter's total passes the limit."""
        if self.used + header_len > self.limit:
            raise ArtifactError(
                "header_too_large",
                f"The adapter's safetensors headers together exceed {self.limit} bytes (reached at {path.name}, "
                f"after {self.used} bytes in earlier files); put the tensors in fewer files, without padding "
                "or metadata in their headers.",
            )
        self.used += header_len


def read_header_bytes(path: Path, *, max_header_bytes: int, budget: HeaderBudget | None = None) -> tuple[bytes, int]:
    """The raw JSON header of a safetensors file and the file's size in bytes. Nothing is parsed.

    The header is refused above `max_header_bytes`, or when `budget` (shared by the files of
    one adapter) cannot pay for it, before any of it is read. ArtifactError (`truncated_file`,
    `header_too_large`) when the framing is wrong; OSError when the file cannot be read.
    """
    path = Path(path)
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(LENGTH_BYTES)
        if len(prefix) < LENGTH_BYTES:
            raise ArtifactError(
                "truncated_file",
                f"{path.name} is {file_size} bytes, too short to be a safetensors file; upload it again in full.",
            )
        header_len = int.from_bytes(prefix, "little")
        if header_len > max_header_bytes:
            raise ArtifactError(
                "header_too_large",
                f"{path.name} declares a {header_len}-byte safetensors header, above the limit of "
                f"{max_header_bytes} bytes; split the adapter into several files or check the file is not corrupt.",
            )
        if LENGTH_BYTES + header_len > file_size:
            raise ArtifactError(
                "truncated_file",
                f"{path.name} declares a {header_len}-byte header but the file is only {file_size} bytes; "
                "the upload was cut short, upload it again.",
            )
        if budget is not None:
            budget.take(path, header_len)
        raw = f.read(header_len)
    if len(raw) != header_len:
        raise ArtifactError("truncated_file", f"{path.name} changed while its header was read; upload it again.")
    return raw, file_size
