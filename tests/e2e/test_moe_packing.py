"""A packed MoE export loads into a real vLLM CPU server started with the node flags the layout needs.

Load only: on CPU a forward pass with a MoE LoRA fails (triton), so no completion is sent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from adapters.artifacts import packing
from adapters.artifacts.export import engine_layout, write_engine_layout
from adapters.artifacts.spec import BaseModelSpec
from adapters.artifacts.validate import validate_adapter_dir
from adapters.base_models import spec_config_from_hf
from serving.vllm import VllmClient, VllmError
from tests.adapters.corpus import write_lora_adapter

pytestmark = pytest.mark.e2e

RANK = 4
EXPERT = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_moe_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-adapters")
    config = json.loads((tiny_moe_dir / "config.json").read_text())
    spec = BaseModelSpec.from_config(spec_config_from_hf(config), max_lora_rank=16)
    kwargs = dict(rank=RANK, targets=("q_proj", "v_proj"), expert_targets=EXPERT, dtype=torch.bfloat16, seed=3)
    per_expert = write_lora_adapter(root / "per-expert", spec, layout="peft", **kwargs)
    many_file = write_lora_adapter(root / "many-file", spec, layout="many_file", **kwargs)
    checked = validate_adapter_dir(many_file, spec)
    write_engine_layout(checked, root / "packed", spec=spec)
    assert engine_layout(checked, spec).as_record()["load_request"] == packing.LOAD_REQUEST
    # The node loads from its own copy; any directory with the two files will do here.
    shutil.copytree(root / "packed", root / "packed-2")
    return {"per_expert": per_expert, "packed": root / "packed", "packed_2": root / "packed-2"}


def test_a_packed_moe_export_loads_into_a_real_engine_with_the_layout_flags(moe_engine, exports):
    with VllmClient(moe_engine.url, timeout=120) as engine:
        engine.load_lora("packed-1", str(exports["packed"]), **packing.LOAD_REQUEST)
        assert "packed-1" in engine.models(), moe_engine.log()
        # The same node still loads the per-expert layout (mixed format).
        engine.load_lora("per-expert-1", str(exports["per_expert"]))
        assert {"packed-1", "per-expert-1"} <= set(engine.models())
        assert engine.health()


def test_a_packed_export_without_the_load_request_marker_is_refused_and_the_engine_survives(moe_engine, exports):
    with VllmClient(moe_engine.url, timeout=120) as engine:
        with pytest.raises(VllmError) as refused:
            engine.load_lora("packed-unmarked", str(exports["packed_2"]))
        assert refused.value.status is not None and refused.value.status >= 400
        assert "is_3d_lora_weight" in refused.value.message
        assert "packed-unmarked" not in engine.models()
        assert engine.health()
