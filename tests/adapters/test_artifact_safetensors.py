"""Reading safetensors without trusting the header, and the streaming, deterministic writer."""

from __future__ import annotations

import gc
import json
import struct
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.safetensors_header import HeaderBudget
from adapters.artifacts.safetensors_io import (
    MAX_HEADER_DEPTH,
    iter_tensors,
    read_header,
    tensor_bytes,
    write_safetensors,
)

LIMIT = 64 * 1024 * 1024
DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}


def raw(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes as stored in safetensors (little-endian; this machine is little-endian)."""
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def entries(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    return [(name, DTYPE_NAMES[t.dtype], tuple(t.shape), raw(t)) for name, t in tensors.items()]


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "b.weight": torch.randn(3, 5, generator=gen).half(),  # 30 bytes: leaves the next tensor unaligned
        "a.weight": torch.randn(7, generator=gen),
        "c.bias": torch.randn(2, 3, generator=gen).bfloat16(),
        "d.steps": torch.arange(5),
        "e.empty": torch.zeros(0, 4),
    }


def write_raw(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def assert_refused(path: Path, code: str, **kwargs) -> ArtifactError:
    with pytest.raises(ArtifactError) as caught:
        read_header(path, max_header_bytes=kwargs.get("max_header_bytes", LIMIT))
    assert caught.value.code == code, caught.value.message
    assert path.name in caught.value.message
    return caught.value


def test_read_header_matches_what_safetensors_wrote(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    header = read_header(path, max_header_bytes=LIMIT)
    assert header.path == path
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(tensors)
    for name, tensor in tensors.items():
        info = header.tensors[name]
        assert info.name == name
        assert info.dtype == DTYPE_NAMES[tensor.dtype]
        assert info.shape == tuple(tensor.shape)
        assert tensor_bytes(header, name) == raw(tensor)
    assert header.data_offset + max(i.end for i in header.tensors.values()) == path.stat().st_size


def test_iter_tensors_yields_every_tensor_or_the_ones_asked_for(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    got = dict(iter_tensors(path))
    assert list(got) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(got[name], tensor)
    assert [name for name, _ in iter_tensors(path, ["c.bias", "a.weight"])] == ["c.bias", "a.weight"]


def test_iter_tensors_turns_safetensors_errors_into_artifact_errors(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", b"not json")
    with pytest.raises(ArtifactError) as caught:
        list(iter_tensors(path))
    assert caught.value.code == "bad_safetensors"


def test_header_length_above_the_limit_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 50))  # declares a petabyte of header in 8 bytes
    error = assert_refused(path, "header_too_large")
    assert str(LIMIT) in error.message
    ok = write_raw(tmp_path / "ok.safetensors", b"{}" + b" " * 98)
    assert_refused(ok, "header_too_large", max_header_bytes=99)
    assert read_header(ok, max_header_bytes=100).tensors == {}


@pytest.mark.parametrize("cut", [0, 5, 8, 20, -1])
def test_truncated_files_are_refused(tmp_path, cut):
    full = tmp_path / "full.safetensors"
    save_file(sample_tensors(), full)
    data = full.read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[:cut])
    assert_refused(path, "truncated_file")


def entry(dtype: str = "F32", shape: list | None = None, offsets: list | None = None) -> dict:
    return {"dtype": dtype, "shape": [2] if shape is None else shape, "data_offsets": offsets or [0, 8]}


@pytest.mark.parametrize(
    ("header", "data"),
    [
        pytest.param(b"{not json", b"", id="invalid-json"),
        pytest.param(b"\xff\xfe{}", b"", id="not-utf8"),
        pytest.param(b"[1, 2]", b"", id="not-an-object"),
        pytest.param(b' {"a": 1}', b"", id="leading-space"),
        pytest.param(b'{"a": 1}', b"", id="entry-not-an-object"),
        pytest.param({"a": entry(dtype="F17")}, bytes(8), id="unknown-dtype"),
        pytest.param({"a": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8), id="missing-dtype"),
        pytest.param({"a": entry(shape=[-2])}, bytes(8), id="negative-dim"),
        pytest.param({"a": entry(shape=[True, 2])}, bytes(8), id="bool-dim"),
        pytest.param({"a": entry(shape="2")}, bytes(8), id="shape-not-a-list"),
        pytest.param({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), id="missing-offsets"),
        pytest.param({"a": entry(offsets=[8, 0])}, bytes(8), id="reversed-offsets"),
        pytest.param({"a": entry(offsets=[0, 4])}, bytes(4), id="size-does-not-match-shape"),
        pytest.param({"a": entry(offsets=[0, 8]), "b": entry(offsets=[4, 12])}, bytes(12), id="overlap"),
        pytest.param({"a": entry(offsets=[0, 8]), "b": entry(offsets=[12, 20])}, bytes(20), id="gap"),
        pytest.param({"a": entry(offsets=[4, 12])}, bytes(12), id="gap-at-start"),
        pytest.param({"a": entry()}, bytes(12), id="trailing-bytes"),
        pytest.param({"__metadata__": {"k": 1}, "a": entry()}, bytes(8), id="metadata-not-strings"),
        pytest.param(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {}}', bytes(8), id="dup"),
    ],
)
def test_headers_that_do_not_describe_the_file_are_refused(tmp_path, header, data):
    assert_refused(write_raw(tmp_path / "bad.safetensors", header, data), "bad_safetensors")


def test_headers_nested_deeper_than_any_writer_nests_them_are_refused(tmp_path):
    deep = b'{"a": ' + b"[" * MAX_HEADER_DEPTH + b"]" * MAX_HEADER_DEPTH + b"}"
    error = assert_refused(write_raw(tmp_path / "deep.safetensors", deep), "bad_safetensors")
    assert str(MAX_HEADER_DEPTH) in error.message
    # Brackets inside names and metadata are not nesting.
    names = {"__metadata__": {"note": "[[[[[[[[[[[[[[[[[[[[[["}, "a[[[[[[[[[[[[[[[[[[[": entry()}
    header = read_header(write_raw(tmp_path / "ok.safetensors", names, bytes(8)), max_header_bytes=LIMIT)
    assert set(header.tensors) == {"a[[[[[[[[[[[[[[[[[[["}


def test_a_header_budget_is_charged_per_file_and_refuses_before_reading(tmp_path):
    first = write_raw(tmp_path / "a.safetensors", {"a": entry()}, bytes(8))
    second = write_raw(tmp_path / "b.safetensors", {"b": entry()}, bytes(8))
    one = int.from_bytes(first.read_bytes()[:8], "little")
    budget = HeaderBudget(2 * one - 1)
    read_header(first, max_header_bytes=LIMIT, budget=budget)
    assert budget.used == one
    with pytest.raises(ArtifactError) as caught:
        read_header(second, max_header_bytes=LIMIT, budget=budget)
    assert caught.value.code == "header_too_large"
    assert "b.safetensors" in caught.value.message and "together" in caught.value.message
    assert budget.used == one


def test_data_end_beyond_the_file_is_truncated(tmp_path):
    path = write_raw(tmp_path / "short.safetensors", {"a": entry(shape=[4], offsets=[0, 16])}, bytes(8))
    error = assert_refused(path, "truncated_file")
    assert "16" in error.message


def test_write_safetensors_equals_save_file_tensor_for_tensor(tmp_path):
    tensors = sample_tensors()
    ours = tmp_path / "ours.safetensors"
    theirs = tmp_path / "theirs.safetensors"
    write_safetensors(ours, entries(tensors), metadata={"format": "pt"})
    save_file(tensors, theirs, metadata={"format": "pt"})
    a, b = load_file(ours), load_file(theirs)
    assert a.keys() == b.keys() == tensors.keys()
    for name in tensors:
        assert a[name].dtype == b[name].dtype
        assert torch.equal(a[name], b[name])
        assert raw(a[name]) == raw(tensors[name])
    with safe_open(str(ours), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_write_safetensors_keeps_the_given_order_and_a_canonical_header(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "t.safetensors"
    write_safetensors(path, entries(tensors))
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + length]
    assert length % 8 == 0
    parsed = json.loads(header)
    assert header.rstrip(b" ") == json.dumps(parsed, sort_keys=True, separators=(",", ":")).encode()
    assert "__metadata__" not in parsed
    starts = [parsed[name]["data_offsets"][0] for name in tensors]
    assert starts == sorted(starts)  # data in the order given, not sorted by name
    assert read_header(path, max_header_bytes=LIMIT).tensors.keys() == tensors.keys()


def test_write_safetensors_is_deterministic(tmp_path):
    first, second = tmp_path / "1.safetensors", tmp_path / "2.safetensors"
    write_safetensors(first, entries(sample_tensors()), metadata={"b": "2", "a": "1"})
    write_safetensors(second, iter(entries(sample_tensors())), metadata={"a": "1", "b": "2"})
    assert first.read_bytes() == second.read_bytes()


def test_write_safetensors_accepts_memoryviews_and_empty_input(tmp_path):
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = tmp_path / "mv.safetensors"
    write_safetensors(path, [("x", "F32", (3, 4), memoryview(array))])
    assert torch.equal(load_file(path)["x"], torch.from_numpy(array))
    empty = tmp_path / "empty.safetensors"
    write_safetensors(empty, [])
    assert load_file(empty) == {}


def test_write_safetensors_holds_one_tensor_at_a_time(tmp_path):
    alive: list[weakref.ref] = []

    def generate():
        for i in range(5):
            gc.collect()
            # Every tensor handed over so far is already gone when the next one is asked for.
            assert all(ref() is None for ref in alive)
            array = np.full((256,), i, dtype=np.float32)
            alive.append(weakref.ref(array))
            yield f"t{i}", "F32", (256,), memoryview(array)
            del array

    path = tmp_path / "stream.safetensors"
    write_safetensors(path, generate())
    assert [int(t[0]) for t in load_file(path).values()] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "bad",
    [
        [("a", "F99", (1,), bytes(4))],
        [("a", "F32", (2,), bytes(4))],
        [("a", "F32", (1,), bytes(4)), ("a", "F32", (1,), bytes(4))],
        [("__metadata__", "F32", (1,), bytes(4))],
    ],
)
def test_write_safetensors_refuses_inconsistent_input_and_leaves_no_file(tmp_path, bad):
    path = tmp_path / "out.safetensors"
    with pytest.raises(ValueError):
        write_safetensors(path, bad)
    assert list(tmp_path.iterdir()) == []
