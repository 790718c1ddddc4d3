"""Hostile uploads end with their own code, bounded in time and memory; the bounded readers they rely on."""

from __future__ import annotations

import json
import multiprocessing
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from adapters.artifacts import bounded_json
from adapters.artifacts.bounded_json import JsonBoundExceeded, check_json_bounds, nesting_depth, read_json_file
from adapters.artifacts.errors import CODES, ArtifactError
from adapters.artifacts.safetensors_io import first_non_finite, read_header, write_safetensors
from tests.adapters.hostile import HOSTILE_CASES, HostileCase, read_upload

# Hang timeouts (HostileCase.hang_timeout_s, 60 s unless a case needs more), not performance targets:
# a reader that backtracks or allocates a bomb whole takes minutes to hours, a bounded one seconds.
# Far below what reading any bomb whole costs (400 MiB names, 1 GiB of PAX keys, 90 MiB of ZipInfo).
MEMORY_BOUND = 64 * 1024 * 1024
MIB = 1024 * 1024


def _read_in_child(paths: list[Path], workdir: Path, trace: bool, send) -> None:
    if trace:
        tracemalloc.start()
    try:
        read_upload(paths, workdir)
        outcome = ("accepted", "")
    except ArtifactError as exc:
        outcome = (exc.code, exc.message)
    except BaseException as exc:  # reported to the parent, which fails the test
        outcome = ("crashed", f"{type(exc).__name__}: {exc}")
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    send.send((*outcome, peak))
    send.close()


def read_in_child(paths: list[Path], workdir: Path, *, trace: bool, timeout_s: float) -> tuple[str, str, int]:
    """Read an upload as the task does, in a forked child that is killed after `timeout_s`.

    Returns (code or "accepted", message, tracemalloc peak in bytes or 0). A child is used so
    that a reader stuck inside C code (a backtracking regex) cannot hang the suite.
    """
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_read_in_child, args=(paths, workdir, trace, send))
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            pytest.fail(f"reading {[p.name for p in paths]} did not end within {timeout_s:g} s")
        return receive.recv()
    finally:
        child.kill()
        child.join()


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=lambda case: case.name)
def test_hostile_upload_ends_with_its_code(tmp_path, case: HostileCase):
    assert case.code in CODES
    upload = tmp_path / "upload"
    upload.mkdir()
    paths = case.build(upload)
    code, message, peak = read_in_child(
        paths, tmp_path / "work", trace=case.bounded_memory, timeout_s=case.hang_timeout_s
    )
    assert code == case.code, message
    assert len(message) > 30
    if case.bounded_memory:
        assert peak < MEMORY_BOUND, f"peak {peak / MIB:.0f} MiB"
    unpacked = tmp_path / "work" / "unpacked"
    if code.startswith(("archive_", "bad_archive")):
        assert not unpacked.exists() or list(unpacked.rglob("*")) == []


def test_the_corpus_names_are_unique_and_cover_every_bound():
    names = [case.name for case in HOSTILE_CASES]
    assert len(names) == len(set(names))
    codes = {case.code for case in HOSTILE_CASES}
    for code in ("archive_name_too_long", "archive_header_too_large", "archive_sparse_file", "header_too_large"):
        assert code in codes


def test_validation_does_not_import_torch():
    # Validation runs in a forked child on tenant files; it reads headers and raw bytes only.
    script = "import sys, adapters.artifacts.validate; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2]).returncode == 0


# -- the bounded JSON reader -------------------------------------------------------------------------


def reference_depth(data: bytes) -> int:
    """Nesting depth by walking the text one byte at a time: what the scan must agree with."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == ord("\\"):
                escaped = True
            elif byte == ord('"'):
                in_string = False
        elif byte == ord('"'):
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ('"[[{"', 0),
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('["[[[[", "}}}", "{"]', 1),
        (r'["\"[[[", []]', 2),  # an escaped quote does not end the string
        (r'["\\", [[]]]', 3),  # an escaped backslash does not escape the quote after it
        (r'["\\\"[", [[]]]', 3),  # three backslashes: the quote is escaped, the string goes on
        ('["é[", {"ключ": [[]]}]', 4),  # multi-byte UTF-8 around brackets
        ("[" * 1000 + "]" * 1000, 1000),
    ],
)
def test_nesting_depth_skips_strings_and_escapes(text, depth):
    data = text.encode()
    assert nesting_depth(data) == depth == reference_depth(data)


def random_document(rng: random.Random, level: int = 0) -> object:
    if level > 6 or rng.random() < 0.3:
        return rng.choice([1, -2.5, None, True, "", "[{", '"]}', "\\", '\\"[', "é[]"])
    if rng.random() < 0.5:
        return [random_document(rng, level + 1) for _ in range(rng.randint(0, 4))]
    keys = ["k", "[", '"{', "\\"]
    return {f"{rng.choice(keys)}{i}": random_document(rng, level + 1) for i in range(rng.randint(0, 4))}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_nesting_depth_is_the_same_across_chunk_boundaries(monkeypatch, chunk):
    # Tiny chunks put every quote, backslash run and bracket on a chunk boundary somewhere.
    monkeypatch.setattr(bounded_json, "SCAN_CHUNK_BYTES", chunk)
    rng = random.Random(chunk)
    for _ in range(200):
        data = json.dumps(random_document(rng), ensure_ascii=rng.random() < 0.5).encode()
        assert nesting_depth(data) == reference_depth(data), data
    # Nine backslashes escape the quote after them (the string goes on); eight do not.
    assert nesting_depth(b'["' + b"\\" * 9 + b'"[[[[["]') == 1
    assert nesting_depth(b'["' + b"\\" * 8 + b'"[[[[["]') == 6


def test_nesting_depth_stops_once_the_bound_is_passed():
    # It stops after the chunk in which the depth passes the bound, not at the end of the document.
    assert 64 < nesting_depth(b"[" * 10_000_000, stop_above=64) <= bounded_json.SCAN_CHUNK_BYTES


def test_check_json_bounds_refuses_size_and_depth():
    check_json_bounds(b"[[[]]]", max_bytes=6, max_depth=3)
    with pytest.raises(JsonBoundExceeded) as caught:
        check_json_bounds(b"[[[]]]", max_bytes=5, max_depth=3)
    assert (caught.value.what, caught.value.found, caught.value.limit) == ("size", 6, 5)
    with pytest.raises(JsonBoundExceeded) as caught:
        check_json_bounds(b"[[[]]]", max_bytes=6, max_depth=2)
    assert (caught.value.what, caught.value.found) == ("depth", 3)
    check_json_bounds(b'["[[[[[[[[["]', max_bytes=100, max_depth=1)


def test_read_json_file_refuses_before_parsing_and_parses_within_the_bounds(tmp_path):
    path = tmp_path / "doc.json"
    path.write_text(json.dumps({"a": [1, {"b": "[[["}]}))
    assert read_json_file(path, max_bytes=100, max_depth=3) == {"a": [1, {"b": "[[["}]}
    with pytest.raises(JsonBoundExceeded, match="levels deep"):
        read_json_file(path, max_bytes=100, max_depth=2)
    path.write_bytes(b"[" + b" " * (8 * MIB) + b"]")
    tracemalloc.start()
    try:
        with pytest.raises(JsonBoundExceeded) as caught:
            read_json_file(path, max_bytes=MIB, max_depth=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.what == "size" and caught.value.found == 8 * MIB + 2
    assert peak < MIB  # refused from the file's size, nothing read


def test_deep_documents_are_refused_before_the_parser_recurses():
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(JsonBoundExceeded):
        bounded_json.loads_bounded(deep, max_bytes=len(deep), max_depth=64)
    assert bounded_json.loads_bounded(b'{"a": [[1]]}', max_bytes=100, max_depth=3) == {"a": [[1]]}


# -- the chunked non-finite check --------------------------------------------------------------------

DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    names = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}
    entries = [
        (n, names[t.dtype], tuple(t.shape), t.contiguous().view(torch.uint8).numpy()) for n, t in tensors.items()
    ]
    write_safetensors(path, entries)
    return path


def non_finite_in(path: Path) -> str | None:
    return first_non_finite(read_header(path, max_header_bytes=MIB))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_found_in_each_dtype(tmp_path, dtype, bad):
    torch_dtype = DTYPES[dtype]
    info = torch.finfo(torch_dtype)
    edge = torch.tensor([0.0, -0.0, info.max, info.min, info.tiny, info.tiny / 4, info.eps, 1.0], dtype=torch_dtype)
    clean = {"a": torch.randn(8, 5).to(torch_dtype), "edge": edge}
    assert (
        first_non_finite(read_header(write_tensors(tmp_path / "ok.safetensors", clean), max_header_bytes=MIB)) is None
    )
    broken = clean["a"].clone()
    broken[7, 4] = bad
    assert non_finite_in(write_tensors(tmp_path / "bad.safetensors", {**clean, "a": broken})) == "a"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("index", [15, 16, 31, 32, 999])
def test_non_finite_values_are_found_on_and_around_chunk_boundaries(tmp_path, dtype, index):
    # 64-byte chunks: 16 F32 or 32 F16/BF16 values each; the bad value sits before, on and after boundaries.
    torch_dtype = DTYPES[dtype]
    tensors = {"first": torch.ones(7, dtype=torch_dtype), "second": torch.ones(1000, dtype=torch_dtype)}
    tensors["second"][index] = float("nan")
    header = read_header(write_tensors(tmp_path / "t.safetensors", tensors), max_header_bytes=MIB)
    assert first_non_finite(header, chunk_bytes=64) == "second"
    assert first_non_finite(header, chunk_bytes=7) == "second"  # not a multiple of the element size
    assert first_non_finite(header, chunk_bytes=1) == "second"  # less than one element


def test_non_finite_check_reads_a_tensor_larger_than_a_chunk_a_chunk_at_a_time(tmp_path):
    path = tmp_path / "big.safetensors"
    count = 8 * MIB  # 32 MiB of F32, eight 4 MiB chunks
    values = np.zeros(count, dtype=np.float32)
    values[-1] = np.inf
    write_safetensors(path, [("small", "F32", (4,), np.ones(4, dtype=np.float32)), ("big", "F32", (count,), values)])
    del values
    header = read_header(path, max_header_bytes=MIB)
    tracemalloc.start()
    try:
        assert first_non_finite(header) == "big"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MIB, f"peak {peak / MIB:.1f} MiB for a 32 MiB tensor"


def test_non_float_and_empty_tensors_are_skipped(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(
        path,
        [
            ("steps", "I32", (2,), np.array([0x7F800000, -1], dtype=np.int32)),  # NaN's bits, but an integer
            ("empty", "F32", (0, 4), b""),
            ("w", "F16", (2,), np.ones(2, dtype=np.float16)),
        ],
    )
    assert non_finite_in(path) is None
