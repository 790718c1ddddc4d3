"""Reading zip archives, with the central directory bounded before zipfile reads it whole."""

from __future__ import annotations

import stat
import struct
import zipfile
from typing import BinaryIO

from adapters.artifacts.archive_job import READ_ERRORS, Extraction
from adapters.artifacts.errors import ArtifactError

# A zip's end-of-central-directory record, the zip64 locator and the zip64 record, and one
# central directory entry's fixed part, as zipfile reads them.
_ZIP_END = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")
_ZIP_ENTRY_SIZE = 46
_ZIP_MAX_COMMENT = 0xFFFF


def _zip_kind(info: zipfile.ZipInfo) -> str:
    mode = info.external_attr >> 16
    file_type = stat.S_IFMT(mode)
    if stat.S_ISLNK(mode):
        return "link"
    if file_type and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return "special"
    if info.is_dir() or stat.S_ISDIR(mode):
        return "dir"
    return "file"


def _check_zip_directory(job: Extraction) -> None:
    """Refuse a zip whose central directory is too large or lists too many entries, before zipfile reads it.

    zipfile reads the whole central directory into memory and makes a ZipInfo per entry, and
    it does not trust the entry count the end record states (it reads entries until the
    directory's stated size is used up). So both are checked: the count and size the end
    records state, then the entries actually there, counted without building anything. The
    records are found the way zipfile finds them (`_EndRecData`), so both read the same bytes;
    anything zipfile would refuse as damaged is left for it to refuse.
    """
    with open(job.archive, "rb") as f:
        located = _zip_directory_location(f, job.archive_size)
        if located is None:
            return
        entries, directory_start, directory_size = located
        if entries > job.limits.max_files:
            raise job.too_many_files()
        if directory_size > job.limits.max_zip_directory_bytes:
            raise job.header_too_large(
                f"a central directory of {directory_size} bytes, above the limit of "
                f"{job.limits.max_zip_directory_bytes}"
            )
        if directory_start < 0:
            return
        f.seek(directory_start)
        directory = f.read(directory_size)
    position = counted = 0
    while position < directory_size and position + _ZIP_ENTRY_SIZE <= len(directory):
        if directory[position : position + 4] != b"PK\x01\x02":
            return
        name_length, extra_length, comment_length = struct.unpack_from("<3H", directory, position + 28)
        counted += 1
        if counted > job.limits.max_files:
            raise job.too_many_files()
        if name_length > job.limits.max_name_bytes:
            start = position + _ZIP_ENTRY_SIZE
            job.check_name_length(name_length, directory[start : start + 60].decode("utf-8", "replace"))
        position += _ZIP_ENTRY_SIZE + name_length + extra_length + comment_length


def _zip_directory_location(f: BinaryIO, file_size: int) -> tuple[int, int, int] | None:
    """(entries, start, size) of the central directory zipfile will read, or None where it finds no end record."""
    if file_size < _ZIP_END.size:
        return None
    f.seek(file_size - _ZIP_END.size)
    record = f.read(_ZIP_END.size)
    if record[:4] == b"PK\x05\x06" and record[-2:] == b"\x00\x00":
        end_at = file_size - _ZIP_END.size
    else:
        # An archive comment follows the end record: search the last 64 KiB for its signature.
        search_from = max(file_size - _ZIP_MAX_COMMENT - 1 - _ZIP_END.size, 0)
        f.seek(search_from)
        tail = f.read()
        found = tail.rfind(b"PK\x05\x06")
        if found < 0 or len(tail) - found < _ZIP_END.size:
            return None
        end_at = search_from + found
        record = tail[found : found + _ZIP_END.size]
    _, _, _, _, entries, directory_size, _, _ = _ZIP_END.unpack(record)
    directory_end = end_at
    # Zip64: a locator right before the end record, and the zip64 end record right before it.
    if end_at >= _ZIP64_LOCATOR.size + _ZIP64_END.size:
        f.seek(end_at - _ZIP64_LOCATOR.size - _ZIP64_END.size)
        data = f.read(_ZIP64_END.size + _ZIP64_LOCATOR.size)
        if data[_ZIP64_END.size : _ZIP64_END.size + 4] == b"PK\x06\x07" and data[:4] == b"PK\x06\x06":
            fields = _ZIP64_END.unpack(data[: _ZIP64_END.size])
            entries, directory_size = fields[7], fields[8]
            directory_end = end_at - _ZIP64_LOCATOR.size - _ZIP64_END.size
    return entries, directory_end - directory_size, directory_size


def extract_zip(job: Extraction) -> None:
    _check_zip_directory(job)
    try:
        archive = zipfile.ZipFile(job.archive)
    except READ_ERRORS as exc:
        raise job.bad(str(exc) or type(exc).__name__) from exc
    with archive:
        infos = archive.infolist()
        # The central directory lists every member up front: refuse names, types, counts and
        # declared sizes before writing anything. Bytes are counted again while streaming.
        plan: list[tuple[zipfile.ZipInfo, str, tuple[str, ...]]] = []
        declared = 0
        for info in infos:
            kind = _zip_kind(info)
            parts = job.check_entry(info.filename, kind, 0)
            if kind == "file":
                if info.flag_bits & 0x1:
                    raise job.bad(f"member {info.filename!r} is encrypted; upload an unencrypted archive.")
                declared += info.file_size
                job.check_size(declared, info.filename)
            plan.append((info, kind, parts))
        for info, kind, parts in plan:
            if not job.wanted(kind, parts):
                continue  # its declared size was counted above; a zip member is never read unless opened
            if kind == "dir":
                job.make_dirs(parts, info.filename)
                continue
            job.write_member(parts, info.filename, lambda i=info: archive.open(i))


def zip_member_names(f: BinaryIO, file_size: int, *, max_files: int, max_directory_bytes: int) -> list[str]:
    """The member names a zip's central directory lists, read without decompressing anything.

    For the check at registration (adapters/artifacts/precheck.py): the directory is located as
    zipfile locates it and bounded as extraction bounds it (`archive_too_many_files`,
    `archive_header_too_large`); a file without a readable directory is `bad_archive`.
    """
    located = _zip_directory_location(f, file_size)
    if located is None:
        raise ArtifactError("bad_archive", "The zip archive has no central directory; it is damaged or truncated.")
    entries, directory_start, directory_size = located
    if entries > max_files:
        raise ArtifactError(
            "archive_too_many_files", f"The zip archive lists {entries} entries, above the limit of {max_files}."
        )
    if directory_size > max_directory_bytes:
        raise ArtifactError(
            "archive_header_too_large",
            f"The zip archive's central directory is {directory_size} bytes, above the limit of {max_directory_bytes}.",
        )
    if directory_start < 0:
        raise ArtifactError("bad_archive", "The zip archive's central directory lies outside the file.")
    f.seek(directory_start)
    directory = f.read(directory_size)
    names: list[str] = []
    position = 0
    while position + _ZIP_ENTRY_SIZE <= len(directory):
        if directory[position : position + 4] != b"PK\x01\x02":
            raise ArtifactError("bad_archive", "The zip archive's central directory is damaged.")
        flags = struct.unpack_from("<H", directory, position + 8)[0]
        name_length, extra_length, comment_length = struct.unpack_from("<3H", directory, position + 28)
        start = position + _ZIP_ENTRY_SIZE
        raw = directory[start : start + name_length]
        names.append(raw.decode("utf-8" if flags & 0x800 else "cp437", "replace"))
        if len(names) > max_files:
            raise ArtifactError(
                "archive_too_many_files", f"The zip archive lists more than {max_files} entries, the limit."
            )
        position = start + name_length + extra_length + comment_length
    return names
