"""A resumable upload through a real TCP proxy that cuts the socket in the middle of a part: the SDK sends that
part again on a new connection, completes, and the revision's export is byte-identical to a one-shot upload's."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from mint_client import Client

from adapters.models import AdapterRevision, UploadPart, UploadSession
from tests.clients.conftest import ADAPTER


class CuttingProxy:
    """Forwards TCP to `target`; once `cut_after` bytes went upstream (over all connections), it closes the
    connection carrying them, once. Counts the PUT requests of parts it saw (by their request line)."""

    def __init__(self, target: str, *, cut_after: int) -> None:
        parts = urlsplit(target)
        self.upstream = (parts.hostname, parts.port)
        self.cut_after, self.sent, self.cut = cut_after, 0, False
        self.part_puts: list[bytes] = []
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, to_server: bool) -> None:
        try:
            while data := source.recv(65536):
                if to_server:
                    for line in data.split(b"\r\n"):
                        if line.startswith(b"PUT ") and b"/parts/" in line:
                            self.part_puts.append(line)
                    with self.lock:
                        self.sent += len(data)
                        cut = not self.cut and self.sent >= self.cut_after
                        self.cut = self.cut or cut
                    if cut:  # half of this chunk reaches the server, then the socket dies
                        sink.sendall(data[: len(data) // 2])
                        raise ConnectionResetError("cut by the proxy")
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def close(self) -> None:
        self.server.close()


def _export_files(root: Path, revision: AdapterRevision) -> dict[str, bytes]:
    """The export's adapter files (its policy record names the revision, so it differs by design)."""
    export = root / revision.export_uri
    files = sorted(p for p in export.rglob("*") if p.is_file() and p.name != "policy_record.json")
    return {str(p.relative_to(export)): p.read_bytes() for p in files}


@pytest.mark.parametrize("cut_after", [2_500, 6_000])  # inside the first part, inside the second
def test_a_cut_socket_mid_part_resumes_to_a_byte_identical_export(
    live_mint, adapter_dir, settings, artifact_root, cut_after
):
    settings.MINT_UPLOAD_PART_BYTES = 4096  # a tiny adapter in several parts
    directory = adapter_dir(7)
    proxy = CuttingProxy(live_mint.url, cut_after=cut_after)
    try:
        resumable = Client(proxy.url, live_mint.pipeline, upload_threshold=1, retries=3, backoff=0.05)
        revision = resumable.register(ADAPTER, directory, training_step=1)
    finally:
        proxy.close()
    assert proxy.cut, "the proxy never cut: the upload was smaller than expected"
    session = UploadSession.objects.get(adapter=live_mint.adapter)
    assert session.state == "completed"
    # Every part went through once, the cut one twice: nothing finished was sent again.
    assert len(proxy.part_puts) == session.part_count + 1, proxy.part_puts
    assert not UploadPart.objects.filter(session=session).exists()  # the parts are gone once completed

    exported = live_mint.client().wait_for(ADAPTER, revision.number, timeout=60)
    one_shot = live_mint.client(upload_threshold=1 << 40).register(
        ADAPTER, directory, training_step=2, allow_duplicate=True
    )
    live_mint.client().wait_for(ADAPTER, one_shot.number, timeout=60)
    resumed_rev = AdapterRevision.objects.get(adapter=live_mint.adapter, number=exported.number)
    one_shot_rev = AdapterRevision.objects.get(adapter=live_mint.adapter, number=one_shot.number)
    files = _export_files(artifact_root, resumed_rev)
    assert files and files == _export_files(artifact_root, one_shot_rev)
