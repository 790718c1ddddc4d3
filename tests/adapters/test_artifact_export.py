"""The engine layout export: deterministic, bit-identical tensors, one tensor in memory at a time."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from adapters.artifacts import export as export_module
from adapters.artifacts.export import ExportedFile, sha256_file, write_engine_layout
from adapters.artifacts.safetensors_io import read_header, tensor_bytes
from adapters.artifacts.validate import validate_adapter_dir
from tests.adapters.corpus import TINY_DENSE, TINY_MOE, lora_config, lora_tensors, source_bytes, write_adapter_files

LIMIT = 64 * 1024 * 1024


def moe_adapter(root: Path, layout: str, dtype: torch.dtype = torch.bfloat16):
    tensors = lora_tensors(TINY_MOE, targets=("q_proj", "k_proj"), expert_targets=("up_proj", "down_proj"), dtype=dtype)
    config = {**lora_config(targets=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]), "lora_alpha": 8}
    return validate_adapter_dir(write_adapter_files(root, config, tensors, layout), TINY_MOE)


@pytest.mark.parametrize("layout", ["peft", "many_file"])
def test_export_round_trips_every_tensor_bit_for_bit(tmp_path, layout):
    adapter = moe_adapter(tmp_path / "src", layout)
    files = write_engine_layout(adapter, tmp_path / "out")

    assert [f.name for f in files] == ["adapter_config.json", "adapter_model.safetensors"]
    exported = read_header(tmp_path / "out" / "adapter_model.safetensors", max_header_bytes=LIMIT)
    expected = source_bytes(adapter)
    assert set(exported.tensors) == set(expected)
    for name, (dtype, shape, data) in expected.items():
        info = exported.tensors[name]
        assert (info.dtype, info.shape) == (dtype, shape)
        assert tensor_bytes(exported, name) == data
    # Stored in name order.
    names = sorted(exported.tensors)
    assert [exported.tensors[n].start for n in names] == sorted(exported.tensors[n].start for n in names)


def test_export_is_loadable_by_safetensors(tmp_path):
    adapter = moe_adapter(tmp_path / "src", "many_file", dtype=torch.float16)
    write_engine_layout(adapter, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = list(f.keys())
        assert len(names) == adapter.tensor_count
        tensor = f.get_tensor(names[0])
        assert tensor.dtype == torch.float16 and torch.isfinite(tensor).all()


def test_export_is_deterministic_and_independent_of_the_input_layout(tmp_path):
    peft = moe_adapter(tmp_path / "peft", "peft")
    many = moe_adapter(tmp_path / "many", "many_file")
    first = write_engine_layout(peft, tmp_path / "out1")
    again = write_engine_layout(peft, tmp_path / "out2")
    from_many = write_engine_layout(many, tmp_path / "out3")
    assert first == again == from_many
    assert (tmp_path / "out1" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "out3" / "adapter_model.safetensors"
    ).read_bytes()


def test_exported_files_carry_their_hash_and_size(tmp_path):
    adapter = moe_adapter(tmp_path / "src", "peft")
    for exported in write_engine_layout(adapter, tmp_path / "out"):
        assert isinstance(exported, ExportedFile)
        data = (tmp_path / "out" / exported.name).read_bytes()
        assert exported.sha256 == hashlib.sha256(data).hexdigest() == sha256_file(tmp_path / "out" / exported.name)
        assert exported.size_bytes == len(data)


def test_exported_config_is_exact_and_canonical(tmp_path):
    adapter = moe_adapter(tmp_path / "src", "peft")
    write_engine_layout(adapter, tmp_path / "out")
    text = (tmp_path / "out" / "adapter_config.json").read_text()
    config = json.loads(text)
    assert text == json.dumps(config, sort_keys=True, indent=2) + "\n"
    assert config["r"] == 4
    assert config["lora_alpha"] == 8
    assert config["peft_type"] == "LORA"
    # Only the modules that are really there (v_proj was listed but has no tensors).
    assert config["target_modules"] == ["down_proj", "k_proj", "q_proj", "up_proj"]
    assert config["task_type"] == "CAUSAL_LM"  # the rest of the uploaded config is kept


def test_export_writes_only_its_two_files_and_no_temporaries(tmp_path):
    adapter = moe_adapter(tmp_path / "src", "peft")
    out = tmp_path / "deep" / "out"
    write_engine_layout(adapter, out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_export_reads_one_tensor_at_a_time(tmp_path, monkeypatch):
    adapter = moe_adapter(tmp_path / "src", "many_file")
    live = {"now": 0, "max": 0}
    original = export_module.tensor_bytes

    class Counted(bytearray):
        def __del__(self):
            live["now"] -= 1

    def counted_tensor_bytes(header, name):
        data = Counted(original(header, name))
        live["now"] += 1
        live["max"] = max(live["max"], live["now"])
        return data

    monkeypatch.setattr(export_module, "tensor_bytes", counted_tensor_bytes)
    write_engine_layout(adapter, tmp_path / "out")
    assert live["max"] == 1
    assert live["now"] == 0


def test_dense_export_from_f32_keeps_f32(tmp_path):
    tensors = lora_tensors(TINY_DENSE, targets=("o_proj", "gate_proj"), dtype=torch.float32)
    adapter = validate_adapter_dir(
        write_adapter_files(tmp_path / "src", lora_config(rank=4, alpha=6.5, targets=("o_proj", "gate_proj")), tensors),
        TINY_DENSE,
    )
    write_engine_layout(adapter, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["lora_alpha"] == 6.5
    with safe_open(str(tmp_path / "out" / "adapter_model.safetensors"), framework="pt") as f:
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor)
