"""A packed MoE export loads into a real vLLM CPU server started with the node flags the layout needs.

Both layouts: vLLM's 3-D PEFT layout on a node with `--enable-mixed-moe-lora-format`, and MinT's
expert-major layout on a rank-1 node where MinT's vLLM plugin is active (the venv's entry point).
Load only: on CPU a forward pass with a MoE LoRA fails (triton), so no completion is sent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adapters.artifacts import layout, packing
from adapters.artifacts.export import engine_layout, write_engine_layout
from adapters.artifacts.spec import BaseModelSpec
from adapters.artifacts.validate import validate_adapter_dir
from adapters.base_models import spec_config_from_hf
from serving.vllm import VllmClient, VllmError
from tests.adapters.corpus import write_lora_adapter
from tests.e2e.conftest import Engine, _running

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

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


class PluginNode(Engine):
    """A rank-1 node on the tiny Qwen3-MoE: no vLLM MoE flag, MinT's plugin loaded by vLLM itself."""

    served_name = "tiny-qwen3-moe"
    max_loras, max_cpu_loras, max_lora_rank = 1, 4, 1


def _spec(tiny_moe_dir: Path) -> BaseModelSpec:
    return BaseModelSpec.from_config(
        spec_config_from_hf(json.loads((tiny_moe_dir / "config.json").read_text())), max_lora_rank=16
    )


@pytest.fixture(scope="class")
def plugin_node(tmp_path_factory, tiny_moe_dir):
    yield from _running(PluginNode, tmp_path_factory.mktemp("plugin-node") / "log", tiny_moe_dir)


@pytest.fixture(scope="class")
def expert_major(tmp_path_factory, tiny_moe_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("expert-major")
    spec = _spec(tiny_moe_dir)
    kwargs = dict(rank=1, targets=("q_proj", "v_proj"), expert_targets=EXPERT, dtype=torch.bfloat16, seed=5)
    checked = validate_adapter_dir(write_lora_adapter(root / "source", spec, layout="many_file", **kwargs), spec)
    write_engine_layout(checked, root / "packed", spec=spec, moe_layout=packing.EXPERT_MAJOR)
    record = engine_layout(checked, spec, moe_layout=packing.EXPERT_MAJOR).as_record()
    assert record["engine_flags"] == [layout.CAPABILITY] and record["min_max_lora_rank"] == 1
    # Malformed: the description promises layer 1's experts, the file lost its down_proj lora_A.
    shutil.copytree(root / "packed", root / "broken")
    file = root / "broken" / "adapter_model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(file))
    del tensors[layout.tensor_name(packing.PREFIX, 1, "down_proj", "A")]
    save_file(tensors, str(file), metadata=metadata)
    return {"packed": root / "packed", "broken": root / "broken"}


class TestExpertMajorOnAPluginNode:
    """First in the module, with class-scoped fixtures: the engine stops before the session's `moe_engine` starts."""

    def test_an_untied_rank_1_expert_major_export_loads_into_a_rank_1_plugin_node(self, plugin_node, expert_major):
        with VllmClient(plugin_node.url, timeout=120) as engine:
            engine.load_lora("expert-major-1", str(expert_major["packed"]))
            assert "expert-major-1" in engine.models(), plugin_node.log()
            engine.unload_lora("expert-major-1")
            engine.load_lora("expert-major-2", str(expert_major["packed"]))
            assert "expert-major-2" in engine.models()
            assert engine.health()

    def test_a_malformed_expert_major_file_is_refused_and_the_engine_survives(self, plugin_node, expert_major):
        with VllmClient(plugin_node.url, timeout=120) as engine:
            # vLLM answers a worker's ValueError with 500; the message is the plugin's.
            _assert_refused(engine, "broken", expert_major["broken"], "down_proj has no lora_A")
            engine.load_lora("after-broken", str(expert_major["packed"]))
            assert "after-broken" in engine.models()


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
        _assert_refused(engine, "packed-unmarked", exports["packed_2"], "is_3d_lora_weight")


def _assert_refused(engine: VllmClient, name: str, path, message: str) -> None:
    """Loading `path` as `name` is refused with `message`, nothing is registered, and the engine stays up."""
    with pytest.raises(VllmError) as refused:
        engine.load_lora(name, str(path))
    assert refused.value.status is not None and refused.value.status >= 400
    assert message in refused.value.message
    assert name not in engine.models()
    assert engine.health()
