"""Reading and writing safetensors files without pickle and without trusting the header.

The format: 8 bytes little-endian header length N, N bytes of JSON (`{name: {dtype, shape,
data_offsets: [start, end]}, "__metadata__": {str: str}}`, may be padded with spaces), then
the data section; offsets are relative to the data section. `read_header` checks the header
(read off disk by `safetensors_header`) against the file before anyone reads a tensor from it;
`first_non_finite` scans the tensor data a chunk at a time; `write_safetensors` streams
tensors to disk one at a time and produces byte-identical files for identical input.

Nothing here but `iter_tensors` needs torch (safetensors imports it for framework="pt"), and
this module does not import it: validation runs in a forked child process on tenant files and
reads headers and raw bytes only.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError, safe_open

from adapters.artifacts.bounded_json import JsonBoundExceeded, check_json_bounds
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.safetensors_header import LENGTH_BYTES, HeaderBudget, read_header_bytes

if TYPE_CHECKING:
    import torch

# Bits per element, for every dtype name the safetensors format defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "C64": 64,
}

METADATA_KEY = "__metadata__"
COPY_CHUNK_BYTES = 1024 * 1024
# A valid header nests three levels ({name: {"shape": [...]}}); unknown keys inside an entry are
# ignored (as the reference reader does), so allow some room, but not a parser's whole stack.
MAX_HEADER_DEPTH = 16
# The tensor data is checked for NaN/Inf this many bytes at a time: memory stays at one chunk
# whatever the size of a tensor.
NON_FINITE_CHUNK_BYTES = 4 * 1024 * 1024

# For each float dtype: the unsigned integer type of one element (little-endian, as safetensors
# stores it) and the exponent bits that are all set exactly when the value is NaN or infinite.
_EXPONENT_MASKS: dict[str, tuple[str, int]] = {
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F32": ("<u4", 0x7F800000),
    "F64": ("<u8", 0x7FF0000000000000),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header; `start`/`end` are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked header: every tensor lies inside the file and the tensors tile the data section."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_offset: int


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes a tensor of this dtype and shape occupies, or None when it is not a whole number of bytes."""
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    return bits // 8 if bits % 8 == 0 else None


def read_header(path: Path, *, max_header_bytes: int, budget: HeaderBudget | None = None) -> SafetensorsHeader:
    """Read and check the header of a safetensors file (nothing is unpickled; no tensor is read).

    The header is refused above `max_header_bytes`, or when `budget` (shared by the files of
    one adapter) cannot pay for it, before any of it is read.
    """
    path = Path(path)
    raw, file_size = read_header_bytes(path, max_header_bytes=max_header_bytes, budget=budget)
    header_len = len(raw)
    data_offset = LENGTH_BYTES + header_len
    data_len = file_size - data_offset

    def bad(reason: str) -> ArtifactError:
        return ArtifactError("bad_safetensors", f"{path.name} is not a valid safetensors file: {reason}")

    if not raw.startswith(b"{"):
        # The reference reader refuses anything else too (leading whitespace included).
        raise bad("its header does not start with '{'.")
    try:
        # The length was bounded above; the nesting is bounded before the parser recurses into it.
        check_json_bounds(raw, max_bytes=header_len, max_depth=MAX_HEADER_DEPTH)
        parsed = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except JsonBoundExceeded as exc:
        raise bad(f"its header is {exc}, which no safetensors writer produces.") from exc
    except _DuplicateKey as exc:
        raise bad(f"the header lists {exc.args[0]!r} twice.") from exc
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise bad(f"its header is not valid JSON ({exc}).") from exc
    if not isinstance(parsed, dict):
        raise bad("its header is not a JSON object.")

    metadata = parsed.pop(METADATA_KEY, None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("its __metadata__ must map strings to strings.")

    tensors: dict[str, TensorInfo] = {}
    for name, entry in parsed.items():
        if not isinstance(entry, dict):
            raise bad(f"the entry for tensor {name!r} is not an object.")
        dtype = entry.get("dtype")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise bad(f"tensor {name!r} has unknown dtype {dtype!r}.")
        if not isinstance(shape, list) or not all(_is_index(d) for d in shape):
            raise bad(f"tensor {name!r} has an invalid shape {shape!r}.")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_index(o) for o in offsets):
            raise bad(f"tensor {name!r} has invalid data_offsets {offsets!r}.")
        start, end = offsets
        if end < start:
            raise bad(f"tensor {name!r} ends (byte {end}) before it starts (byte {start}).")
        nbytes = expected_nbytes(dtype, tuple(shape))
        if nbytes != end - start:
            raise bad(
                f"tensor {name!r} is {dtype} {list(shape)}, which needs {nbytes} bytes, "
                f"but its offsets cover {end - start}."
            )
        tensors[name] = TensorInfo(name=name, dtype=dtype, shape=tuple(shape), start=start, end=end)

    # The tensors must tile the data section: in order, no gaps, no overlaps, nothing after.
    position = 0
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != position:
            what = "overlaps the previous tensor" if info.start < position else "leaves a gap before it"
            raise bad(f"tensor {info.name!r} starts at byte {info.start}, which {what}.")
        position = info.end
    if position > data_len:
        raise ArtifactError(
            "truncated_file",
            f"{path.name} needs {position} bytes of tensor data but holds only {data_len}; "
            "the upload was cut short, upload it again.",
        )
    if position < data_len:
        raise bad(f"{data_len - position} bytes follow the last tensor.")
    return SafetensorsHeader(path=path, tensors=tensors, metadata=dict(metadata), data_offset=data_offset)


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def first_non_finite(header: SafetensorsHeader, *, chunk_bytes: int = NON_FINITE_CHUNK_BYTES) -> str | None:
    """The name of the first tensor (in file order) holding a NaN or an infinity, or None; reads no tensor whole.

    Float tensors (F16, BF16, F32, F64) are read straight from the file `chunk_bytes` at a
    time, whatever their size, and a value is non-finite exactly when all its exponent bits are
    set; other dtypes cannot hold NaN and are skipped. Check the file with `read_header` first.
    """
    runs = _float_runs(header)
    if not runs:
        return None
    buffer = np.empty(max(chunk_bytes, 8), dtype=np.uint8)
    with open(header.path, "rb") as f:
        for dtype, tensors in runs:
            element, mask = _EXPONENT_MASKS[dtype]
            itemsize = np.dtype(element).itemsize
            # Whole elements per read, so no value straddles two chunks.
            step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
            begin, end = tensors[0].start, tensors[-1].end
            f.seek(header.data_offset + begin)
            position = begin
            while position < end:
                want = min(step, end - position)
                got = f.readinto(memoryview(buffer)[:want])
                if got != want:
                    raise ArtifactError(
                        "truncated_file",
                        f"{header.path.name} ends inside its tensor data; "
                        "the file changed or was cut short, upload it again.",
                    )
                values = buffer[:want].view(element)
                hits = np.flatnonzero((values & mask) == mask)
                if hits.size:
                    offset = position + int(hits[0]) * itemsize
                    # Tensors of a run are contiguous and sorted: the one holding `offset` starts last at or before it.
                    index = bisect.bisect_right([t.start for t in tensors], offset) - 1
                    return tensors[index].name
                position += want
    return None


def _float_runs(header: SafetensorsHeader) -> list[tuple[str, list[TensorInfo]]]:
    """The header's non-empty float tensors in file order, grouped into runs of one dtype lying back to back."""
    runs: list[tuple[str, list[TensorInfo]]] = []
    for info in sorted(header.tensors.values(), key=lambda t: (t.start, t.end)):
        if info.dtype not in _EXPONENT_MASKS or info.nbytes == 0:
            continue
        if runs and runs[-1][0] == info.dtype and runs[-1][1][-1].end == info.start:
            runs[-1][1].append(info)
        else:
            runs.append((info.dtype, [info]))
    return runs


def iter_tensors(path: Path, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time through safetensors' own loader (memory-mapped, no pickle).

    Without `names`, every tensor in the file in sorted order. Check the file with
    `read_header` first: this trusts safetensors to refuse what it cannot read.
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            wanted = sorted(f.keys()) if names is None else list(names)
            for name in wanted:
                yield name, f.get_tensor(name)
    except (SafetensorError, RuntimeError) as exc:
        raise ArtifactError("bad_safetensors", f"{path.name} could not be read as safetensors: {exc}") from exc


def tensor_bytes(header: SafetensorsHeader, name: str) -> bytes:
    """The raw (little-endian) bytes of one tensor, read straight from its file. KeyError if absent."""
    info = header.tensors[name]
    with open(header.path, "rb") as f:
        f.seek(header.data_offset + info.start)
        data = f.read(info.nbytes)
    if len(data) != info.nbytes:
        raise ArtifactError(
            "truncated_file",
            f"{header.path.name} ends inside tensor {name!r}; the file changed or was cut short, upload it again.",
        )
    return data


def write_safetensors(
    path: Path,
    tensors: Iterable[tuple[str, str, tuple[int, ...], bytes | memoryview]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write (name, dtype, shape, raw bytes) tensors, in the order given, as a safetensors file.

    `tensors` may be a generator: each tensor's bytes are spooled to a temporary file next to
    `path` as they arrive (the header, which precedes the data, is only known at the end), so
    no more than one tensor is held in memory. The header is JSON with sorted keys and no
    whitespace, padded with spaces to a multiple of 8 bytes; identical input gives an
    identical file. `path` is replaced atomically, so it is never seen half written.
    Raises ValueError on an unknown dtype, a duplicate name or bytes that do not match the shape.
    """
    path = Path(path)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map strings to strings")
    entries: dict[str, dict] = {}
    position = 0
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory) as spool:
        for name, dtype, shape, data in tensors:
            if name == METADATA_KEY or name in entries:
                raise ValueError(f"tensor name {name!r} is reserved or repeated")
            if dtype not in DTYPE_BITS:
                raise ValueError(f"tensor {name!r}: unknown safetensors dtype {dtype!r}")
            shape = tuple(int(d) for d in shape)
            view = memoryview(data)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            if expected_nbytes(dtype, shape) != view.nbytes:
                raise ValueError(f"tensor {name!r}: {view.nbytes} bytes do not match {dtype} {list(shape)}")
            spool.write(view)
            entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + view.nbytes]}
            position += view.nbytes
            # Drop this tensor before asking the generator for the next one.
            view.release()
            del view, data
        if metadata:
            entries[METADATA_KEY] = dict(metadata)
        header = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode("utf-8")
        header += b" " * (-len(header) % 8)

        spool.seek(0)
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
        try:
            # mkstemp makes the file private; exports are read by other processes (the engine).
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "wb") as out:
                out.write(len(header).to_bytes(8, "little"))
                out.write(header)
                while chunk := spool.read(COPY_CHUNK_BYTES):
                    out.write(chunk)
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
