"""Validation of adapter uploads: every bad case fails with its own reason, good adapters pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.validate import ValidationLimits, validate_adapter_dir
from tests.adapters.corpus import (
    BAD_CASES,
    DEFAULT_LIMITS,
    SMALL_LIMITS,
    TINY_DENSE,
    TINY_MOE,
    lora_config,
    lora_tensors,
    make_archive,
    make_bad_adapter,
    tensor_name,
    validate_upload,
    write_adapter_files,
    write_lora_adapter,
)

REQUIRED_CASES = {
    "truncated_file": "truncated_file",
    "header_too_large": "header_too_large",
    "wrong_shape": "shape_mismatch",
    "rank_too_high": "rank_too_high",
    "nan": "non_finite",
    "inf": "non_finite",
    "pickle_file": "pickle_forbidden",
    "archive_dotdot": "archive_path_traversal",
    "archive_absolute": "archive_absolute_path",
    "archive_symlink": "archive_link",
    "archive_too_many_files": "archive_too_many_files",
    "compression_bomb": "archive_compression_ratio",
    "missing_config": "missing_adapter_config",
    "bad_dtype": "bad_dtype",
    "unpaired": "unpaired_lora",
    "not_lora": "bad_adapter_config",
}


def refuse(root: Path, code: str, spec=TINY_DENSE, limits: ValidationLimits = DEFAULT_LIMITS) -> ArtifactError:
    with pytest.raises(ArtifactError) as caught:
        validate_adapter_dir(root, spec, limits)
    assert caught.value.code == code, caught.value.message
    return caught.value


def test_the_corpus_covers_every_required_case():
    assert REQUIRED_CASES.items() <= BAD_CASES.items()


@pytest.mark.parametrize(("case", "code"), sorted(BAD_CASES.items()))
def test_bad_case_fails_with_its_code_through_the_upload_path(tmp_path, case, code):
    upload = make_bad_adapter(case, tmp_path / "corpus")
    work = tmp_path / "work"
    with pytest.raises(ArtifactError) as caught:
        validate_upload(upload, TINY_DENSE, work)
    assert caught.value.code == code, caught.value.message
    assert len(caught.value.message) > 30
    assert str(caught.value) == caught.value.message
    if upload.is_file():
        unpacked = work / "unpacked"
        assert not unpacked.exists() or list(unpacked.rglob("*")) == []


def test_messages_name_what_is_at_fault(tmp_path):
    messages = {}
    for case in ("wrong_shape", "nan", "pickle_file", "unpaired", "bad_dtype", "truncated_file", "rank_too_high"):
        with pytest.raises(ArtifactError) as caught:
            validate_adapter_dir(make_bad_adapter(case, tmp_path), TINY_DENSE)
        messages[case] = caught.value.message
    assert "layers.0.self_attn.q_proj.lora_A.weight" in messages["wrong_shape"]
    assert "[4, 63]" in messages["wrong_shape"] and "[r, 64]" in messages["wrong_shape"]
    assert "layers.1.self_attn.v_proj.lora_B.weight" in messages["nan"]
    assert "adapter_model.bin" in messages["pickle_file"]
    assert "safe_serialization=True" in messages["pickle_file"]
    assert "layers.1.self_attn.q_proj.lora_B.weight" in messages["unpaired"]
    assert "F64" in messages["bad_dtype"]
    assert "adapter_model.safetensors" in messages["truncated_file"]
    assert "16" in messages["rank_too_high"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["peft", "many_file"])
def test_dense_adapter_validates(tmp_path, dtype, layout):
    root = write_lora_adapter(
        tmp_path / "a",
        TINY_DENSE,
        rank=8,
        alpha=16,
        targets=("q_proj", "k_proj", "down_proj"),
        dtype=dtype,
        layout=layout,
    )
    checked = validate_adapter_dir(root, TINY_DENSE)
    assert checked.root == root
    assert checked.rank == 8 and checked.alpha == 16.0
    assert checked.target_modules == ["down_proj", "k_proj", "q_proj"]
    assert checked.layout == layout
    assert checked.dtype == {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}[dtype]
    assert checked.tensor_count == 2 * 3 * 2
    assert checked.tensor_files == sorted(root.glob("*.safetensors"))
    assert len(checked.tensor_files) == (1 if layout == "peft" else 12)
    assert checked.size_bytes == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert checked.config == json.loads((root / "adapter_config.json").read_text())


@pytest.mark.parametrize("layout", ["peft", "many_file"])
def test_moe_adapter_with_experts_validates(tmp_path, layout):
    root = write_lora_adapter(
        tmp_path / "moe",
        TINY_MOE,
        targets=("q_proj", "o_proj"),
        expert_targets=("gate_proj", "down_proj"),
        layout=layout,
    )
    checked = validate_adapter_dir(root, TINY_MOE)
    assert checked.target_modules == ["down_proj", "gate_proj", "o_proj", "q_proj"]
    assert checked.tensor_count == 2 * (2 + 4 * 2) * 2
    assert checked.layout == layout


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "zip"])
def test_adapter_nested_in_an_archive_validates(tmp_path, kind):
    write_lora_adapter(tmp_path / "src" / "outer" / "my-adapter", TINY_MOE, expert_targets=("up_proj",))
    archive = make_archive(tmp_path / "src", tmp_path / f"upload.{kind}", kind)
    checked = validate_upload(archive, TINY_MOE, tmp_path / "work")
    assert checked.root == tmp_path / "work" / "unpacked" / "outer" / "my-adapter"
    assert checked.target_modules == ["q_proj", "up_proj", "v_proj"]


def test_adapter_made_by_peft_validates(tmp_path):
    # Both come with the dev extra, which the suite needs anyway: a missing one is an error, not a skip.
    import peft
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=modules, task_type="CAUSAL_LM")
    peft.get_peft_model(model, lora).save_pretrained(tmp_path / "peft-adapter")

    checked = validate_adapter_dir(tmp_path / "peft-adapter", TINY_DENSE)
    assert checked.layout == "peft"
    assert checked.rank == 8 and checked.alpha == 16.0
    assert checked.target_modules == sorted(modules)
    assert checked.tensor_count == 2 * 7 * 2
    assert checked.dtype == "F32"


def test_target_modules_regex_and_all_linear(tmp_path):
    tensors = lora_tensors(TINY_DENSE, targets=("q_proj", "v_proj"))
    for targets, ok in [
        (r"model\.layers\.\d+\.self_attn\.(q_proj|v_proj)", True),
        (r".*\.(q_proj|v_proj)", True),
        ("all-linear", True),
        ("ALL-LINEAR", True),  # PEFT compares the shorthand case-insensitively
        (r"model\.layers\.\d+\.self_attn\.q_proj", False),
        (r"q_proj|v_proj", False),  # fullmatch against the module's path, as PEFT does
    ]:
        root = write_adapter_files(tmp_path / f"r{hash(targets)}", lora_config(targets=targets), tensors)
        if ok:
            assert validate_adapter_dir(root, TINY_DENSE).target_modules == ["q_proj", "v_proj"]
        else:
            refuse(root, "target_modules_mismatch")


def test_target_modules_may_name_a_path_suffix_and_list_modules_that_are_absent(tmp_path):
    tensors = lora_tensors(TINY_DENSE, targets=("q_proj", "v_proj"))
    root = write_adapter_files(
        tmp_path / "a", lora_config(targets=["self_attn.q_proj", "v_proj", "gate_proj"]), tensors
    )
    assert validate_adapter_dir(root, TINY_DENSE).target_modules == ["q_proj", "v_proj"]


def test_expert_tensors_are_refused_on_a_dense_model(tmp_path):
    root = write_lora_adapter(tmp_path / "moe", TINY_MOE, expert_targets=("gate_proj",))
    error = refuse(root, "unexpected_tensor", spec=TINY_DENSE)
    assert "experts" in error.message and "dense" in error.message


def test_expert_index_beyond_the_model_is_refused(tmp_path):
    tensors = lora_tensors(TINY_MOE, expert_targets=("up_proj",))
    tensors[tensor_name(0, "up_proj", "A", expert=4)] = torch.randn(4, 64).half()
    tensors[tensor_name(0, "up_proj", "B", expert=4)] = torch.randn(32, 4).half()
    root = write_adapter_files(tmp_path / "a", lora_config(targets=("q_proj", "v_proj", "up_proj")), tensors)
    error = refuse(root, "unexpected_tensor", spec=TINY_MOE)
    assert "experts.4.up_proj" in error.message


def test_dense_mlp_tensors_are_refused_on_an_moe_model(tmp_path):
    root = write_lora_adapter(tmp_path / "a", TINY_DENSE, targets=("q_proj", "gate_proj"))
    refuse(root, "unexpected_tensor", spec=TINY_MOE)


def test_expert_shapes_come_from_the_expert_modules(tmp_path):
    tensors = lora_tensors(TINY_MOE, expert_targets=("down_proj",))
    tensors[tensor_name(1, "down_proj", "A", expert=2)] = torch.randn(4, 64).half()  # dense down_proj's in
    root = write_adapter_files(tmp_path / "a", lora_config(targets=("q_proj", "v_proj", "down_proj")), tensors)
    error = refuse(root, "shape_mismatch", spec=TINY_MOE)
    assert "[r, 32]" in error.message


def test_lora_b_shape_is_checked(tmp_path):
    tensors = lora_tensors(TINY_DENSE)
    tensors[tensor_name(0, "v_proj", "B")] = torch.randn(64, 4).half()  # v_proj's out is 32
    root = write_adapter_files(tmp_path / "a", lora_config(), tensors)
    error = refuse(root, "shape_mismatch")
    assert "[32, r]" in error.message and "[64, 4]" in error.message


def test_three_dimensional_tensor_is_a_shape_mismatch(tmp_path):
    tensors = lora_tensors(TINY_DENSE)
    tensors[tensor_name(0, "q_proj", "A")] = torch.randn(1, 4, 64).half()
    refuse(write_adapter_files(tmp_path / "a", lora_config(), tensors), "shape_mismatch")


def test_mixed_dtypes_are_refused(tmp_path):
    tensors = lora_tensors(TINY_DENSE)
    tensors[tensor_name(1, "v_proj", "A")] = tensors[tensor_name(1, "v_proj", "A")].float()
    error = refuse(write_adapter_files(tmp_path / "a", lora_config(), tensors), "bad_dtype")
    assert "F32" in error.message and "F16" in error.message


def test_too_many_tensors_is_refused(tmp_path):
    root = write_lora_adapter(tmp_path / "moe", TINY_MOE, expert_targets=("gate_proj", "up_proj", "down_proj"))
    count = 2 * (2 + 4 * 3) * 2
    error = refuse(root, "too_many_tensors", spec=TINY_MOE, limits=ValidationLimits(max_tensors=count - 1))
    assert str(count - 1) in error.message
    assert validate_adapter_dir(root, TINY_MOE, ValidationLimits(max_tensors=count)).tensor_count == count


def test_header_limit_comes_from_the_limits(tmp_path):
    root = write_lora_adapter(tmp_path / "many", TINY_MOE, expert_targets=("gate_proj",))
    limits = ValidationLimits(max_header_bytes=256)
    refuse(root, "header_too_large", spec=TINY_MOE, limits=limits)


def test_total_size_over_the_limit_is_refused(tmp_path):
    root = write_lora_adapter(tmp_path / "a", TINY_DENSE, targets=tuple(TINY_DENSE.module_shapes), rank=16)
    (root / "big-readme.md").write_bytes(bytes(2 * 1024 * 1024))
    refuse(root, "archive_too_large", limits=SMALL_LIMITS)


def test_duplicate_tensor_within_many_file_layout_is_refused(tmp_path):
    root = make_bad_adapter("duplicate_tensor", tmp_path)
    error = refuse(root, "bad_safetensors")
    assert "zz-copy.safetensors" in error.message


def test_peft_file_must_be_the_only_safetensors(tmp_path):
    root = write_lora_adapter(tmp_path / "a", TINY_DENSE)
    save_file({"x": torch.zeros(1)}, root / "model.safetensors")
    error = refuse(root, "bad_safetensors")
    assert "model.safetensors" in error.message


def test_a_single_non_peft_file_is_many_file_layout(tmp_path):
    root = write_lora_adapter(tmp_path / "a", TINY_DENSE)
    (root / "adapter_model.safetensors").rename(root / "weights.safetensors")
    assert validate_adapter_dir(root, TINY_DENSE).layout == "many_file"


def test_files_without_tensors_are_no_tensors(tmp_path):
    root = write_adapter_files(tmp_path / "a", lora_config(), {})
    refuse(root, "no_tensors")


def test_two_adapter_configs_are_refused(tmp_path):
    write_lora_adapter(tmp_path / "up" / "one", TINY_DENSE)
    write_lora_adapter(tmp_path / "up" / "two", TINY_DENSE)
    error = refuse(tmp_path / "up", "missing_adapter_config")
    assert "one/adapter_config.json" in error.message and "two/adapter_config.json" in error.message


@pytest.mark.parametrize("name", ["model.PT", "weights.pth", "state.pkl", "x.pickle", "last.ckpt", "deep/er/a.bin"])
def test_every_pickle_extension_is_forbidden_anywhere(tmp_path, name):
    root = write_lora_adapter(tmp_path / "a", TINY_DENSE)
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(b"\x80\x04K\x01.")
    error = refuse(root, "pickle_forbidden")
    assert Path(name).name in error.message


def test_rank_mismatch_names_the_config_rank(tmp_path):
    error = refuse(make_bad_adapter("rank_mismatch", tmp_path), "rank_mismatch")
    assert "r = 8" in error.message and "rank 4" in error.message


def test_non_finite_values_are_found_in_many_file_layout_and_bf16(tmp_path):
    tensors = lora_tensors(TINY_DENSE, dtype=torch.bfloat16)
    bad = tensors[tensor_name(1, "q_proj", "A")].clone()
    bad[0, 0] = float("-inf")
    tensors[tensor_name(1, "q_proj", "A")] = bad
    root = write_adapter_files(tmp_path / "a", lora_config(), tensors, layout="many_file")
    error = refuse(root, "non_finite")
    assert "layers.1.self_attn.q_proj.lora_A.weight" in error.message


# -- adapter_config.json and tensor names ----------------------------------------------------------


def test_headers_of_all_files_together_are_bounded(tmp_path):
    root = write_lora_adapter(tmp_path / "many", TINY_DENSE, layout="many_file")
    files = sorted(root.glob("*.safetensors"))
    header_bytes = [int.from_bytes(p.read_bytes()[:8], "little") for p in files]
    total = sum(header_bytes)
    assert validate_adapter_dir(root, TINY_DENSE, ValidationLimits(max_total_header_bytes=total)).tensor_count == 8
    error = refuse(root, "header_too_large", limits=ValidationLimits(max_total_header_bytes=total - 1))
    assert files[-1].name in error.message and str(total - 1) in error.message
