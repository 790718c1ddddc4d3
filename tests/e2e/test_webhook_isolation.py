"""Webhook receivers that never answer hold only the webhook worker: another tenant's validation is not delayed.

Real workers as `make run` starts them (the control worker, prefork with two processes; the webhooks worker,
threads), a receiver on loopback that accepts connections and never answers (private addresses allowed here
only), and two hostile tenants whose deliveries to it each hold an attempt for MINT_WEBHOOK_TIMEOUT_S.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from adapters.models import Adapter, AdapterRevision, BaseModel
from mint_site.celery import app as celery_app
from tenants.access import Actor
from tests.adapters.corpus import TINY_DENSE, write_lora_adapter
from tests.adapters.fixtures import spec_config, uploads_of
from tests.e2e.conftest import log_of
from tests.factories import MembershipFactory, TenantFactory, UserFactory
from webhooks import services as webhooks
from webhooks.tasks import WEBHOOK_QUEUE

pytestmark = pytest.mark.e2e

HELD_S = 40  # each attempt on the silent receiver holds its worker this long


class SilentReceiver:
    """Accepts connections on loopback and never answers a byte."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()
        self.listener.close()


@pytest.fixture
def silent_receiver():
    receiver = SilentReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def empty_queues():
    def purge() -> None:
        with celery_app.connection_for_write() as conn:
            for queue in ("control", WEBHOOK_QUEUE):
                conn.default_channel.queue_purge(queue)

    purge()
    yield
    purge()


def hostile_tenant(slug: str, url: str):
    tenant = TenantFactory(slug=slug)
    owner = UserFactory(username=f"{slug}-owner")
    MembershipFactory(user=owner, tenant=tenant, role="owner")
    endpoint, _ = webhooks.endpoint_create(
        tenant=tenant, url=url, created_by=owner, by=Actor(user=owner), events=["revision.validated"]
    )
    return endpoint, owner


def test_a_silent_receiver_delays_no_other_tenants_validation(
    tenant_b,
    artifact_root,
    tmp_path,
    settings,
    silent_receiver,
    empty_queues,
    start_control_worker,
    start_webhook_worker,
    supervisor,
):
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = True  # for endpoint_create here; the workers get it from their env
    env = {
        "MINT_ARTIFACT_ROOT": str(artifact_root),
        "MINT_WEBHOOK_ALLOW_PRIVATE": "1",
        "MINT_WEBHOOK_TIMEOUT_S": str(HELD_S),
        "MINT_WEBHOOK_CONNECT_TIMEOUT_S": "2",
    }
    start_control_worker(extra_env=env)
    start_webhook_worker(extra_env=env)
    url = f"http://127.0.0.1:{silent_receiver.port}/hook"
    for slug in ("mallory", "trudy"):  # each tenant holds one attempt at a time (MINT_WEBHOOK_TENANT_CONCURRENCY)
        endpoint, owner = hostile_tenant(slug, url)
        for _ in range(3):
            webhooks.endpoint_ping(endpoint=endpoint, by=Actor(user=owner))
    deadline = time.monotonic() + 60
    while len(silent_receiver.accepted) < 2:  # both tenants' attempts are in flight, holding their workers
        assert time.monotonic() < deadline, log_of(supervisor, "webhooks")
        time.sleep(0.1)

    base = BaseModel.objects.create(
        name="test-dense", architecture="dense", config=spec_config(TINY_DENSE), max_lora_rank=16
    )
    adapter = Adapter.objects.create(tenant=tenant_b.tenant, name="support-bot", base_model=base)
    good = write_lora_adapter(tmp_path / "good", TINY_DENSE, rank=8, alpha=16.0)
    started = time.monotonic()
    created = tenant_b.client_as("developer").post(
        "/api/v1/adapters/support-bot/revisions/", {"files": uploads_of(good)}, format="multipart"
    )
    assert created.status_code == 201, created.content
    revision = AdapterRevision.objects.get(adapter=adapter, number=1)
    while True:
        state = AdapterRevision.objects.filter(id=revision.id).values_list("state", flat=True).get()
        if state != "registered":
            break
        assert time.monotonic() - started < HELD_S / 2, f"validation waited; {log_of(supervisor, 'worker')}"
        time.sleep(0.2)
    assert state in ("validated", "exported"), AdapterRevision.objects.get(id=revision.id).failure_reason
    assert time.monotonic() - started < HELD_S / 2
    assert len(silent_receiver.accepted) >= 2  # the hostile attempts were still being held all along
