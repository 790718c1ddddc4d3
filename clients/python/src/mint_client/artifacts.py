"""Local adapter files: which files of a directory are sent, archives, packing into a .tar, digests."""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")
CONFIG_NAME = "adapter_config.json"
_CHUNK = 1024 * 1024


def is_archive(path: Path) -> bool:
    name = path.name.lower()
    return path.is_file() and name.endswith(ARCHIVE_SUFFIXES)


def adapter_files(directory: Path) -> list[Path]:
    """The files of a PEFT adapter directory that MinT takes: `adapter_config.json` and the `.safetensors`
    files (one for a PEFT save, one per tensor for many-file layouts, also in subfolders).

    Everything else (a trainer's optimizer.pt, rng_state.pth, trainer_state.json, README.md) is left out:
    MinT refuses pickles, and those are not the adapter. Raises FileNotFoundError when nothing is left.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory.")
    files = [p for p in sorted(directory.rglob("*.safetensors")) if p.is_file()]
    config = directory / CONFIG_NAME
    if config.is_file():
        files.insert(0, config)
    if not files:
        raise FileNotFoundError(f"{directory} holds no {CONFIG_NAME} and no .safetensors files.")
    return files


def pack_tar(files: list[Path], dest: Path) -> Path:
    """An uncompressed .tar of `files` by base name (safetensors barely compress; a tar costs no CPU).

    Deterministic (no owner, time or mode of the local files in it): packing the same files again gives the
    same bytes, so an interrupted upload of a directory can be resumed from the directory itself.
    """

    def plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        info.mode = 0o644
        return info

    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            tar.add(path, arcname=path.name, recursive=False, filter=plain)
    return dest


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class CountingReader:
    """A file opened for reading that reports each chunk read (upload progress), otherwise the file itself."""

    def __init__(self, path: Path, report) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (closed by the body factory's closer)
        self._report = report

    def read(self, size: int = -1) -> bytes:
        chunk = self._file.read(size)
        if chunk and self._report is not None:
            self._report(len(chunk))
        return chunk

    def __getattr__(self, name: str):
        return getattr(self._file, name)

    def __iter__(self):
        while chunk := self.read(64 * 1024):
            yield chunk

    def close(self) -> None:
        self._file.close()
