"""Safe unpacking of uploaded .tar, .tar.gz and .zip archives.

An upload is untrusted: names may climb out of the destination (`../x`, `/etc/x`), members
may be links or devices, and a small archive may expand to terabytes. Every member name and
type is checked before anything is written for it, sizes are checked against the declared
sizes and again against the bytes actually streamed out, and on any refusal everything
written so far is removed before `ArtifactError` is raised.

The archive's own bookkeeping is bounded before the standard library allocates it: tarfile
reads a GNU long name or a PAX header whole into memory (a 400 KB .tar.gz can declare a
400 MiB name), so tar headers are bounded first (archive_tar.py); zipfile reads the whole central
directory into objects before anyone can count them, so its end records are read first
(archive_zip.py). The checks every member passes and the cleanup live in archive_job.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

from adapters.artifacts.archive_job import ArchiveLimits, Extraction
from adapters.artifacts.archive_tar import extract_tar
from adapters.artifacts.archive_zip import extract_zip
from adapters.artifacts.errors import ArtifactError

__all__ = ["HEAD_BYTES", "ArchiveLimits", "archive_kind", "extract_archive", "kind_of_head"]

HEAD_BYTES = 64 * 1024  # what archive_kind reads of a file


def archive_kind(path: Path) -> str | None:
    """ "tar" (plain or gzip-compressed), "zip", or None, judged by the first bytes, never by the name."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return None
    return kind_of_head(head)


def kind_of_head(head: bytes) -> str | None:
    """`archive_kind` of a file whose first HEAD_BYTES bytes (or all of it, if shorter) are `head`."""
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08"):
        return "zip"
    if head[:2] == b"\x1f\x8b":
        # Only look at the first tar block: max_length keeps a bomb from expanding here.
        try:
            block = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, 512)
        except zlib.error:
            return None
        return "tar" if _looks_like_tar_header(block) else None
    return "tar" if _looks_like_tar_header(head[:512]) else None


def _looks_like_tar_header(block: bytes) -> bool:
    """A tar header block: the checksum field matches the block (as tarfile itself checks)."""
    if len(block) < 512:
        return False
    field = block[148:156].split(b"\x00", 1)[0].strip()
    try:
        declared = int(field, 8)
    except ValueError:
        return False
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:512])
    signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:512] if b > 127)  # some old tars
    return declared in (unsigned, signed) and any(block[:100])


def extract_archive(
    path: Path, dest: Path, limits: ArchiveLimits, *, keep: Callable[[str], bool] | None = None
) -> list[Path]:
    """Unpack a tar, tar.gz or zip archive under `dest` and return the regular files written, sorted.

    Refuses absolute names, `..` components, symbolic and hard links, devices, fifos,
    more than `limits.max_files` entries, more than `limits.max_total_bytes` unpacked, and
    unpacked bytes above `limits.max_compression_ratio` times the archive's size. On any error
    every file and directory this call created under `dest` is removed before raising.
    `dest` is created if missing; existing files in it are never overwritten.

    With `keep`, only files whose base name it accepts are written (with the directories above
    them); every other member is checked and counted against the limits as before, but not
    written: an archive of 100,000 stray files then costs reading, not 100,000 files on disk.
    """
    path = Path(path)
    dest = Path(dest)
    kind = archive_kind(path)
    if kind is None:
        raise ArtifactError(
            "bad_archive", f"{path.name} is not a tar, tar.gz or zip archive; upload the adapter files or one of those."
        )
    dest.mkdir(parents=True, exist_ok=True)
    job = Extraction(path, dest, limits, keep)
    try:
        if kind == "zip":
            extract_zip(job)
        else:
            extract_tar(job)
    except BaseException:
        job.remove_written()
        raise
    return sorted(job.files)
