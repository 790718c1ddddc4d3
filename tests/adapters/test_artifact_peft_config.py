"""adapter_config.json and tensor names: parsed with bounds, refused with a reason (adapters.artifacts.peft_config)."""

from __future__ import annotations

import json

import pytest

from adapters.artifacts import peft_config
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.peft_config import (
    MAX_CONFIG_BYTES,
    MAX_TARGET_PATTERN_CHARS,
    TensorKey,
    parse_adapter_config,
    parse_tensor_name,
)
from adapters.artifacts.validate import validate_adapter_dir
from tests.adapters.corpus import (
    TINY_DENSE,
    TINY_MOE,
    lora_config,
    lora_tensors,
    write_adapter_files,
    write_lora_adapter,
)
from tests.adapters.test_artifact_validate import refuse


@pytest.mark.parametrize(
    "config",
    [
        "{not json",
        "[]",
        {**lora_config(), "peft_type": "LOHA"},
        {k: v for k, v in lora_config().items() if k != "peft_type"},
        {**lora_config(), "r": 0},
        {**lora_config(), "r": "4"},
        {**lora_config(), "r": True},
        {**lora_config(), "r": 4.5},
        {k: v for k, v in lora_config().items() if k != "r"},
        {**lora_config(), "lora_alpha": "8"},
        {**lora_config(), "lora_alpha": -1},
        {k: v for k, v in lora_config().items() if k != "lora_alpha"},
        {k: v for k, v in lora_config().items() if k != "target_modules"},
        {**lora_config(), "target_modules": None},
        {**lora_config(), "target_modules": []},
        {**lora_config(), "target_modules": [1, 2]},
        {**lora_config(), "target_modules": "(unclosed"},
        {**lora_config(), "target_modules": r"model\.layers\.\d+\.self_attn\.q_proj\z"},  # RE2 only: PEFT could not
        json.dumps(lora_config())[:-1] + ', "x": ' + "[" * 100 + "]" * 100 + "}",  # nested 101 deep
    ],
)
def test_bad_adapter_configs_are_refused(tmp_path, config):
    path = tmp_path / "adapter_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ArtifactError) as caught:
        parse_adapter_config(path)
    assert caught.value.code == "bad_adapter_config"
    assert "adapter_config.json" in caught.value.message


def test_parse_adapter_config_keeps_the_raw_config(tmp_path):
    path = tmp_path / "adapter_config.json"
    raw = {**lora_config(rank=8, alpha=32), "use_rslora": False}
    path.write_text(json.dumps(raw))
    config = parse_adapter_config(path)
    assert (config.r, config.lora_alpha, config.peft_type) == (8, 32.0, "LORA")
    assert config.target_modules == ["q_proj", "v_proj"]
    assert config.raw == raw


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", TensorKey(0, None, "q_proj", "A")),
        ("base_model.model.model.layers.31.self_attn.o_proj.lora_B.weight", TensorKey(31, None, "o_proj", "B")),
        ("base_model.model.model.layers.2.mlp.down_proj.lora_A.weight", TensorKey(2, None, "down_proj", "A")),
        (
            "base_model.model.model.layers.1.mlp.experts.127.gate_proj.lora_B.weight",
            TensorKey(1, 127, "gate_proj", "B"),
        ),
        ("base_model.model.model.layers.01.self_attn.q_proj.lora_A.weight", None),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
        ("base_model.model.model.layers.0.self_attn.gate_proj.lora_A.weight", None),
        ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", None),
        ("base_model.model.model.layers.0.mlp.experts.gate_proj.lora_A.weight", None),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight", None),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight.extra", None),
        ("base_model.model.model.layers.٣.self_attn.q_proj.lora_A.weight", None),
        ("base_model.model.lm_head.lora_A.weight", None),
        ("model.layers.0.self_attn.q_proj.lora_A.weight", None),
    ],
)
def test_parse_tensor_name(name, key):
    assert parse_tensor_name(name) == key


def test_an_oversized_config_is_refused_without_parsing_it(tmp_path):
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**lora_config(), "notes": "n" * MAX_CONFIG_BYTES}))
    with pytest.raises(ArtifactError) as caught:
        parse_adapter_config(path)
    assert caught.value.code == "bad_adapter_config"
    assert str(MAX_CONFIG_BYTES) in caught.value.message


@pytest.mark.parametrize(
    "pattern", [r"(.*)\1(q|v)_proj", r"(?=.*q_proj).*", r".*(?<!k)_proj", r"(?!.*k_proj).*", r"(?P<m>q)(?P=m)"]
)
def test_target_modules_patterns_without_a_linear_time_match_are_refused(tmp_path, pattern):
    tensors = lora_tensors(TINY_DENSE, targets=("q_proj", "v_proj"))
    root = write_adapter_files(tmp_path / "a", lora_config(targets=pattern), tensors)
    error = refuse(root, "bad_adapter_config")
    assert "without backreferences or lookaround" in error.message and "linear time" in error.message


def test_target_modules_patterns_longer_than_the_bound_are_refused(tmp_path):
    tensors = lora_tensors(TINY_DENSE, targets=("q_proj", "v_proj"))
    pattern = ".*(" + "|".join(["q_proj", "v_proj"] * 100) + ")"
    assert len(pattern) > MAX_TARGET_PATTERN_CHARS
    error = refuse(write_adapter_files(tmp_path / "a", lora_config(targets=pattern), tensors), "bad_adapter_config")
    assert str(MAX_TARGET_PATTERN_CHARS) in error.message
    fits = ".*(" + "|".join(["q_proj", "v_proj"] * 70) + ")"
    assert len(fits) <= MAX_TARGET_PATTERN_CHARS
    root = write_adapter_files(tmp_path / "b", lora_config(targets=fits), tensors)
    assert validate_adapter_dir(root, TINY_DENSE).target_modules == ["q_proj", "v_proj"]


def test_a_backtracking_pattern_is_matched_in_linear_time(tmp_path):
    # Python's re needs hours for this on a 31-character module path; RE2 answers at once.
    tensors = lora_tensors(TINY_DENSE, targets=("q_proj", "v_proj"))
    root = write_adapter_files(tmp_path / "a", lora_config(targets=r"(.*.*)*\.(q|v)_proj"), tensors)
    assert validate_adapter_dir(root, TINY_DENSE).target_modules == ["q_proj", "v_proj"]
    root = write_adapter_files(tmp_path / "b", lora_config(targets=r"(.*.*)*x"), tensors)
    refuse(root, "target_modules_mismatch")


def test_the_target_pattern_is_compiled_once_per_validation(tmp_path, monkeypatch):
    compiled = []
    real_compile = peft_config.re2.compile

    def counting_compile(pattern, options=None):
        compiled.append(pattern)
        return real_compile(pattern, options)

    monkeypatch.setattr(peft_config.re2, "compile", counting_compile)
    root = write_lora_adapter(tmp_path / "moe", TINY_MOE, expert_targets=("gate_proj", "up_proj", "down_proj"))
    config = json.loads((root / "adapter_config.json").read_text())
    (root / "adapter_config.json").write_text(json.dumps({**config, "target_modules": r".*\.(q|v|gate|up|down)_proj"}))
    assert validate_adapter_dir(root, TINY_MOE).tensor_count == 2 * (2 + 4 * 3) * 2
    assert compiled == [r".*\.(q|v|gate|up|down)_proj"]
