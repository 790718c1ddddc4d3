"""Resumable uploads (`POST …/uploads/`, `PUT …/parts/<n>/`, `POST …/complete/`) behind `Client.register`."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mint_client import artifacts
from mint_client.errors import Conflict, ConnectionFailed, UploadInterrupted, ValidationError
from mint_client.models import Revision, UploadSession, revision_number

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


class UploadsMixin:
    """Client methods for uploads in parts; uses the client's `_call`, `_json`, `_revision` and `retries`."""

    def create_upload(self, adapter: str, path: str | os.PathLike) -> UploadSession:
        path = Path(path)
        body = {"size": path.stat().st_size, "sha256": artifacts.file_sha256(path), "filename": path.name}
        return UploadSession.from_json(self._json("uploads.create", name=adapter, json=body))

    def upload_session(self, adapter: str, upload_id: str) -> UploadSession:
        return UploadSession.from_json(self._json("uploads.get", name=adapter, upload_id=upload_id))

    def delete_upload(self, adapter: str, upload_id: str) -> None:
        self._call("uploads.delete", name=adapter, upload_id=upload_id)

    def upload(
        self,
        adapter: str,
        path: str | os.PathLike,
        *,
        training_step: int | None = None,
        parent: int | str | None = None,
        allow_duplicate: bool | None = None,
        progress: Progress | None = None,
        upload_id: str | None = None,
        run: str | None = None,
        metrics: dict | None = None,
        prewarm: bool | None = None,
    ) -> Revision:
        """Register one archive (or a directory, packed into a .tar) in resumable parts: create a session (or
        continue `upload_id`), send the parts the server does not hold yet, complete it into a revision.

        Each part is retried as any call is; when a part still fails, the session is read again and only its
        missing parts are sent, up to `retries` rounds. If it still cannot finish, `UploadInterrupted` carries
        the `upload_id` for `resume_upload` (after a restart, for instance).
        """
        path = Path(path)
        options = {
            "training_step": training_step,
            "parent": revision_number(parent) if parent is not None else None,
            "allow_duplicate": allow_duplicate,
            "run": run,
            "metrics": metrics,
            "prewarm": prewarm,
        }
        if not path.is_dir():
            return self._upload_file(adapter, path, path, options, progress, upload_id)
        # Packed as register() packs it: the same files give the same .tar, so a directory resumes too.
        with tempfile.TemporaryDirectory(prefix="mint-upload-") as work:
            tar = artifacts.pack_tar(artifacts.adapter_files(path), Path(work) / f"{path.name or 'adapter'}.tar")
            return self._upload_file(adapter, tar, path, options, progress, upload_id)

    def _upload_file(
        self,
        adapter: str,
        path: Path,
        source: Path,
        options: dict,
        progress: Progress | None,
        upload_id: str | None,
    ) -> Revision:
        size = path.stat().st_size
        if upload_id:
            session = self.upload_session(adapter, upload_id)
            if (session.size, session.sha256) != (size, artifacts.file_sha256(path)):
                raise ValidationError(
                    f"Upload {upload_id} was opened for other bytes than {path.name} "
                    f"({session.size} bytes, sha256 {session.sha256}); start a new upload.",
                    code="upload_mismatch",
                )
        else:
            session = self.create_upload(adapter, path)
        meta = {k: v for k, v in options.items() if v is not None}
        rounds = 0
        while True:
            try:
                self._send_parts(adapter, session, path, size, progress)
                response = self._call("uploads.complete", name=adapter, upload_id=session.id, json=meta)
                return self._revision(response.json(), adapter)
            except (ConnectionFailed, Conflict) as exc:
                if isinstance(exc, Conflict) and exc.code != "upload_incomplete":
                    raise
                rounds += 1
                if rounds > self.retries:
                    raise UploadInterrupted(
                        f"The upload {session.id} of {source} stopped ({exc}); resume it with "
                        f"resume_upload({adapter!r}, {session.id!r}, {str(source)!r}).",
                        upload_id=session.id,
                        code=exc.code if isinstance(exc, Conflict) else None,
                    ) from exc
                try:
                    session = self.upload_session(adapter, session.id)
                except ConnectionFailed:
                    continue  # the next round reads it again

    def resume_upload(self, adapter: str, upload_id: str, path: str | os.PathLike, **kwargs: Any) -> Revision:
        """Go on with an interrupted upload of `path` (the archive, or the directory `register` packed): only the
        parts the server lacks are sent. `ValidationError` (`upload_mismatch`) if the bytes are not the same."""
        return self.upload(adapter, path, upload_id=upload_id, **kwargs)

    def _send_parts(
        self, adapter: str, session: UploadSession, path: Path, size: int, progress: Progress | None
    ) -> None:
        def part_length(n: int) -> int:
            return min(session.part_size, size - (n - 1) * session.part_size)

        done = sum(part_length(n) for n in session.received if 1 <= n <= session.parts)
        if progress:
            progress(done, size)
        with open(path, "rb") as handle:
            for n in session.missing():
                handle.seek((n - 1) * session.part_size)
                chunk = handle.read(part_length(n))
                headers = {
                    "X-Mint-Part-Sha256": hashlib.sha256(chunk).hexdigest(),
                    "Content-Type": "application/octet-stream",
                }
                self._call(
                    "uploads.put_part", name=adapter, upload_id=session.id, part=n, content=chunk, headers=headers
                )
                session.received.append(n)
                done += len(chunk)
                if progress:
                    progress(done, size)
