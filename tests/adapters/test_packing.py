"""Packing per-expert MoE LoRA tensors into vLLM's 3-D PEFT layout: exact, streamed, and loaded as vLLM reads it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from adapters.artifacts import packing
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.export import engine_layout, write_engine_layout
from adapters.artifacts.safetensors_io import iter_tensors, read_header
from adapters.artifacts.validate import validate_adapter_dir
from tests.adapters.corpus import TINY_DENSE, TINY_MOE, lora_config, lora_tensors, source_bytes, write_adapter_files

LIMIT = 64 * 1024 * 1024
ALL_EXPERT = ("gate_proj", "up_proj", "down_proj")
PACKED = "adapter_model.safetensors"


def moe_adapter(root: Path, layout: str = "peft", *, expert_targets=ALL_EXPERT, rank: int = 4, dtype=torch.bfloat16):
    tensors = lora_tensors(
        TINY_MOE, rank=rank, targets=("q_proj", "v_proj"), expert_targets=expert_targets, dtype=dtype
    )
    config = lora_config(rank=rank, targets=("q_proj", "v_proj", *expert_targets))
    return validate_adapter_dir(write_adapter_files(root, config, tensors, layout), TINY_MOE), tensors


@pytest.mark.parametrize("layout", ["peft", "many_file"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpacking_a_packed_export_gives_the_source_bit_for_bit(tmp_path, layout, dtype):
    adapter, _ = moe_adapter(tmp_path / "src", layout, dtype=dtype)
    write_engine_layout(adapter, tmp_path / "out", spec=TINY_MOE)

    unpacked = {
        name: (dt, shape, bytes(data)) for name, dt, shape, data in packing.unpack_moe(tmp_path / "out" / PACKED)
    }
    assert unpacked == source_bytes(adapter)


def test_packing_stacks_each_layer_and_projection_into_one_tensor(tmp_path):
    adapter, _ = moe_adapter(tmp_path / "src", "many_file", rank=2)
    write_engine_layout(adapter, tmp_path / "out", spec=TINY_MOE)
    header = read_header(tmp_path / "out" / PACKED, max_header_bytes=LIMIT)

    # 2 layers x (4 experts x 3 projections x 2) = 48 expert tensors become 2 x 4; attention stays 2 x 2 x 2.
    assert adapter.tensor_count == 48 + 8
    assert len(header.tensors) == 8 + 8
    e, r, (hidden, inter) = TINY_MOE.num_experts, 2, TINY_MOE.expert_module_shapes["gate_proj"]
    base = "base_model.model.model.layers.1.mlp.experts"
    assert header.tensors[f"{base}.base_layer.lora_A.weight"].shape == (e * 2 * r, hidden)
    assert header.tensors[f"{base}.base_layer.lora_B.weight"].shape == (2 * inter, 2 * r * e)
    assert header.tensors[f"{base}.lora_A.weight"].shape == (e * r, inter)
    assert header.tensors[f"{base}.lora_B.weight"].shape == (hidden, r * e)
    assert header.metadata["format"] == "pt"
    assert json.loads(header.metadata[packing.METADATA_KEY])["packed_rank"] == 2 * r


def test_projections_the_adapter_leaves_out_are_zeros_and_stay_out_when_unpacked(tmp_path):
    adapter, _ = moe_adapter(tmp_path / "src", expert_targets=("up_proj",))
    write_engine_layout(adapter, tmp_path / "out", spec=TINY_MOE)
    packed = dict(iter_tensors(tmp_path / "out" / PACKED))
    base = "base_model.model.model.layers.0.mlp.experts"
    assert not packed[f"{base}.lora_B.weight"].any()  # down_proj: an exact no-op
    inter = TINY_MOE.expert_module_shapes["gate_proj"][1]
    assert packed[f"{base}.base_layer.lora_A.weight"].shape == (4 * 4, 64)  # up alone keeps rank 4
    assert not packed[f"{base}.base_layer.lora_B.weight"][:inter].any()  # gate rows: zeros
    unpacked = {name for name, *_ in packing.unpack_moe(tmp_path / "out" / PACKED)}
    assert unpacked == set(source_bytes(adapter))


def tie_gate_and_up(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Rewrite a PEFT-layout adapter so every expert's up_proj lora_A equals its gate_proj lora_A."""
    from safetensors.torch import save_file

    for name in list(tensors):
        if ".gate_proj.lora_A." in name:
            tensors[name.replace("gate_proj", "up_proj")] = tensors[name].clone()
    save_file(tensors, str(root / PACKED), metadata={"format": "pt"})


@pytest.mark.parametrize("tied", [False, True])
def test_vllm_reads_the_packed_layout_back_as_each_experts_own_weights(tmp_path, tied):
    """Run vLLM's own 3-D -> per-expert conversion on the packed tensors and compare with the source."""
    from vllm.lora.model_manager import LoRAModelManager

    adapter, source = moe_adapter(tmp_path / "src", rank=2)
    if tied:
        tie_gate_and_up(tmp_path / "src", source)
        adapter = validate_adapter_dir(tmp_path / "src", TINY_MOE)
    write_engine_layout(adapter, tmp_path / "out", spec=TINY_MOE)
    assert engine_layout(adapter, TINY_MOE).min_max_lora_rank == (2 if tied else 4)
    packed = dict(iter_tensors(tmp_path / "out" / PACKED))
    layer, e, r = 1, TINY_MOE.num_experts, 2
    base = f"base_model.model.model.layers.{layer}.mlp.experts"
    module_name = f"model.layers.{layer}.mlp.experts"
    loras = {
        module_name + ".base_layer": SimpleNamespace(
            lora_a=packed[f"{base}.base_layer.lora_A.weight"], lora_b=packed[f"{base}.base_layer.lora_B.weight"]
        ),
        module_name: SimpleNamespace(lora_a=packed[f"{base}.lora_A.weight"], lora_b=packed[f"{base}.lora_B.weight"]),
    }
    manager = SimpleNamespace(
        _get_lora_layer_weights=lambda model, name: model.loras.get(name),
        model=SimpleNamespace(config=SimpleNamespace(architectures=["Qwen3MoeForCausalLM"])),
    )
    module = SimpleNamespace(local_num_experts=e, global_num_experts=e, ep_rank=0)
    LoRAModelManager._convert_3d_to_2d_moe_lora(manager, SimpleNamespace(loras=loras), module, module_name)
    lora_a, lora_b = loras[module_name].lora_a, loras[module_name].lora_b  # [w1, w2, w3], each [E, ...]

    for expert in range(e):
        for slot, proj in ((0, "gate_proj"), (1, "down_proj"), (2, "up_proj")):
            a = source[f"{base}.{expert}.{proj}.lora_A.weight"]
            b = source[f"{base}.{expert}.{proj}.lora_B.weight"]
            got = lora_b[slot][expert].double() @ lora_a[slot][expert].double()
            assert torch.equal(got, b.double() @ a.double()), (expert, proj)
        # gate (w1) and up (w3) keep their own factors: rows 0..r and r..2r of the shared lora_A (tied: 0..r).
        assert torch.equal(lora_a[0][expert][:r], source[f"{base}.{expert}.gate_proj.lora_A.weight"])
        up_rows = slice(0, r) if tied else slice(r, 2 * r)
        assert torch.equal(lora_a[2][expert][up_rows], source[f"{base}.{expert}.up_proj.lora_A.weight"])
        assert lora_a[0][expert].shape[0] == (r if tied else 2 * r)


def test_tied_gate_and_up_factors_pack_at_the_adapters_own_rank_and_round_trip(tmp_path):
    adapter, source = moe_adapter(tmp_path / "src", rank=4)
    tie_gate_and_up(tmp_path / "src", source)
    adapter = validate_adapter_dir(tmp_path / "src", TINY_MOE)
    write_engine_layout(adapter, tmp_path / "out", spec=TINY_MOE)
    header = read_header(tmp_path / "out" / PACKED, max_header_bytes=LIMIT)
    assert header.tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (16, 64)
    unpacked = {
        name: (dt, shape, bytes(data)) for name, dt, shape, data in packing.unpack_moe(tmp_path / "out" / PACKED)
    }
    assert unpacked == source_bytes(adapter)


def test_packing_reads_one_stacked_tensor_at_a_time(tmp_path, monkeypatch):
    adapter, _ = moe_adapter(tmp_path / "src", "many_file")
    reads_since_write: list[int] = [0]
    peak = {"reads": 0}
    original_read, original_write = packing.tensor_bytes, packing.write_safetensors

    def counted_read(header, name):
        reads_since_write[0] += 1
        peak["reads"] = max(peak["reads"], reads_since_write[0])
        return original_read(header, name)

    def counted_write(path, tensors, metadata=None):
        def each():
            for item in tensors:
                yield item
                reads_since_write[0] = 0

        original_write(path, each(), metadata=metadata)

    monkeypatch.setattr(packing, "tensor_bytes", counted_read)
    monkeypatch.setattr(packing, "write_safetensors", counted_write)
    write_engine_layout(adapter, tmp_path / "out", spec=TINY_MOE)
    # At most gate+up lora_B (2 projections x 4 experts) plus, before the first write, the tie check's
    # first gate/up pair of each layer (compared and dropped); never the whole adapter (56 tensors).
    assert peak["reads"] <= 2 * TINY_MOE.num_experts + 2 * TINY_MOE.num_layers


def test_dense_adapters_are_exported_unchanged(tmp_path):
    tensors = lora_tensors(TINY_DENSE, targets=("q_proj", "gate_proj"))
    adapter = validate_adapter_dir(
        write_adapter_files(tmp_path / "src", lora_config(targets=("q_proj", "gate_proj")), tensors), TINY_DENSE
    )
    with_spec = write_engine_layout(adapter, tmp_path / "a", spec=TINY_DENSE)
    without = write_engine_layout(adapter, tmp_path / "b")
    assert with_spec == without
    assert engine_layout(adapter, TINY_DENSE).as_record() == {
        "engine_layout": "peft",
        "engine_flags": [],
        "load_request": {},
        "min_max_lora_rank": 4,
    }


def test_packed_exports_are_deterministic_and_name_what_the_engine_needs(tmp_path):
    peft, _ = moe_adapter(tmp_path / "peft", "peft", rank=4)
    many, _ = moe_adapter(tmp_path / "many", "many_file", rank=4)
    assert write_engine_layout(peft, tmp_path / "o1", spec=TINY_MOE) == write_engine_layout(
        many, tmp_path / "o2", spec=TINY_MOE
    )
    assert engine_layout(peft, TINY_MOE).as_record() == {
        "engine_layout": "peft_3d_moe",
        "engine_flags": ["--enable-mixed-moe-lora-format"],
        "load_request": {"is_3d_lora_weight": True},
        "min_max_lora_rank": 8,
    }
    assert [packing.node_max_lora_rank(r) for r in (1, 2, 8, 9)] == [1, 8, 8, 16]


def test_an_adapter_missing_some_experts_is_refused_rather_than_packed_inexactly(tmp_path):
    tensors = lora_tensors(TINY_MOE, targets=("q_proj",), expert_targets=("down_proj",))
    tensors = {k: v for k, v in tensors.items() if ".experts.3." not in k}
    adapter = validate_adapter_dir(
        write_adapter_files(tmp_path / "src", lora_config(targets=("q_proj", "down_proj")), tensors), TINY_MOE
    )
    with pytest.raises(ArtifactError) as caught:
        write_engine_layout(adapter, tmp_path / "out", spec=TINY_MOE)
    assert caught.value.code == "partial_experts"


def export_moe_revision(tenant, moe_base, src, capture):
    """Upload `src` as revision 1 of a new adapter `moe-bot` through the API; return it, exported."""
    from adapters.models import Adapter, AdapterRevision
    from tests.adapters.fixtures import uploads_of

    Adapter.objects.create(tenant=tenant.tenant, name="moe-bot", base_model=moe_base)
    with capture(execute=True):
        response = tenant.client_as("developer").post(
            "/api/v1/adapters/moe-bot/revisions/", {"files": uploads_of(src.root)}, format="multipart"
        )
    assert response.status_code == 201, response.content
    revision = AdapterRevision.objects.get(adapter__name="moe-bot", number=1)
    assert revision.state == "exported", revision.failure_reason
    return revision


def moe_node(moe_base, tmp_path, name: str, flags):
    from tests.factories import ServingNodeFactory

    return ServingNodeFactory(
        name=name,
        base_model=moe_base,
        served_model_name="test-moe",
        max_lora_rank=8,
        engine_flags=list(flags),
        cache_dir=str(tmp_path / name),
    )


def prewarm_load_call(node, revision):
    """Approve `revision`, prewarm it on `node` against a fake engine; return the engine's load_lora mock."""
    from adapters.models import AdapterRevision
    from serving import tasks
    from serving.models import Placement

    AdapterRevision.objects.filter(id=revision.id).update(state="approved")
    placement = Placement.objects.create(node=node, revision=revision, state="loading", attempts=1)
    with mock.patch("serving.tasks.VllmClient") as factory:
        engine = factory.return_value.__enter__.return_value
        engine.complete.return_value = " hi"
        tasks.placement_prewarm(placement_id=placement.id)
    return engine.load_lora


@pytest.mark.django_db
def test_a_moe_revision_is_exported_packed_and_loaded_with_what_its_layout_needs(
    tenant_a, moe_base, artifact_root, tmp_path, django_capture_on_commit_callbacks
):
    from serving.models import lora_name

    src, _ = moe_adapter(tmp_path / "src", "many_file")
    revision = export_moe_revision(tenant_a, moe_base, src, django_capture_on_commit_callbacks)
    record = revision.policy_record
    assert record["engine_layout"] == "peft_3d_moe" and record["source_layout"] == "many_file"
    assert record["load_request"] == {"is_3d_lora_weight": True}
    exported = artifact_root / revision.export_uri / PACKED
    assert {n: (d, s, bytes(b)) for n, d, s, b in packing.unpack_moe(exported)} == source_bytes(src)

    node = moe_node(moe_base, tmp_path, "moe-node", packing.ENGINE_FLAGS)
    load = prewarm_load_call(node, revision)
    name = lora_name(revision)
    load.assert_called_once_with(name, str(Path(node.cache_dir) / name), is_3d_lora_weight=True)


@pytest.mark.parametrize("layout", ["peft", "many_file"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_expert_major_export_unpacks_to_its_source_bit_for_bit_and_keeps_rank_and_experts_apart(
    tmp_path, layout, dtype
):
    adapter, _ = moe_adapter(tmp_path / "src", layout, dtype=dtype, rank=2)
    write_engine_layout(adapter, tmp_path / "out", spec=TINY_MOE, moe_layout=packing.EXPERT_MAJOR)
    path = tmp_path / "out" / PACKED

    unpacked = {name: (dt, shape, bytes(data)) for name, dt, shape, data in packing.unpack_moe(path)}
    assert unpacked == source_bytes(adapter)
    description = packing.read_description(path)
    assert (description["layout"], description["packed_rank"]) == (packing.EXPERT_MAJOR, 2)
    header = read_header(path, max_header_bytes=LIMIT)
    gate_b = header.tensors[f"{packing.PREFIX}.1.mlp.experts.gate_proj.lora_B.weight"]
    assert gate_b.shape == (TINY_MOE.num_experts, 32, 2)  # [E, out, r]
    assert engine_layout(adapter, TINY_MOE, moe_layout=packing.EXPERT_MAJOR).min_max_lora_rank == 2


@pytest.mark.django_db
def test_a_base_model_opted_in_to_expert_major_exports_it_and_only_plugin_nodes_may_hold_it(
    tenant_a, moe_base, artifact_root, tmp_path, django_capture_on_commit_callbacks
):
    from adapters.artifacts.export import MOE_LAYOUT_CONFIG_KEY
    from serving import selectors
    from serving.models import lora_name

    moe_base.config = moe_base.config | {MOE_LAYOUT_CONFIG_KEY: packing.EXPERT_MAJOR}
    moe_base.save()
    src, _ = moe_adapter(tmp_path / "src", "peft")
    revision = export_moe_revision(tenant_a, moe_base, src, django_capture_on_commit_callbacks)
    record = revision.policy_record
    assert record["engine_layout"] == packing.EXPERT_MAJOR
    assert record["engine_flags"] == list(packing.EXPERT_MAJOR_ENGINE_FLAGS) and record["load_request"] == {}
    assert record["min_max_lora_rank"] == record["rank"]  # gate and up keep their own lora_A: no doubled rank
    exported = artifact_root / revision.export_uri / PACKED
    assert {n: (d, s, bytes(b)) for n, d, s, b in packing.unpack_moe(exported)} == source_bytes(src)

    plain = moe_node(moe_base, tmp_path, "plain", packing.ENGINE_FLAGS)
    plugin = moe_node(moe_base, tmp_path, "plugin", packing.EXPERT_MAJOR_ENGINE_FLAGS)
    assert not selectors.node_can_load(plain, revision) and selectors.node_can_load(plugin, revision)
    load = prewarm_load_call(plugin, revision)
    name = lora_name(revision)
    load.assert_called_once_with(name, str(Path(plugin.cache_dir) / name))
