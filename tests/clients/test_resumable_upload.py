"""Resumable uploads (the contract in clients/python/README.md), against a fake of that one edge on
httpx.MockTransport: parts retried after a dropped connection, an interrupted upload resumed by a new
client sending only the missing parts, a directory over the threshold packed into a .tar."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile

import httpx
import pytest
from mint_client import Client, UploadInterrupted

PART_SIZE = 256


class FakeUploads:
    """The server side of resumable uploads, in memory; `fail` maps a part to how many of its PUTs drop."""

    def __init__(self, fail: dict[int, int] | None = None) -> None:
        self.sessions: dict[str, dict] = {}
        self.fail = dict(fail or {})
        self.puts: list[int] = []
        self.completed: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        path = request.url.path
        if request.method == "POST" and re.fullmatch(r"/api/v1/adapters/[^/]+/uploads/", path):
            body = json.loads(request.content)
            upload_id = f"u{len(self.sessions) + 1}"
            parts = max(1, -(-body["size"] // PART_SIZE))
            self.sessions[upload_id] = {**body, "id": upload_id, "part_size": PART_SIZE, "parts": parts, "data": {}}
            return httpx.Response(201, json=self.view(upload_id))
        match = re.fullmatch(r"/api/v1/adapters/[^/]+/uploads/([^/]+)/(?:parts/(\d+)/|(complete)/)?", path)
        assert match, path
        upload_id, part, complete = match.groups()
        session = self.sessions[upload_id]
        if part is not None:
            n = int(part)
            self.puts.append(n)
            if self.fail.get(n, 0) > 0:
                self.fail[n] -= 1
                raise httpx.ReadError("connection dropped mid-part")
            assert hashlib.sha256(request.content).hexdigest() == request.headers["X-Mint-Part-Sha256"]
            assert len(request.content) == min(PART_SIZE, session["size"] - (n - 1) * PART_SIZE)
            session["data"][n] = request.content
            return httpx.Response(200, json={"part": n, "size": len(request.content), "sha256": "…"})
        if complete:
            if len(session["data"]) < session["parts"]:
                return httpx.Response(409, json={"error": {"code": "upload_incomplete", "message": "parts missing"}})
            assert hashlib.sha256(self.assembled(upload_id)).hexdigest() == session["sha256"]
            self.completed.append(json.loads(request.content or b"{}"))
            return httpx.Response(201, json={"number": 5, "revision": "r5", "state": "registered"})
        if request.method == "DELETE":
            del self.sessions[upload_id]
            return httpx.Response(204)
        return httpx.Response(200, json=self.view(upload_id))

    def view(self, upload_id: str) -> dict:
        s = self.sessions[upload_id]
        return {k: s[k] for k in ("id", "size", "sha256", "filename", "part_size", "parts")} | {
            "received": sorted(s["data"]),
            "state": "receiving",
        }

    def assembled(self, upload_id: str) -> bytes:
        data = self.sessions[upload_id]["data"]
        return b"".join(data[n] for n in sorted(data))


def client_for(fake: FakeUploads, **kwargs) -> Client:
    kwargs.setdefault("retries", 3)
    return Client(
        "http://mint.test", "mint_abc_def", transport=httpx.MockTransport(fake), sleep=lambda s: None, **kwargs
    )


@pytest.fixture
def archive(tmp_path):
    path = tmp_path / "adapter.tar"
    path.write_bytes(bytes(range(256)) * 3 + b"tail")  # 4 parts, the last 4 bytes long
    return path


def test_a_part_whose_connection_drops_is_sent_again_and_the_upload_completes(archive):
    fake = FakeUploads(fail={2: 1})
    progress: list[tuple[int, int]] = []
    revision = client_for(fake, upload_threshold=100).register(
        "support-bot",
        archive,
        training_step=9,
        parent="r4",
        progress=lambda done, total: progress.append((done, total)),
    )
    assert revision.label == "r5"
    assert fake.puts == [1, 2, 2, 3, 4]
    assert fake.assembled("u1") == archive.read_bytes()
    assert fake.completed == [{"training_step": 9, "parent": 4}]
    assert progress[-1] == (archive.stat().st_size, archive.stat().st_size)


def test_an_interrupted_upload_is_resumed_by_a_new_client_sending_only_the_missing_parts(archive):
    fake = FakeUploads(fail={3: 100})
    with pytest.raises(UploadInterrupted) as interrupted:
        client_for(fake, retries=1, upload_threshold=100).register("support-bot", archive)
    upload_id = interrupted.value.upload_id
    assert upload_id == "u1" and sorted(fake.sessions["u1"]["data"]) == [1, 2]
    assert "resume_upload" in str(interrupted.value)

    fake.fail.clear()
    fake.puts.clear()
    revision = client_for(fake).resume_upload("support-bot", upload_id, archive, training_step=3)
    assert revision.label == "r5" and fake.puts == [3, 4]
    assert fake.assembled("u1") == archive.read_bytes() and fake.completed == [{"training_step": 3}]


def test_a_directory_over_the_threshold_goes_as_a_tar_of_its_adapter_files(tmp_path):
    adapter = tmp_path / "checkpoint-10"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 4}')
    (adapter / "adapter_model.safetensors").write_bytes(b"w" * 700)
    (adapter / "optimizer.pt").write_bytes(b"not sent")
    fake = FakeUploads()
    client_for(fake, upload_threshold=500).register("support-bot", adapter, training_step=10)
    assert fake.sessions["u1"]["filename"] == "checkpoint-10.tar"
    with tarfile.open(fileobj=io.BytesIO(fake.assembled("u1"))) as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_below_the_threshold_the_upload_is_one_request(archive):
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(201, json={"number": 1, "revision": "r1", "state": "registered"})

    Client("http://mint.test", "mint_a_b", transport=httpx.MockTransport(handler)).register("support-bot", archive)
    assert seen == ["POST /api/v1/adapters/support-bot/revisions/"]


def test_a_large_adapter_goes_through_the_servers_resumable_uploads(live_mint, adapter_dir, settings):
    """Against the real routes (adapters/upload_apis.py), with small parts so that a tiny adapter takes several."""
    settings.MINT_UPLOAD_PART_BYTES = 4096
    mint = live_mint.client(upload_threshold=1)
    sent: list[str] = []
    mint._http.client.event_hooks["request"].append(lambda request: sent.append(f"{request.method} {request.url.path}"))
    revision = mint.register("support-bot", adapter_dir(41), training_step=12)
    parts = [s for s in sent if "/parts/" in s]
    assert len(parts) >= 2 and all(s.startswith("PUT ") for s in parts)
    assert sent[-1].endswith("/complete/") and not any(s.endswith("/revisions/") for s in sent)
    exported = mint.wait_for("support-bot", revision.number, timeout=60)
    assert exported.state == "exported" and exported.training_step == 12


class DropsPart:
    """A real HTTP transport that drops the connection of every PUT of one part until `healed`."""

    def __init__(self, part: int) -> None:
        self.part, self.healed, self.puts = part, False, []
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        match = re.search(r"/parts/(\d+)/$", request.url.path)
        if match:
            self.puts.append(int(match.group(1)))
            if int(match.group(1)) == self.part and not self.healed:
                raise httpx.RemoteProtocolError("server disconnected without sending a response")
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_an_upload_interrupted_against_the_server_resumes_from_the_directory(live_mint, adapter_dir, settings):
    settings.MINT_UPLOAD_PART_BYTES = 4096
    directory = adapter_dir(42)
    flaky = DropsPart(2)
    with pytest.raises(UploadInterrupted) as interrupted:
        live_mint.client(upload_threshold=1, retries=0, transport=flaky).register("support-bot", directory)
    mint = live_mint.client(upload_threshold=1)
    session = mint.upload_session("support-bot", interrupted.value.upload_id)
    assert 1 in session.received and 2 not in session.received

    flaky.healed, flaky.puts = True, []
    resumed = live_mint.client(transport=flaky).resume_upload("support-bot", session.id, directory, training_step=3)
    assert flaky.puts == session.missing()  # only what the server lacked
    assert mint.wait_for("support-bot", resumed.number, timeout=60).training_step == 3
