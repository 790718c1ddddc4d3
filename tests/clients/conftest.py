"""Fixtures for the SDK's tests: the real Django app behind `live_server`, keys of two people, adapter files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from mint_client import Client

from adapters.models import Adapter
from tenants import services
from tenants.access import Actor
from tests.adapters.corpus import TINY_DENSE, make_bad_adapter, write_lora_adapter

ADAPTER = "support-bot"


@dataclass
class LiveMint:
    """The app served on a real port, tenant A's adapter on the dense test model, and three keys:
    `pipeline`, `owner_deploy` and `owner_both` (pipeline and deploy; all created by the owner) and
    `approver_deploy` (created by the approver)."""

    url: str
    pipeline: str
    owner_both: str
    owner_deploy: str
    approver_deploy: str
    approver_key_prefix: str
    other_tenant_key: str
    adapter: Adapter

    def client(self, key: str | None = None, **kwargs) -> Client:
        kwargs.setdefault("retries", 1)
        kwargs.setdefault("backoff", 0.05)
        return Client(self.url, key or self.pipeline, **kwargs)


@pytest.fixture
def live_mint(transactional_db, live_server, tenant_a, tenant_b, dense_base, artifact_root) -> LiveMint:
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name=ADAPTER, base_model=dense_base)
    approver = tenant_a.users["approver"]
    approver_key, approver_token = services.api_key_create(
        tenant=tenant_a.tenant, name="approver-deploy", scopes=["deploy"], created_by=approver, by=Actor(user=approver)
    )
    return LiveMint(
        url=live_server.url,
        pipeline=tenant_a.key("pipeline")[1],
        owner_both=tenant_a.key("pipeline", "deploy")[1],
        owner_deploy=tenant_a.key("deploy")[1],
        approver_deploy=approver_token,
        approver_key_prefix=approver_key.prefix,
        other_tenant_key=tenant_b.key("pipeline", "deploy")[1],
        adapter=adapter,
    )


@pytest.fixture
def adapter_dir(tmp_path):
    """`adapter_dir(seed)`: a valid PEFT adapter directory for the dense test model (a new one per seed)."""

    def make(seed: int = 0) -> Path:
        return write_lora_adapter(tmp_path / f"adapter-{seed}", TINY_DENSE, rank=4, alpha=8.0, seed=seed)

    return make


@pytest.fixture
def bad_adapter_dir(tmp_path) -> Path:
    """An adapter whose q_proj lora_A has the wrong shape: refused by validation, after registration."""
    return make_bad_adapter("wrong_shape", tmp_path / "bad")
