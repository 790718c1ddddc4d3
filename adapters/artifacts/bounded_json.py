"""JSON from tenants, refused for size or nesting depth before `json.loads` sees it.

`json.loads` builds the whole document before anyone can look at it and recurses once per
level of nesting, so a large or deeply nested document costs memory and stack before any
check in our code can run. `check_json_bounds` looks at the raw bytes first: one linear pass,
a fixed-size chunk at a time with numpy, that finds the brackets outside strings and the
deepest nesting they reach. Refusing a document therefore costs time linear in its size and
the memory of one chunk, whatever the document holds.

The scan works on UTF-8 bytes (no multi-byte character contains a byte below 0x80, so quotes,
backslashes and brackets are found by value). Inside a string a quote preceded by an odd run
of backslashes is escaped; backslashes outside strings are invalid JSON, which `json.loads`
refuses at that very byte, so the depth seen up to there is exact for every document the
parser would accept and an upper bound for the ones it would refuse.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# 256 KiB of input costs about 4 MiB of index arrays while it is scanned.
SCAN_CHUNK_BYTES = 256 * 1024

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN_ARRAY, _CLOSE_ARRAY, _OPEN_OBJECT, _CLOSE_OBJECT = ord("["), ord("]"), ord("{"), ord("}")


class JsonBoundExceeded(ValueError):
    """A document refused before parsing: `what` is "size" (bytes) or "depth" (nesting levels)."""

    def __init__(self, what: str, found: int, limit: int):
        self.what = what
        self.found = found
        self.limit = limit
        if what == "size":
            message = f"{found} bytes, above the limit of {limit}"
        else:
            message = f"nested more than {limit} levels deep"
        super().__init__(message)


def nesting_depth(data: bytes | bytearray | memoryview, *, stop_above: int | None = None) -> int:
    """The deepest nesting of arrays and objects in UTF-8 JSON text (0 for a scalar), brackets in strings aside.

    With `stop_above`, the scan ends with the chunk in which the depth first exceeds it and
    returns the deepest nesting seen so far: a refusal does not need the rest of the document.
    """
    view = np.frombuffer(data, dtype=np.uint8)
    depth = 0  # open containers at the end of the previous chunk
    deepest = 0
    in_string = False  # whether the previous chunk ended inside a string
    carried_backslashes = 0  # length of the run of backslashes the previous chunk ended with
    for begin in range(0, view.size, SCAN_CHUNK_BYTES):
        chunk = view[begin : begin + SCAN_CHUNK_BYTES]
        is_backslash = chunk == _BACKSLASH
        quotes = np.flatnonzero(chunk == _QUOTE)
        if quotes.size:
            quotes = quotes[_unescaped(quotes, is_backslash, carried_backslashes)]
        opens = (chunk == _OPEN_ARRAY) | (chunk == _OPEN_OBJECT)
        brackets = np.flatnonzero(opens | (chunk == _CLOSE_ARRAY) | (chunk == _CLOSE_OBJECT))
        if brackets.size and quotes.size:
            # A bracket is inside a string when an odd number of real quotes precede it (counting
            # the string the previous chunk ended in): a cumulative sum over the quote positions.
            quote_marks = np.zeros(chunk.size, dtype=np.int32)
            quote_marks[quotes] = 1
            quotes_before = np.cumsum(quote_marks, dtype=np.int32)[brackets]
            brackets = brackets[(quotes_before + int(in_string)) % 2 == 0]
        elif in_string:
            brackets = brackets[:0]
        if brackets.size:
            levels = np.cumsum(np.where(opens[brackets], 1, -1), dtype=np.int64) + depth
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
            if stop_above is not None and deepest > stop_above:
                return deepest
        if quotes.size % 2:
            in_string = not in_string
        carried_backslashes = _trailing_run(is_backslash, carried_backslashes)
    return deepest


def _unescaped(quotes: np.ndarray, is_backslash: np.ndarray, carried: int) -> np.ndarray:
    """Which of the quote positions are not escaped: the backslashes right before each form an even run."""
    positions = np.arange(is_backslash.size, dtype=np.int32)
    # For every position, the index of the last byte at or before it that is not a backslash (-1: none).
    last_plain = np.maximum.accumulate(np.where(is_backslash, -1, positions))
    before = quotes - 1
    previous = np.where(before >= 0, last_plain[np.maximum(before, 0)], -1)
    run = before - previous
    # A run that reaches back to the chunk's start continues the previous chunk's trailing run.
    run = run + np.where(previous < 0, carried, 0)
    return run % 2 == 0


def _trailing_run(is_backslash: np.ndarray, carried: int) -> int:
    """The length of the run of backslashes a chunk ends with (continuing `carried` if it is all backslashes)."""
    if not is_backslash.size or not is_backslash[-1]:
        return 0
    plain = np.flatnonzero(~is_backslash)
    if not plain.size:
        return carried + int(is_backslash.size)
    return int(is_backslash.size - 1 - plain[-1])


def check_json_bounds(data: bytes | bytearray | memoryview, *, max_bytes: int, max_depth: int) -> None:
    """Raise `JsonBoundExceeded` unless `data` is at most `max_bytes` long and nested at most `max_depth` deep."""
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise JsonBoundExceeded("size", size, max_bytes)
    depth = nesting_depth(data, stop_above=max_depth)
    if depth > max_depth:
        raise JsonBoundExceeded("depth", depth, max_depth)


def loads_bounded(
    data: bytes,
    *,
    max_bytes: int,
    max_depth: int,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """`json.loads` of UTF-8 `data` after `check_json_bounds`.

    Raises `JsonBoundExceeded`, `UnicodeDecodeError` or `json.JSONDecodeError` (and whatever
    `object_pairs_hook` raises); callers turn them into their own error codes.
    """
    check_json_bounds(data, max_bytes=max_bytes, max_depth=max_depth)
    return json.loads(data.decode("utf-8"), object_pairs_hook=object_pairs_hook)


def read_json_file(
    path: Path,
    *,
    max_bytes: int,
    max_depth: int,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """Read and parse a UTF-8 JSON file with `loads_bounded`, reading no more than `max_bytes` + 1 bytes of it.

    Raises OSError as `open` does, and what `loads_bounded` raises.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise JsonBoundExceeded("size", size, max_bytes)
        # The file may grow between fstat and read: never read more than the bound allows.
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise JsonBoundExceeded("size", len(data), max_bytes)
    return loads_bounded(data, max_bytes=max_bytes, max_depth=max_depth, object_pairs_hook=object_pairs_hook)
