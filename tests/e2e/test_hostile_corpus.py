"""The hostile corpus against a real web server and `make run`'s control worker: nobody else pays for it.

Tenant A uploads every input of tests/adapters/hostile.py over HTTP, and tenant B uploads a good
adapter right after the first four. Each hostile revision must end `failed` with its own code
within its hang timeout, B's must reach `exported`, the worker's processes must be the ones it
started with, and nothing may be left on disk: no scratch files, no spooled request bodies, and,
once collected, no upload of A's. Bodies that are refused outright (too large, too many parts)
are refused quickly and store nothing. Time bounds here are hang timeouts, not performance targets.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

import httpx
import pytest
from django.utils import timezone

from adapters import collect
from adapters.models import Adapter, AdapterRevision, BaseModel
from devtools.supervisor import wait_for
from tenants.models import Tenant
from tests.adapters.corpus import write_lora_adapter
from tests.adapters.fixtures import spec_config
from tests.adapters.hostile import HOSTILE_CASES, SPEC
from tests.e2e.conftest import log_of, pool_processes
from tests.e2e.test_lifecycle_worker import control_queue  # noqa: F401 - a fixture

pytestmark = pytest.mark.e2e

VICTIM_AFTER = 4  # B uploads right after this many hostile uploads


def multipart(paths: list[Path]) -> list[tuple[str, tuple[str, bytes]]]:
    field = "archive" if len(paths) == 1 and not paths[0].name.endswith((".json", ".safetensors")) else "files"
    return [(field, (p.name, p.read_bytes())) for p in paths]


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.fixture
def world(tenant_a, tenant_b, artifact_root, control_queue, start_control_worker, start_web, tmp_path):  # noqa: F811
    base = BaseModel.objects.create(name="tiny-dense", architecture="dense", config=spec_config(SPEC))
    Adapter.objects.create(tenant=tenant_a.tenant, name="attacker", base_model=base)
    # The whole corpus is sent at once, past the write burst of a default plan; the throttle is tested elsewhere.
    Tenant.objects.filter(id=tenant_a.tenant.id).update(api_write_rpm=6000)
    Adapter.objects.create(tenant=tenant_b.tenant, name="victim", base_model=base)
    scratch, spool = tmp_path / "scratch", tmp_path / "spool"
    scratch.mkdir()
    spool.mkdir()
    env = {"MINT_ARTIFACT_ROOT": str(artifact_root), "MINT_WORK_DIR": str(scratch), "TMPDIR": str(spool)}
    worker = start_control_worker(extra_env=env)
    url = start_web(extra_env=env)
    wait_for(lambda: len(pool_processes(worker)) == 2, timeout=60, what="the worker's pool")
    return {"url": url, "worker": worker, "scratch": scratch, "spool": spool}


def wait_until_over(revision_id: int, timeout: float, supervisor) -> AdapterRevision:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        revision = AdapterRevision.objects.get(id=revision_id)
        if revision.state in ("exported", "failed"):
            return revision
        time.sleep(0.2)
    raise AssertionError(f"r{revision.number} stuck in {revision.state}\n{log_of(supervisor, 'worker')[-6000:]}")


def test_the_hostile_corpus_fails_case_by_case_and_costs_the_other_tenant_nothing(
    world, tenant_a, tenant_b, artifact_root, supervisor, tmp_path
):
    pools = sorted(p.pid for p in pool_processes(world["worker"]))
    attacker = {"Authorization": f"Bearer {tenant_a.key('pipeline')[1]}"}
    victim = {"Authorization": f"Bearer {tenant_b.key('pipeline')[1]}"}
    good = write_lora_adapter(tmp_path / "good", SPEC, rank=4, alpha=8.0)
    sent: list[tuple[str, str, int]] = []  # (case, expected code, revision number)
    victim_number = None
    with httpx.Client(base_url=world["url"], timeout=120) as http:
        for index, case in enumerate(HOSTILE_CASES):
            (tmp_path / "corpus" / case.name).mkdir(parents=True)
            paths = case.build(tmp_path / "corpus" / case.name)
            answer = http.post("/api/v1/adapters/attacker/revisions/", headers=attacker, files=multipart(paths))
            if answer.status_code == 400:  # seen at registration (adapters/artifacts/precheck.py), with the same code
                assert answer.json()["error"]["code"] == case.code, (case.name, answer.text)
            else:
                assert answer.status_code == 201, (case.name, answer.text)
                sent.append((case.name, case.code, answer.json()["number"]))
            if index + 1 == VICTIM_AFTER:
                mine = http.post(
                    "/api/v1/adapters/victim/revisions/", headers=victim, files=multipart(sorted(good.iterdir()))
                )
                assert mine.status_code == 201, mine.text
                victim_number = mine.json()["number"]

    revision = AdapterRevision.objects.get(adapter__name="victim", number=victim_number)
    assert wait_until_over(revision.id, 180, supervisor).state == "exported"

    for name, code, number in sent:
        hostile = AdapterRevision.objects.get(adapter__name="attacker", number=number)
        timeout = next(c.hang_timeout_s for c in HOSTILE_CASES if c.name == name) + 60
        over = wait_until_over(hostile.id, timeout, supervisor)
        assert (name, over.state, over.failure_code) == (name, "failed", code), over.failure_reason

    assert world["worker"].poll() is None
    assert sorted(p.pid for p in pool_processes(world["worker"])) == pools  # no pool process died
    # Validation and export leave no scratch files: a task removes its directory just after it records the
    # outcome, so the last one may still be at it for a moment on a busy machine.
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: entries(world["scratch"]) == [], timeout=30, what="scratch emptied")
    assert entries(world["scratch"]) == []
    assert entries(world["spool"]) == []  # nor the web server spooled request bodies

    # Once collected, nothing of A's uploads stays in the store; B's export is untouched.
    collect.uploads_collect(now=timezone.now() + timezone.timedelta(days=365))
    attacker_root = artifact_root / f"t/{tenant_a.tenant.id}"
    assert entries(attacker_root) == []
    assert AdapterRevision.objects.filter(adapter__name="attacker", purged_at__isnull=True).count() == 0
    tenant_a.tenant.refresh_from_db()
    assert (tenant_a.tenant.stored_bytes, tenant_a.tenant.stored_revisions) == (0, 0)
    assert (artifact_root / AdapterRevision.objects.get(id=revision.id).export_uri / "policy_record.json").is_file()


def raw_request(url: str, head: str, body_chunks=()) -> int:
    """Send a request by hand (a claimed length, or a chunked body cut short) and return the status."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode())
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed without reading the rest: that is the point
        return int(sock.makefile("rb").readline().split()[1])


def test_bodies_that_are_too_large_or_too_many_are_refused_quickly_and_store_nothing(
    world, tenant_a, artifact_root, supervisor
):
    token = tenant_a.key("pipeline")[1]
    url = world["url"]
    upload = "/api/v1/adapters/attacker/revisions/"
    # A claimed 100 GB: refused from the headers, before a byte is read.
    claimed = (
        f"POST {upload} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: multipart/form-data; boundary=x\r\nContent-Length: {10**11}\r\n\r\n"
    )
    assert raw_request(url, claimed) == 413
    # A chunked body that never ends: cut off once past the tenant's limit.
    tenant_a.tenant.max_upload_bytes = 1024 * 1024
    tenant_a.tenant.save(update_fields=["max_upload_bytes"])
    chunked = (
        f"POST {upload} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "Content-Type: multipart/form-data; boundary=x\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
    assert raw_request(url, chunked, [chunk] * 1000) == 413  # 64 MB offered, ~1 MB read
    # 90,000 parts to the login form: refused (too many fields, or too large a body) and the server lives on.
    parts = b"".join(b'--b\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % i for i in range(90_000))
    body = parts + b"--b--\r\n"
    started = time.monotonic()
    answer = httpx.post(f"{url}/login/", content=body, headers={"content-type": "multipart/form-data; boundary=b"})
    assert answer.status_code in (400, 413), answer.status_code
    assert time.monotonic() - started < 60  # a hang timeout
    assert httpx.get(f"{url}/healthz").status_code == 200
    # 100,001 empty files to the upload route: one more than it takes; refused as it parses.
    tenant_a.tenant.max_upload_bytes = 512 * 1024 * 1024
    tenant_a.tenant.save(update_fields=["max_upload_bytes"])
    files = [("files", (f"f{i}", b"")) for i in range(100_001)]
    answer = httpx.post(f"{url}{upload}", headers={"Authorization": f"Bearer {token}"}, files=files, timeout=300)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "too_many_files")
    assert AdapterRevision.objects.count() == 0
    assert entries(artifact_root) == []
    assert entries(world["spool"]) == []
