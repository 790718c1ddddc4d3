"""Safe unpacking of uploaded .tar, .tar.gz and .zip archives.

An upload is untrusted: names may climb out of the destination (`../x`, `/etc/x`), members
may be links or devices, and a small archive may expand to terabytes. Every member name and
type is checked before anything is written for it, sizes are checked against the declared
sizes and again against the bytes actually streamed out, and on any refusal everything
written so far is removed before `ArtifactError` is raised.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from adapters.artifacts.errors import ArtifactError

CHUNK_BYTES = 1024 * 1024

# What reading a damaged archive can raise from tarfile, zipfile, gzip and zlib.
_READ_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError)
_DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class ArchiveLimits:
    """Upper bounds on what one archive may unpack to."""

    max_files: int = 100_000
    max_total_bytes: int = 4 * 1024**3
    max_compression_ratio: float = 200.0


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


def extract_archive(path: Path, dest: Path, limits: ArchiveLimits) -> list[Path]:
    """Unpack a tar, tar.gz or zip archive under `dest` and return the regular files written, sorted.

    Refuses absolute names, `..` components, symbolic and hard links, devices, fifos,
    more than `limits.max_files` entries, more than `limits.max_total_bytes` unpacked, and
    unpacked bytes above `limits.max_compression_ratio` times the archive's size. On any error
    every file and directory this call created under `dest` is removed before raising.
    `dest` is created if missing; existing files in it are never overwritten.
    """
    path = Path(path)
    dest = Path(dest)
    kind = archive_kind(path)
    if kind is None:
        raise ArtifactError(
            "bad_archive", f"{path.name} is not a tar, tar.gz or zip archive; upload the adapter files or one of those."
        )
    dest.mkdir(parents=True, exist_ok=True)
    job = _Extraction(path, dest, limits)
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

    def __init__(self, archive: Path, dest: Path, limits: ArchiveLimits):
        self.archive = archive
        self.dest = dest
        self.real_dest = os.path.realpath(dest)
        self.limits = limits
        self.archive_size = archive.stat().st_size
        self.entries = 0
        self.unpacked = 0
        self.created: list[Path] = []
        self.files: list[Path] = []
        self.known_dirs: set[Path] = set()

    # -- checks -----------------------------------------------------------------------------

    def bad(self, reason: str) -> ArtifactError:
        return ArtifactError("bad_archive", f"{self.archive.name} could not be unpacked: {reason}")

    def check_entry(self, name: str, kind: str, declared_size: int) -> tuple[str, ...]:
        """Check one member before anything is written for it; return its path components under dest."""
        self.entries += 1
        if self.entries > self.limits.max_files:
            raise ArtifactError(
                "archive_too_many_files",
                f"{self.archive.name} holds more than {self.limits.max_files} entries; "
                "upload only the adapter's files (adapter_config.json and its safetensors).",
            )
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

    def check_size(self, total: int, name: str) -> None:
        if total > self.limits.max_total_bytes:
            raise ArtifactError(
                "archive_too_large",
                f"{self.archive.name} unpacks to more than {self.limits.max_total_bytes} bytes "
                f"(reached at {name!r}); upload a smaller adapter or only its needed files.",
            )
        if total > self.limits.max_compression_ratio * self.archive_size:
            raise ArtifactError(
                "archive_compression_ratio",
                f"{self.archive.name} expands more than {self.limits.max_compression_ratio:g} times its size "
                f"(reached at {name!r}), which looks like a decompression bomb; "
                "archive the adapter without padding or filler files.",
            )

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


def _extract_tar(job: _Extraction) -> None:
    # Stream mode ("r|*"): members are read in order, once, so a .tar.gz is decompressed a
    # single time and limits apply to members as they arrive.
    try:
        tar = tarfile.open(job.archive, mode="r|*")  # noqa: SIM115 - closed by the `with` below
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
            if member.issym() or member.islnk():
                kind = "link"
            elif member.isdir():
                kind = "dir"
            elif member.isreg():
                kind = "file"
            else:
                kind = "special"
            parts = job.check_entry(member.name, kind, member.size if kind == "file" else 0)
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


def _extract_zip(job: _Extraction) -> None:
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
            if kind == "dir":
                job.make_dirs(parts, info.filename)
                continue
            try:
                source = archive.open(info)
            except _READ_ERRORS as exc:
                raise job.bad(f"member {info.filename!r} is damaged ({exc}).") from exc
            with source:
                job.write_file(parts, info.filename, source)
