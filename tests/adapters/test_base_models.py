"""Base model shapes from Hugging Face configs, the tiny local models, and the commands that register them."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
import torch
from django.core.management import CommandError, call_command
from safetensors import safe_open

from adapters.artifacts.spec import BaseModelSpec
from adapters.base_models import base_model_upsert, spec_config_from_hf
from adapters.models import BaseModel
from devtools.tiny import make_tiny_model, parameter_count
from devtools.tiny_models import main as tiny_models_main
from tenants.access import Actor
from tenants.models import AuditEvent

pytestmark = pytest.mark.django_db

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
}

QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
}

SENTENCE = "The quick model serves 42 adapters, then rolls back!"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: make_tiny_model(kind, root / kind) for kind in ("dense", "moe")}


def _lora_shapes(adapter_dir: Path) -> dict[str, list[int]]:
    with safe_open(adapter_dir / "adapter_model.safetensors", framework="pt") as f:
        return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118


# spec_config_from_hf


def test_llama_config_gives_dense_attention_and_mlp_shapes():
    config = spec_config_from_hf(LLAMA_CONFIG)
    assert config == {
        "architecture": "dense",
        "model_type": "llama",
        "num_layers": 32,
        "hidden_size": 4096,
        "vocab_size": 128256,
        "num_experts": 0,
        "module_shapes": {
            "q_proj": [4096, 4096],
            "k_proj": [4096, 1024],
            "v_proj": [4096, 1024],
            "o_proj": [4096, 4096],
            "gate_proj": [4096, 14336],
            "up_proj": [4096, 14336],
            "down_proj": [14336, 4096],
        },
        "expert_module_shapes": {},
    }
    spec = BaseModelSpec.from_config(config, max_lora_rank=64)
    assert spec.architecture == "dense"
    assert spec.module_shapes["k_proj"] == (4096, 1024)


def test_qwen3_moe_config_gives_attention_and_expert_shapes():
    config = spec_config_from_hf(QWEN3_MOE_CONFIG)
    assert config == {
        "architecture": "moe",
        "model_type": "qwen3_moe",
        "num_layers": 48,
        "hidden_size": 2048,
        "vocab_size": 151936,
        "num_experts": 128,
        # head_dim (128) is not hidden / heads (64): the explicit value wins.
        "module_shapes": {
            "q_proj": [2048, 4096],
            "k_proj": [2048, 512],
            "v_proj": [2048, 512],
            "o_proj": [4096, 2048],
        },
        "expert_module_shapes": {
            "gate_proj": [2048, 768],
            "up_proj": [2048, 768],
            "down_proj": [768, 2048],
        },
    }
    spec = BaseModelSpec.from_config(config, max_lora_rank=16)
    assert spec.num_experts == 128
    assert spec.expert_module_shapes["down_proj"] == (768, 2048)


def test_mixtral_uses_local_experts_and_intermediate_size():
    config = spec_config_from_hf(
        {
            "model_type": "mixtral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_hidden_layers": 32,
            "num_local_experts": 8,
            "vocab_size": 32000,
        }
    )
    assert config["architecture"] == "moe"
    assert config["num_experts"] == 8
    assert config["expert_module_shapes"]["gate_proj"] == [4096, 14336]
    assert set(config["module_shapes"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_kv_heads_default_to_attention_heads():
    hf = {k: v for k, v in LLAMA_CONFIG.items() if k != "num_key_value_heads"}
    assert spec_config_from_hf(hf)["module_shapes"]["v_proj"] == [4096, 4096]


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"])
def test_config_missing_a_field_raises_naming_it(field):
    hf = {k: v for k, v in LLAMA_CONFIG.items() if k != field}
    with pytest.raises(ValueError, match=field):
        spec_config_from_hf(hf)


def test_config_with_a_non_integer_field_raises_naming_it():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        spec_config_from_hf(LLAMA_CONFIG | {"num_hidden_layers": "32"})


def test_moe_config_without_expert_count_raises():
    hf = {k: v for k, v in QWEN3_MOE_CONFIG.items() if k != "num_experts"}
    with pytest.raises(ValueError, match="num_experts"):
        spec_config_from_hf(hf)


# The tiny models


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tiny_model_loads_tokenizes_chats_and_runs(tiny_models, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models[kind]
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(SENTENCE)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == SENTENCE
    assert 1500 <= len(tokenizer) <= 2100
    assert {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token} == {
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    }
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == "<s>system: Be brief.\nuser: hello there\nassistant:"

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    assert type(model).__name__ == {"dense": "LlamaForCausalLM", "moe": "Qwen3MoeForCausalLM"}[kind]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert model.config.vocab_size == len(tokenizer)
    assert (path / "generation_config.json").is_file()
    assert sum(p.numel() for p in model.parameters()) == parameter_count(path)


def test_tiny_model_configs_match_the_brief(tiny_models):
    dense = json.loads((tiny_models["dense"] / "config.json").read_text())
    assert dense["architectures"] == ["LlamaForCausalLM"]
    assert (dense["hidden_size"], dense["num_attention_heads"], dense["num_key_value_heads"]) == (256, 4, 2)
    assert (dense["head_dim"], dense["intermediate_size"], dense["num_hidden_layers"]) == (64, 512, 2)
    assert dense["tie_word_embeddings"] is False
    assert dense["dtype"] == "bfloat16"

    moe = spec_config_from_hf(json.loads((tiny_models["moe"] / "config.json").read_text()))
    assert moe["architecture"] == "moe"
    assert moe["num_experts"] == 8
    assert moe["expert_module_shapes"] == {"gate_proj": [256, 128], "up_proj": [256, 128], "down_proj": [128, 256]}


def test_tiny_model_is_deterministic_for_a_seed(tiny_models, tmp_path):
    again = make_tiny_model("dense", tmp_path / "dense")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_models["dense"] / name).read_bytes(), name


def test_make_tiny_model_refuses_to_replace_an_unrelated_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a model directory"):
        make_tiny_model("dense", tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_peft_lora_on_dense_model_matches_stored_module_shapes(tiny_models, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny_models["dense"]
    spec = spec_config_from_hf(json.loads((path / "config.json").read_text()))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    )
    model.save_pretrained(tmp_path / "lora")

    shapes = _lora_shapes(tmp_path / "lora")
    assert len(shapes) == 2 * 2 * 2  # layers x modules x (A, B)
    for key, shape in shapes.items():
        module = key.split(".lora_")[0].rsplit(".", 1)[1]
        in_features, out_features = spec["module_shapes"][module]
        assert shape == ([8, in_features] if ".lora_A." in key else [out_features, 8]), key


# transformers 5 stores each layer's experts as two fused 3-D parameters (gate_up_proj [E, 2*inter, hidden],
# down_proj [E, hidden, inter]), not as per-expert nn.Linear modules. peft 0.21 accepts the v4 names in
# target_modules and rewrites them to target_parameters on the fused tensors (doubling the rank of gate_up_proj,
# which holds two projections); or the fused parameters can be named directly. Either way one LoRA pair covers
# all experts of a layer: A [r*E, in], B [out, r*E], saved under `mlp.experts[.base_layer].lora_*`.
@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")
@pytest.mark.parametrize(
    ("targets", "gate_up_rank_factor"),
    [
        ({"target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]}, 2),
        (
            {
                "target_modules": ["q_proj", "v_proj"],
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            },
            1,
        ),
    ],
    ids=["expert-module-names", "fused-parameters"],
)
def test_peft_lora_on_moe_experts_matches_stored_expert_shapes(tiny_models, tmp_path, targets, gate_up_rank_factor):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny_models["moe"]
    spec = spec_config_from_hf(json.loads((path / "config.json").read_text()))
    rank, experts = 8, spec["num_experts"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=rank, **targets))
    model.save_pretrained(tmp_path / "lora")
    shapes = _lora_shapes(tmp_path / "lora")
    saved_config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert sorted(saved_config["target_parameters"]) == sorted(
        targets.get("target_parameters", ["gate_up_proj", "down_proj"])
    )
    assert not any(".experts.0." in key for key in shapes)  # no per-expert modules

    attention = [k for k in shapes if ".self_attn." in k]
    assert len(attention) == spec["num_layers"] * 2 * 2
    for key in attention:
        in_features, out_features = spec["module_shapes"][key.split(".lora_")[0].rsplit(".", 1)[1]]
        assert shapes[key] == ([rank, in_features] if ".lora_A." in key else [out_features, rank]), key

    gate, up, down = (spec["expert_module_shapes"][m] for m in ("gate_proj", "up_proj", "down_proj"))
    gate_up_rank = rank * gate_up_rank_factor * experts
    expected = {
        ((gate_up_rank, gate[0]), (gate[1] + up[1], gate_up_rank)),  # gate_up_proj
        ((rank * experts, down[0]), (down[1], rank * experts)),  # down_proj
    }
    for layer in range(spec["num_layers"]):
        a_keys = [k for k in shapes if f"layers.{layer}.mlp.experts." in k and ".lora_A." in k]
        pairs = {(tuple(shapes[a]), tuple(shapes[a.replace(".lora_A.", ".lora_B.")])) for a in a_keys}
        assert pairs == expected, a_keys


# Registering


def test_base_model_upsert_creates_then_updates_with_audit(tiny_models):
    first = base_model_upsert(name="tiny", path=tiny_models["dense"], max_lora_rank=16, by=Actor.system())
    assert first.architecture == BaseModel.Architecture.DENSE
    assert first.path == str(tiny_models["dense"].resolve())
    assert first.spec.module_shapes["q_proj"] == (256, 256)

    second = base_model_upsert(name="tiny", path=tiny_models["moe"], max_lora_rank=32, by=Actor.system())
    assert second.pk == first.pk
    assert BaseModel.objects.get(pk=first.pk).architecture == BaseModel.Architecture.MOE
    assert second.spec.num_experts == 8

    events = list(AuditEvent.objects.filter(action="base_model.upsert", target="base_model:tiny").order_by("id"))
    assert len(events) == 2
    assert events[0].tenant is None and events[0].actor == "system"
    assert events[0].before is None
    assert events[1].before["architecture"] == "dense"
    assert events[1].after["architecture"] == "moe" and events[1].after["max_lora_rank"] == 32


def test_the_moe_lora_layout_is_chosen_kept_across_updates_and_checked(tiny_models):
    chosen = base_model_upsert(
        name="moe", path=tiny_models["moe"], max_lora_rank=8, moe_lora_layout="mint_expert_major", by=Actor.system()
    )
    assert chosen.config["moe_lora_layout"] == "mint_expert_major"
    kept = base_model_upsert(name="moe", path=tiny_models["moe"], max_lora_rank=16, by=Actor.system())
    assert kept.config["moe_lora_layout"] == "mint_expert_major" and kept.max_lora_rank == 16
    with pytest.raises(ValueError, match="moe_lora_layout must be one of"):
        base_model_upsert(
            name="moe", path=tiny_models["moe"], max_lora_rank=8, moe_lora_layout="w1w2w3", by=Actor.system()
        )
    assert BaseModel.objects.get(name="moe").config["moe_lora_layout"] == "mint_expert_major"


def test_base_model_upsert_rejects_a_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json"):
        base_model_upsert(name="nothing", path=tmp_path, max_lora_rank=16, by=Actor.system())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        base_model_upsert(name="nothing", path=tmp_path, max_lora_rank=16, by=Actor.system())
    assert not BaseModel.objects.filter(name="nothing").exists()
    assert not AuditEvent.objects.filter(target="base_model:nothing").exists()


def test_make_tiny_model_command_registers_both_models_and_skips_existing(tiny_models, tmp_path, capsys):
    dest = tmp_path / "models"
    for kind, name in (("dense", "tiny-llama"), ("moe", "tiny-qwen3-moe")):
        (dest / name).mkdir(parents=True)
        for file in tiny_models[kind].iterdir():
            (dest / name / file.name).write_bytes(file.read_bytes())
    marker = (dest / "tiny-llama" / "model.safetensors").stat().st_mtime_ns

    assert tiny_models_main(["--dest", str(dest)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["tiny-llama", "tiny-qwen3-moe"]
    assert f"{parameter_count(tiny_models['dense']):,} parameters" in lines[0]
    assert (dest / "tiny-llama" / "model.safetensors").stat().st_mtime_ns == marker  # not regenerated

    models = {m.name: m for m in BaseModel.objects.all()}
    assert models["tiny-llama"].architecture == "dense" and models["tiny-llama"].max_lora_rank == 16
    assert models["tiny-qwen3-moe"].architecture == "moe"
    assert models["tiny-qwen3-moe"].path == str((dest / "tiny-qwen3-moe").resolve())


def test_make_tiny_model_command_generates_one_kind_when_missing(tmp_path):
    assert tiny_models_main(["--kind", "moe", "--dest", str(tmp_path), "--max-lora-rank", "8"]) == 0
    assert (tmp_path / "tiny-qwen3-moe" / "model.safetensors").is_file()
    assert not (tmp_path / "tiny-llama").exists()
    assert BaseModel.objects.get(name="tiny-qwen3-moe").max_lora_rank == 8
    assert not BaseModel.objects.filter(name="tiny-llama").exists()


def test_base_model_command_adds_and_lists(tiny_models):
    out = StringIO()
    call_command("mint_base_model", "add", "--name", "tiny-moe", "--path", str(tiny_models["moe"]), stdout=out)
    assert "tiny-moe\tmoe\t2 layers\t8 experts\tmax rank 64" in out.getvalue()

    out = StringIO()
    call_command("mint_base_model", "list", stdout=out)
    rows = out.getvalue().strip().splitlines()
    assert rows[1].split("\t") == ["tiny-moe", "moe", "2", "8", "64", str(tiny_models["moe"].resolve())]


def test_base_model_command_add_without_config_fails_clearly(tmp_path):
    with pytest.raises(CommandError, match=r"has no config\.json"):
        call_command("mint_base_model", "add", "--name", "empty", "--path", str(tmp_path))
    assert not BaseModel.objects.filter(name="empty").exists()
