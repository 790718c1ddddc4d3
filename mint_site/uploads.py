"""Multipart upload handling: a file count per route, and files on disk that hold no descriptor open.

Django counts multipart files against one global DATA_UPLOAD_MAX_NUMBER_FILES. MinT's
upload routes must take tens of thousands (a many-file MoE adapter has one safetensors
per tensor) while every other form takes a handful: `FileCountHandler` refuses more files
than the request allows as each new file starts, before its data is read: MINT_UPLOAD_MAX_FILES
on the upload routes (marked in the ASGI scope by mint_site/limits.py, or by the view through
`allow_upload_files`), MINT_FORM_MAX_FILES everywhere else.

Django's temporary-file handler keeps every uploaded file open until the request ends: an
upload of 100,000 files would need 100,000 descriptors. `ClosedFileUploadHandler` writes
each file to its own temporary file and closes it; the file is opened again when read and
removed when the request closes it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from django.conf import settings
from django.core.exceptions import TooManyFilesSent
from django.core.files.uploadedfile import UploadedFile
from django.core.files.uploadhandler import FileUploadHandler

SCOPE_KEY = "mint.max_upload_files"


def allow_upload_files(request, limit: int) -> None:
    """Let this request carry up to `limit` files (call before its body is parsed)."""
    request.max_upload_files = limit


def _file_limit(request) -> int:
    limit = getattr(request, "max_upload_files", None)
    if limit is None:
        limit = getattr(request, "scope", {}).get(SCOPE_KEY)
    return settings.MINT_FORM_MAX_FILES if limit is None else limit


class FileCountHandler(FileUploadHandler):
    """First in FILE_UPLOAD_HANDLERS: counts the files of a request and refuses one too many."""

    def __init__(self, request=None):
        super().__init__(request)
        self.count = 0

    def new_file(self, *args, **kwargs) -> None:
        super().new_file(*args, **kwargs)
        self.count += 1
        limit = _file_limit(self.request)
        if self.count > limit:
            raise TooManyFilesSent(f"The request carries more than {limit} files, the most this route takes.")

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        return raw_data

    def file_complete(self, file_size: int) -> None:
        return None


class ClosedFileUploadHandler(FileUploadHandler):
    """Writes each uploaded file to a temporary file of its own and closes it once written."""

    def new_file(self, *args, **kwargs) -> None:
        super().new_file(*args, **kwargs)
        fd, self.path = tempfile.mkstemp(prefix="mint-upload-", dir=settings.FILE_UPLOAD_TEMP_DIR)
        self.out = os.fdopen(fd, "wb")

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self.out.write(raw_data)

    def file_complete(self, file_size: int) -> UploadedFile:
        self.out.close()
        return ClosedUploadedFile(
            self.path, self.file_name, self.content_type, file_size, self.charset, self.content_type_extra
        )

    def upload_interrupted(self) -> None:
        if hasattr(self, "out"):
            self.out.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class ClosedUploadedFile(UploadedFile):
    """An uploaded file on disk, opened only while it is read; closing it removes it."""

    def __init__(self, path: str, name, content_type, size, charset, content_type_extra=None):
        self._path = path
        self._handle = None
        super().__init__(None, name, content_type, size, charset, content_type_extra)

    @property
    def file(self):
        if self._handle is None:
            self._handle = open(self._path, "rb")  # noqa: SIM115 - closed by close()
        return self._handle

    @file.setter
    def file(self, value) -> None:
        self._handle = value

    @property
    def closed(self) -> bool:
        return self._handle is None or self._handle.closed

    def temporary_file_path(self) -> str:
        return self._path

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
