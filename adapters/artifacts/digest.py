"""The digest MinT records of an adapter's source files: `AdapterRevision.sha256`, the policy record's `source_sha256`.

It is a SHA-256 over the source's files, each named by its path relative to the source's folder
and given by its own SHA-256 (the per-file digest the export records for its files too), in path
order. Two sources are *equal*, for duplicate detection, exactly when these digests are equal:
the same set of file names with the same contents. An archive is one file: its name and its bytes.

Validation computes it from the files in the store (adapters/pipeline.py); registration computes
the same value from the per-file digests taken while a multipart body streams in, so both agree
without reading the files twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import BinaryIO

CHUNK_BYTES = 1024 * 1024


def combined_digest(files: Iterable[tuple[str, str]]) -> str:
    """Hex SHA-256 over (relative POSIX path, hex SHA-256 of that file) pairs, in path order.

    Paths are ordered by their components, as pathlib orders them: `a/b` before `a.b`, whatever the
    byte order of `/` and `.` says.
    """
    digest = hashlib.sha256()
    for name, file_sha256 in sorted(files, key=lambda item: item[0].split("/")):
        digest.update(f"{name}\0{file_sha256}\n".encode())
    return digest.hexdigest()


def sha256_stream(stream: BinaryIO) -> str:
    """Hex SHA-256 of what `stream` holds from where it stands to its end, read in chunks."""
    digest = hashlib.sha256()
    while chunk := stream.read(CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()
