"""Fixtures (loaded for the whole suite) for the adapter lifecycle: base models on the test specs, adapters, uploads."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from adapters.artifacts.spec import BaseModelSpec
from adapters.models import Adapter, BaseModel
from tests.adapters.corpus import TINY_DENSE, TINY_MOE, write_lora_adapter


def spec_config(spec: BaseModelSpec) -> dict:
    return {
        "architecture": spec.architecture,
        "num_layers": spec.num_layers,
        "num_experts": spec.num_experts,
        "module_shapes": {k: list(v) for k, v in spec.module_shapes.items()},
        "expert_module_shapes": {k: list(v) for k, v in spec.expert_module_shapes.items()},
    }


@pytest.fixture
def dense_base(db) -> BaseModel:
    return BaseModel.objects.create(
        name="test-dense", architecture="dense", config=spec_config(TINY_DENSE), max_lora_rank=TINY_DENSE.max_lora_rank
    )


@pytest.fixture
def moe_base(db) -> BaseModel:
    return BaseModel.objects.create(
        name="test-moe", architecture="moe", config=spec_config(TINY_MOE), max_lora_rank=TINY_MOE.max_lora_rank
    )


@pytest.fixture
def adapter_a(tenant_a, dense_base) -> Adapter:
    return Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=dense_base)


@pytest.fixture
def adapter_b(tenant_b, dense_base) -> Adapter:
    return Adapter.objects.create(tenant=tenant_b.tenant, name="globex-secret-bot", base_model=dense_base)


def uploads_of(directory: Path) -> list[SimpleUploadedFile]:
    """Multipart uploads for every file in `directory` (by base name)."""
    return [SimpleUploadedFile(p.name, p.read_bytes()) for p in sorted(directory.rglob("*")) if p.is_file()]


@pytest.fixture
def good_adapter_dir(tmp_path) -> Path:
    return write_lora_adapter(tmp_path / "good", TINY_DENSE, rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
