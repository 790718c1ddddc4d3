"""Safe unpacking of uploaded .tar, .tar.gz and .zip archives.

An upload is untrusted: names may climb out of the destination (`../x`, `/etc/x`), members
may be links or devices, and a small archive may expand to terabytes. Every member name and
type is checked before anything is written for it, sizes are checked against the declared
sizes and again against the bytes actually streamed out, and on any refusal everything
written so far is removed before `ArtifactError` is raised.

The archive's own bookkeeping is bounded before the standard library allocates it: tarfile
reads a GNU long name or a PAX header whole into memory (a 400 KB .tar.gz can declare a
400 MiB name), so tar headers go through `_BoundedTarInfo`; zipfile reads the whole central
directory into objects before anyone can count them, so its end records are read first.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar

from adapters.artifacts.errors import ArtifactError

CHUNK_BYTES = 1024 * 1024

# What reading a damaged archive can raise from tarfile, zipfile, gzip and zlib.
_READ_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError)
_DRIVE = re.compile(r"^[A-Za-z]:")


# Extended headers (GNU long name/link, PAX) tar may chain in front of one member: real writers use
# at most four (a global and an extended PAX header, a long name, a long link). tarfile follows a
# chain by recursion, so an endless one would end in RecursionError instead of a refusal.
MAX_HEADERS_PER_MEMBER = 8
# A zip's end-of-central-directory record, the zip64 locator and the zip64 record, and one
# central directory entry's fixed part, as zipfile reads them.
_ZIP_END = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")
_ZIP_ENTRY_SIZE = 46
_ZIP_MAX_COMMENT = 0xFFFF


@dataclass(frozen=True)
class ArchiveLimits:
    """Upper bounds on what one archive may unpack to, and on the archive's own headers."""

    max_files: int = 100_000
    max_total_bytes: int = 4 * 1024**3
    max_compression_ratio: float = 200.0
    # One member's name (bytes, UTF-8), however it is stored: ustar fields, GNU long name, PAX path.
    max_name_bytes: int = 4096
    # One PAX extended or global header, and the global headers of an archive together.
    max_pax_header_bytes: int = 64 * 1024
    # Records (key=value) in one PAX header, and in the global headers together: tarfile applies
    # every global record to every later member, so their number multiplies with max_files.
    max_pax_records: int = 256
    # A zip's central directory: zipfile reads it whole and makes an object per entry before
    # any member is looked at.
    max_zip_directory_bytes: int = 32 * 1024 * 1024


def archive_kind(path: Path) -> str | None:
    """ "tar" (plain or gzip-compressed), "zip", or None, judged by the first bytes, never by the name."""
    try:
        with open(path, "rb") as f:
            head = f.read(64 * 1024)
    except OSError:
        return None
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
    job = _Extraction(path, dest, limits, keep)
    try:
        if kind == "zip":
            _extract_zip(job)
        else:
            _extract_tar(job)
    except BaseException:
        job.remove_written()
        raise
    return sorted(job.files)


class _Extraction:
    """The running state of one extraction: counts, bytes and every path created (for cleanup)."""

    def __init__(self, archive: Path, dest: Path, limits: ArchiveLimits, keep: Callable[[str], bool] | None = None):
        self.archive = archive
        self.keep = keep
        self.dest = dest
        self.real_dest = os.path.realpath(dest)
        self.limits = limits
        self.archive_size = archive.stat().st_size
        self.entries = 0
        self.unpacked = 0
        self.created: list[Path] = []
        self.files: list[Path] = []
        self.known_dirs: set[Path] = set()
        # Tar header bookkeeping, kept by _BoundedTarInfo.
        self.headers_in_a_row = 0
        self.global_pax_bytes = 0

    # -- checks -----------------------------------------------------------------------------

    def bad(self, reason: str) -> ArtifactError:
        return ArtifactError("bad_archive", f"{self.archive.name} could not be unpacked: {reason}")

    def check_entry(self, name: str, kind: str, declared_size: int) -> tuple[str, ...]:
        """Check one member before anything is written for it; return its path components under dest."""
        self.entries += 1
        if self.entries > self.limits.max_files:
            raise self.too_many_files()
        self.check_name_length(len(name.encode("utf-8", "surrogatepass")), name)
        parts = _safe_parts(name, self.archive.name)
        if kind == "link":
            raise ArtifactError(
                "archive_link",
                f"{self.archive.name} contains {name!r}, a symbolic or hard link; "
                "archive the files themselves (for tar, use --dereference).",
            )
        if kind == "special":
            raise ArtifactError(
                "archive_special_file",
                f"{self.archive.name} contains {name!r}, a device, fifo or other special file; "
                "archive only regular files and directories.",
            )
        if kind == "file" and not parts:
            raise self.bad(f"a file member has an empty name ({name!r}).")
        self.check_size(self.unpacked + declared_size, name)
        return parts

    def check_name_length(self, length: int, name: str | None) -> None:
        """Refuse a member name (None: one not read yet, e.g. a GNU long name) longer than `max_name_bytes`."""
        if length > self.limits.max_name_bytes:
            which = "a GNU long name or link" if name is None else f"a member name starting {name[:60]!r}"
            raise ArtifactError(
                "archive_name_too_long",
                f"{self.archive.name} has {which} of {length} bytes, above the limit of "
                f"{self.limits.max_name_bytes}; archive the adapter with short relative paths.",
            )

    def too_many_files(self) -> ArtifactError:
        return ArtifactError(
            "archive_too_many_files",
            f"{self.archive.name} holds more than {self.limits.max_files} entries; "
            "upload only the adapter's files (adapter_config.json and its safetensors).",
        )

    def header_too_large(self, what: str) -> ArtifactError:
        return ArtifactError(
            "archive_header_too_large",
            f"{self.archive.name} has {what}; archive the adapter's files with a standard tool (tar, zip), "
            "without extended attributes.",
        )

    def check_stream(self, position: int, name: str) -> None:
        """Bound the bytes decompressed so far, headers included, by the compression ratio.

        File data is bounded by `check_size`; this also counts headers, which a bomb can fill
        instead (a hundred thousand members, each behind a PAX header at its size limit).
        """
        if position > self.limits.max_compression_ratio * self.archive_size:
            raise self.ratio_exceeded(name)

    def ratio_exceeded(self, name: str) -> ArtifactError:
        return ArtifactError(
            "archive_compression_ratio",
            f"{self.archive.name} expands more than {self.limits.max_compression_ratio:g} times its size "
            f"(reached at {name!r}), which looks like a decompression bomb; "
            "archive the adapter without padding or filler files.",
        )

    def check_size(self, total: int, name: str) -> None:
        if total > self.limits.max_total_bytes:
            raise ArtifactError(
                "archive_too_large",
                f"{self.archive.name} unpacks to more than {self.limits.max_total_bytes} bytes "
                f"(reached at {name!r}); upload a smaller adapter or only its needed files.",
            )
        if total > self.limits.max_compression_ratio * self.archive_size:
            raise self.ratio_exceeded(name)

    # -- writing ----------------------------------------------------------------------------

    def make_dirs(self, parts: tuple[str, ...], name: str) -> Path:
        current = self.dest
        for part in parts:
            current = current / part
            if current in self.known_dirs:
                continue
            try:
                current.mkdir()
            except (FileExistsError, NotADirectoryError) as exc:
                # Only a directory that was there before (dest need not be empty) may be reused,
                # and only if it really lies inside dest.
                if not current.is_dir() or not os.path.realpath(current).startswith(self.real_dest + os.sep):
                    raise self.bad(f"{name!r} clashes with another member or an existing file.") from exc
            else:
                self.created.append(current)
            self.known_dirs.add(current)
        return current

    def wanted(self, kind: str, parts: tuple[str, ...]) -> bool:
        """Whether a checked member is written out (directories only as a kept file needs them)."""
        if self.keep is None:
            return True
        return kind == "file" and self.keep(parts[-1])

    def skip_file(self, declared_size: int, name: str) -> None:
        """A file member read past without writing it: its bytes count as unpacked all the same."""
        self.unpacked += declared_size
        self.check_size(self.unpacked, name)

    def write_file(self, parts: tuple[str, ...], name: str, read: BinaryIO) -> None:
        target = self.make_dirs(parts[:-1], name) / parts[-1]
        try:
            # "xb": never overwrite (a duplicate member) and never follow an existing link.
            out = open(target, "xb")  # noqa: SIM115 - closed in finally, after registering for cleanup
        except (FileExistsError, IsADirectoryError, NotADirectoryError) as exc:
            raise self.bad(f"{name!r} appears more than once or clashes with a directory.") from exc
        self.created.append(target)
        try:
            while True:
                try:
                    chunk = read.read(CHUNK_BYTES)
                except _READ_ERRORS as exc:
                    raise self.bad(f"member {name!r} is damaged ({exc}).") from exc
                if not chunk:
                    break
                # Counted on the bytes really produced, not the declared size: sparse tar
                # members and lying headers cannot get past this.
                self.unpacked += len(chunk)
                self.check_size(self.unpacked, name)
                out.write(chunk)
        finally:
            out.close()
        self.files.append(target)

    def remove_written(self) -> None:
        for created in reversed(self.created):
            try:
                if created.is_dir() and not created.is_symlink():
                    shutil.rmtree(created, ignore_errors=True)
                else:
                    created.unlink(missing_ok=True)
            except OSError:
                pass
        self.created.clear()
        self.files.clear()


def _safe_parts(name: str, archive_name: str) -> tuple[str, ...]:
    if "\x00" in name:
        raise ArtifactError("bad_archive", f"{archive_name} has a member name containing a NUL byte.")
    normalized = name.replace("\\", "/")
    if normalized.startswith("/") or _DRIVE.match(normalized):
        raise ArtifactError(
            "archive_absolute_path",
            f"{archive_name} contains the absolute path {name!r}; archive the adapter with relative paths.",
        )
    parts = tuple(p for p in normalized.split("/") if p not in ("", "."))
    if ".." in parts:
        raise ArtifactError(
            "archive_path_traversal",
            f"{archive_name} contains {name!r}, which climbs out of the upload with '..'; "
            "archive the adapter with plain relative paths.",
        )
    return parts


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's header reader with our bounds applied before a header's payload is read.

    tarfile reads a GNU long name or long link (types L/K) and a PAX header (x/g) whole into
    memory, parses PAX records with a regular expression that can match across records
    (a 64 KiB header of short overlapping records costs a gigabyte of keys), and reads the
    sparse maps of GNU sparse members for as many blocks as the archive says. `_proc_member`
    is tarfile's documented extension point for this (see its comment in tarfile.py): it sees
    each header's type and declared size before any of that happens. Long names and PAX
    headers above their bounds are refused, PAX headers are parsed here with a strict parser,
    and sparse members (which an adapter never needs) are refused outright.

    One subclass is made per extraction (`for_job`), carrying that extraction's limits.
    """

    job: ClassVar[_Extraction]

    @classmethod
    def for_job(cls, job: _Extraction) -> type[_BoundedTarInfo]:
        return type(cls.__name__, (cls,), {"job": job})

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        job = self.job
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, *_PAX_TYPES):
            job.headers_in_a_row += 1
            if job.headers_in_a_row > MAX_HEADERS_PER_MEMBER:
                raise job.header_too_large(
                    f"more than {MAX_HEADERS_PER_MEMBER} extended headers (GNU long names, PAX) in front of one member"
                )
        else:
            job.headers_in_a_row = 0
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
            # The stored name ends with a NUL.
            job.check_name_length(self.size - 1, None)
        elif self.type == tarfile.GNUTYPE_SPARSE:
            raise _sparse_refusal(job, self.name)
        elif self.type in _PAX_TYPES:
            return self._proc_bounded_pax(tarfile_)
        return super()._proc_member(tarfile_)

    def _proc_bounded_pax(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        """tarfile's `_proc_pax` for a header within our bounds, with a parser that reads each record once."""
        job = self.job
        limits = job.limits
        if self.size > limits.max_pax_header_bytes:
            raise job.header_too_large(
                f"a PAX header of {self.size} bytes, above the limit of {limits.max_pax_header_bytes}"
            )
        buf = tarfile_.fileobj.read(self._block(self.size))
        if len(buf) < self.size:
            raise tarfile.ReadError("unexpected end of data in a PAX header")
        records = _pax_records(buf[: self.size], job)
        if self.type == tarfile.XGLTYPE:
            # Global records apply to every member after this one.
            pax_headers = tarfile_.pax_headers
            job.global_pax_bytes += self.size
            if job.global_pax_bytes > limits.max_pax_header_bytes:
                raise job.header_too_large(
                    f"PAX global headers of {job.global_pax_bytes} bytes together, above the limit of "
                    f"{limits.max_pax_header_bytes}"
                )
        else:
            pax_headers = tarfile_.pax_headers.copy()
        # As tarfile does: hdrcharset=BINARY (here or in a global header) means names are in the archive's encoding.
        charset = next((v.decode("utf-8", "replace") for k, v in records if k == b"hdrcharset"), None)
        charset = charset or pax_headers.get("hdrcharset")
        name_encoding = tarfile_.encoding if charset == "BINARY" else "utf-8"
        for key, value in records:
            keyword = _decode_pax(key, "utf-8", tarfile_)
            pax_headers[keyword] = _decode_pax(
                value, name_encoding if keyword in tarfile.PAX_NAME_FIELDS else "utf-8", tarfile_
            )
        if len(pax_headers) > limits.max_pax_records:
            raise job.header_too_large(
                f"PAX headers with {len(pax_headers)} records for one member, "
                f"above the limit of {limits.max_pax_records}"
            )

        try:
            member = self.fromtarfile(tarfile_)
        except tarfile.HeaderError as exc:
            raise tarfile.SubsequentHeaderError(str(exc)) from None
        if self.type != tarfile.XGLTYPE:
            # As tarfile does: the extended header patches the member after it.
            member._apply_pax_info(pax_headers, tarfile_.encoding, tarfile_.errors)
            member.offset = self.offset
            if "size" in pax_headers:
                offset = member.offset_data
                if member.isreg() or member.type not in tarfile.SUPPORTED_TYPES:
                    offset += member._block(member.size)
                tarfile_.offset = offset
        return member


_PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


def _pax_records(buf: bytes, job: _Extraction) -> list[tuple[bytes, bytes]]:
    """The (key, value) records of a PAX header: each "<length> <key>=<value>\\n", lengths tiling the header.

    Anything else is a damaged archive. GNU sparse records are refused: their maps make
    tarfile read as many numbers as the archive claims.
    """
    records: list[tuple[bytes, bytes]] = []
    position = 0
    while position < len(buf) and buf[position] != 0:  # NUL padding may follow the last record
        space = buf.find(b" ", position, position + 21)
        length_field = buf[position:space] if space > position else b""
        if not length_field.isdigit():
            raise tarfile.ReadError("malformed PAX header record")
        end = position + int(length_field)
        if end <= space + 1 or end > len(buf) or buf[end - 1] != 0x0A:
            raise tarfile.ReadError("malformed PAX header record")
        key, equals, value = buf[space + 1 : end - 1].partition(b"=")
        if not equals or not key:
            raise tarfile.ReadError("malformed PAX header record")
        if key.startswith(b"GNU.sparse."):
            raise _sparse_refusal(job, "<a PAX header>")
        records.append((key, value))
        if len(records) > job.limits.max_pax_records:
            raise job.header_too_large(f"a PAX header with more than {job.limits.max_pax_records} records")
        position = end
    return records


def _decode_pax(raw: bytes, encoding: str, tarfile_: tarfile.TarFile) -> str:
    """Decode a PAX field as tarfile does: strictly first, then with the archive's own encoding and error handler."""
    try:
        return raw.decode(encoding, "strict")
    except UnicodeDecodeError:
        return raw.decode(tarfile_.encoding, tarfile_.errors)


def _sparse_refusal(job: _Extraction, name: str) -> ArtifactError:
    return ArtifactError(
        "archive_sparse_file",
        f"{job.archive.name} contains {name!r}, a sparse file; archive the adapter's files without "
        "--sparse (adapters never need sparse files).",
    )


def _extract_tar(job: _Extraction) -> None:
    # Stream mode ("r|*"): members are read in order, once, so a .tar.gz is decompressed a
    # single time and limits apply to members as they arrive.
    tarinfo = _BoundedTarInfo.for_job(job)
    try:
        tar = tarfile.open(job.archive, mode="r|*", tarinfo=tarinfo)  # noqa: SIM115 - closed by the `with` below
    except _READ_ERRORS as exc:
        raise job.bad(str(exc) or type(exc).__name__) from exc
    with tar:
        while True:
            try:
                member = tar.next()
            except _READ_ERRORS as exc:
                raise job.bad(str(exc) or type(exc).__name__) from exc
            if member is None:
                break
            # Stream mode needs no index of past members (links are refused), but tarfile keeps
            # one: drop it, so memory does not grow with the member count.
            tar.members.clear()
            # offset_data: where this member's data starts in the decompressed stream, i.e. every
            # byte read so far, headers included (its data is counted as it is written).
            job.check_stream(member.offset_data, member.name)
            if member.sparse is not None:  # pragma: no cover - sparse headers are refused while read
                raise _sparse_refusal(job, member.name)
            if member.issym() or member.islnk():
                kind = "link"
            elif member.isdir():
                kind = "dir"
            elif member.isreg():
                kind = "file"
            else:
                kind = "special"
            parts = job.check_entry(member.name, kind, member.size if kind == "file" else 0)
            if not job.wanted(kind, parts):
                if kind == "file":
                    job.skip_file(member.size, member.name)  # tarfile reads past its data at next()
                continue
            if kind == "dir":
                job.make_dirs(parts, member.name)
                continue
            try:
                source = tar.extractfile(member)
            except _READ_ERRORS as exc:
                raise job.bad(f"member {member.name!r} is damaged ({exc}).") from exc
            if source is None:  # pragma: no cover - isreg() members always have a file object
                raise job.bad(f"member {member.name!r} has no data.")
            with source:
                job.write_file(parts, member.name, source)


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


def _check_zip_directory(job: _Extraction) -> None:
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


def _extract_zip(job: _Extraction) -> None:
    _check_zip_directory(job)
    try:
        archive = zipfile.ZipFile(job.archive)
    except _READ_ERRORS as exc:
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
            try:
                source = archive.open(info)
            except _READ_ERRORS as exc:
                raise job.bad(f"member {info.filename!r} is damaged ({exc}).") from exc
            with source:
                job.write_file(parts, info.filename, source)
