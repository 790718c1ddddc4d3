"""MinT's vLLM plugin: an expert-major export fills vLLM's MoE LoRA slots bit for bit as the per-expert source does.

In-process, no server: vLLM's own `LRUCacheWorkerLoRAManager.add_adapter` (load, pack, scale,
activate) runs against real `FusedMoEWithLoRA` slot buffers made by their own
`create_lora_weights`. Not real: the model object and the MoE runner under each LoRA layer
(never touched while loading), and the manager's `__init__` (its attributes are set as it
would set them for a gated 2-D MoE such as Qwen3-MoE, with vLLM's own expert name mapping).
The live server path is tests/e2e/test_moe_packing.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mint_vllm_plugin
from adapters.artifacts import layout, packing
from adapters.artifacts.export import engine_layout, moe_layout_for, write_engine_layout
from adapters.artifacts.validate import validate_adapter_dir
from devtools.local_node import engine_installed
from mint_vllm_plugin import detect
from tests.adapters.corpus import TINY_MOE, lora_config, lora_tensors, write_adapter_files

# Without the engine these tests fail at set-up (tests/conftest.py) unless `-m "not engine"` deselects them.
pytestmark = pytest.mark.engine
if engine_installed():
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from mint_vllm_plugin import loader

SPEC = dataclasses.replace(TINY_MOE, num_experts=8)  # 2 layers x 8 experts, hidden 64, moe_intermediate 32
EXPERT = ("gate_proj", "up_proj", "down_proj")
MODULES = [f"model.layers.{layer}.mlp.experts" for layer in range(SPEC.num_layers)]


@pytest.fixture(autouse=True, scope="module")
def plugin():
    mint_vllm_plugin.register()
    assert getattr(WorkerLoRAManager._load_adapter, "_mint_expert_major_patch", False)


def moe_layer(config: LoRAConfig) -> FusedMoEWithLoRA:
    """A FusedMoEWithLoRA with real slot buffers, built without a MoE runner (loading never uses it)."""
    layer = FusedMoEWithLoRA.__new__(FusedMoEWithLoRA)
    torch.nn.Module.__init__(layer)
    hidden, inter = SPEC.expert_module_shapes["gate_proj"]
    parallel = SimpleNamespace(tp_size=1, tp_rank=0, ep_rank=0, use_ep=False)
    layer.moe_config = SimpleNamespace(
        hidden_dim=hidden,
        num_local_experts=SPEC.num_experts,
        num_experts=SPEC.num_experts,
        intermediate_size_per_partition=inter,
        experts_per_token=2,
        moe_parallel_config=parallel,
    )
    layer.tp_size, layer.tp_rank, layer.device, layer._w13_slices = 1, 0, torch.device("cpu"), 2
    layer.create_lora_weights(config.max_loras, config)
    return layer


def worker(*, max_lora_rank: int, dtype: torch.dtype, shared_loras: bool = False) -> LRUCacheWorkerLoRAManager:
    """vLLM's worker LoRA manager over a gated 2-D MoE with MODULES, attributes as `__init__` sets them."""
    config = LoRAConfig(
        max_lora_rank=packing.node_max_lora_rank(max_lora_rank), max_loras=1, max_cpu_loras=2, lora_dtype=dtype
    )
    mapping = [
        name.rstrip(".")
        for _, name, _, _ in RoutedExperts.build_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", SPEC.num_experts
        )
    ]
    manager = LRUCacheLoRAModelManager.__new__(LRUCacheLoRAModelManager)
    manager.__dict__.update(
        lora_config=config,
        model=SimpleNamespace(),
        supported_lora_modules=["qkv_proj", "o_proj", "experts"],
        packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"], "experts": mapping},
        modules={name: moe_layer(config) for name in MODULES},
        packed_modules={name: [f"{name.removesuffix('.experts')}.{m}" for m in mapping] for name in MODULES},
        is_pooling_model=False,
        _enable_moe_shared_loras=shared_loras,
        _enable_mixed_moe_lora_format=False,
        _is_3d_moe_model=False,
        _is_non_gated_moe=False,
        _classification_head=None,
        _pooling_task=None,
        supported_modules_to_save=set(),
        lora_index_to_id=[None],
        moe_ep_load_spec=None,
    )
    manager._registered_adapters = AdapterLRUCache(2, manager.deactivate_adapter)
    manager._active_adapters = AdapterLRUCache(1, manager._deactivate_adapter)
    w = LRUCacheWorkerLoRAManager.__new__(LRUCacheWorkerLoRAManager)
    w.__dict__.update(
        _adapter_manager=manager,
        _lora_model_cls=LoRAModel,
        lora_config=config,
        max_position_embeddings=None,
        vocab_size=128,
    )
    return w


def slots(w: LRUCacheWorkerLoRAManager) -> list[torch.Tensor]:
    found = []
    for name in MODULES:
        m = w._adapter_manager.modules[name]
        found += [t[0].clone() for t in (*m.w13_lora_a_stacked, *m.w13_lora_b_stacked)]
        found += [m.w2_lora_a_stacked[0][0].clone(), m.w2_lora_b_stacked[0][0].clone()]
    return found


def source(root: Path, *, rank: int, tied: bool, alpha: float = 12.0, seed: int = 1) -> Path:
    tensors = lora_tensors(
        SPEC, rank=rank, targets=("q_proj", "v_proj"), expert_targets=EXPERT, dtype=torch.bfloat16, seed=seed
    )
    if tied:
        for name in [n for n in tensors if ".gate_proj.lora_A" in n]:
            tensors[name.replace("gate_proj", "up_proj")] = tensors[name].clone()
    config = lora_config(rank=rank, alpha=alpha, targets=("q_proj", "v_proj", *EXPERT))
    return write_adapter_files(root, config, tensors)


def export(src: Path, dest: Path) -> Path:
    write_engine_layout(validate_adapter_dir(src, SPEC), dest, spec=SPEC, moe_layout=packing.EXPERT_MAJOR)
    return dest


def load(w: LRUCacheWorkerLoRAManager, path: Path, lora_id: int = 1) -> None:
    w.add_adapter(LoRARequest(lora_name=f"a{lora_id}", lora_int_id=lora_id, lora_path=str(path)))


@pytest.mark.parametrize("rank", [1, 4])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_expert_major_export_fills_the_slots_bit_for_bit_as_its_per_expert_source(tmp_path, rank, tied, dtype):
    src = source(tmp_path / "src", rank=rank, tied=tied)
    packed = export(src, tmp_path / "packed")
    by_vllm, by_plugin = worker(max_lora_rank=rank, dtype=dtype), worker(max_lora_rank=rank, dtype=dtype)

    load(by_vllm, src)
    load(by_plugin, packed)

    expected, got = slots(by_vllm), slots(by_plugin)
    assert all(t.dtype == dtype for t in got)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert any(t.abs().sum() > 0 for t in got)  # the slots hold the adapter, not zeros
    # alpha/r (12 or 3) is not a power of two: the scaled B rounds, so order and dtype of the product matter.
    assert by_plugin._adapter_manager.modules[MODULES[0]].adapter_enabled[0] == 1


def test_an_adapter_with_per_module_alpha_gets_each_experts_own_scaling(tmp_path):
    src = source(tmp_path / "src", rank=2, tied=False)
    config = json.loads((src / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"experts.3.down_proj": 3.0, "layers.1.mlp.experts.5.gate_proj": 7.0}
    (src / "adapter_config.json").write_text(json.dumps(config))
    packed = export(src, tmp_path / "packed")
    (packed / "adapter_config.json").write_text(json.dumps(config))
    by_vllm, by_plugin = worker(max_lora_rank=8, dtype=torch.bfloat16), worker(max_lora_rank=8, dtype=torch.bfloat16)

    load(by_vllm, src)
    load(by_plugin, packed)

    assert all(torch.equal(a, b) for a, b in zip(slots(by_vllm), slots(by_plugin), strict=True))


def test_other_adapters_load_through_vllms_own_path(tmp_path, monkeypatch):
    src = source(tmp_path / "src", rank=2, tied=False)
    three_d = tmp_path / "3d"
    write_engine_layout(validate_adapter_dir(src, SPEC), three_d, spec=SPEC)
    read = []
    monkeypatch.setattr(
        loader.ExpertMajorLoRAModel, "from_local_checkpoint", classmethod(lambda cls, *a, **k: read.append(a))
    )
    w = worker(max_lora_rank=8, dtype=torch.bfloat16)

    load(w, src)
    assert detect.adapter_description(str(src)) is None
    assert detect.adapter_description(str(three_d)) is None
    assert detect.adapter_description(str(tmp_path / "missing")) is None
    assert read == []
    assert w._adapter_manager.modules[MODULES[0]].w2_lora_b_stacked[0].abs().sum() > 0


def test_plain_vllm_refuses_an_expert_major_file(tmp_path):
    packed = export(source(tmp_path / "src", rank=1, tied=False), tmp_path / "packed")
    w = worker(max_lora_rank=1, dtype=torch.bfloat16)
    original = WorkerLoRAManager._load_adapter.__wrapped__

    with pytest.raises(ValueError, match=r"experts\.gate_proj"):
        original(w, LoRARequest(lora_name="x", lora_int_id=1, lora_path=str(packed)))


def test_a_malformed_expert_major_file_is_refused_before_anything_is_registered(tmp_path):
    packed = export(source(tmp_path / "src", rank=1, tied=False), tmp_path / "packed")
    from safetensors.torch import load_file, save_file

    file = packed / "adapter_model.safetensors"
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(file))
    del tensors[layout.tensor_name(packing.PREFIX, 1, "up_proj", "B")]
    save_file(tensors, str(file), metadata=metadata)
    w = worker(max_lora_rank=1, dtype=torch.bfloat16)

    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.up_proj has no lora_B"):
        load(w, packed)
    assert w.list_adapters() == set()


def test_an_expert_major_file_for_another_model_shape_is_refused(tmp_path):
    other = dataclasses.replace(SPEC, num_experts=4)
    tensors = lora_tensors(other, rank=1, targets=("q_proj",), expert_targets=EXPERT, dtype=torch.bfloat16)
    src = write_adapter_files(tmp_path / "src", lora_config(rank=1, targets=("q_proj", *EXPERT)), tensors)
    write_engine_layout(validate_adapter_dir(src, other), tmp_path / "p", spec=other, moe_layout=packing.EXPERT_MAJOR)
    w = worker(max_lora_rank=1, dtype=torch.bfloat16)

    with pytest.raises(ValueError, match="4 experts x rank 1"):
        load(w, tmp_path / "p")
    assert w.list_adapters() == set()


def test_a_node_with_shared_moe_loras_refuses_the_layout(tmp_path):
    packed = export(source(tmp_path / "src", rank=1, tied=False), tmp_path / "packed")
    w = worker(max_lora_rank=1, dtype=torch.bfloat16, shared_loras=True)

    with pytest.raises(ValueError, match="enable-moe-shared-loras"):
        load(w, packed)


def test_the_plugin_stays_dormant_on_another_vllm_version(monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    installed = []
    monkeypatch.setattr(loader, "install", lambda: installed.append(1) or True)

    mint_vllm_plugin.register()

    assert installed == []
    assert "not installing" in caplog.text


def test_the_expert_major_record_asks_placement_for_a_plugin_node_at_the_adapters_own_rank(tmp_path):
    checked = validate_adapter_dir(source(tmp_path / "src", rank=1, tied=False), SPEC)

    assert engine_layout(checked, SPEC, moe_layout=packing.EXPERT_MAJOR).as_record() == {
        "engine_layout": "mint_expert_major",
        "engine_flags": [layout.CAPABILITY],
        "load_request": {},
        "min_max_lora_rank": 1,
    }
    assert engine_layout(checked, SPEC).as_record()["engine_layout"] == packing.LAYOUT
    assert moe_layout_for({}) == packing.LAYOUT
    assert moe_layout_for({"moe_lora_layout": "mint_expert_major"}) == packing.EXPERT_MAJOR
    # A frozen revision keeps its layout whatever the base model says now.
    assert moe_layout_for({"moe_lora_layout": "mint_expert_major"}, {"engine_layout": "peft_3d_moe"}) == packing.LAYOUT
