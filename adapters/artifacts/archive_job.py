"""The running state of one archive extraction: the limits, the checks every member passes, writing, cleanup.

Shared by the tar and zip readers (archive_tar.py, archive_zip.py); `archive.extract_archive` drives them.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from adapters.artifacts.errors import ArtifactError

CHUNK_BYTES = 1024 * 1024

# What reading a damaged archive can raise from tarfile, zipfile, gzip and zlib.
READ_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError)
_DRIVE = re.compile(r"^[A-Za-z]:")


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


class Extraction:
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
        parts = safe_parts(name, self.archive.name)
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

    def write_member(self, parts: tuple[str, ...], name: str, open_member: Callable[[], BinaryIO | None]) -> None:
        """Open a checked member's data (`open_member`: the reader's own call) and write it out."""
        try:
            source = open_member()
        except READ_ERRORS as exc:
            raise self.bad(f"member {name!r} is damaged ({exc}).") from exc
        if source is None:  # pragma: no cover - tar's regular members always have a file object
            raise self.bad(f"member {name!r} has no data.")
        with source:
            self.write_file(parts, name, source)

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
                except READ_ERRORS as exc:
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


def safe_parts(name: str, archive_name: str) -> tuple[str, ...]:
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
