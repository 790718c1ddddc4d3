"""The local vLLM node's command line."""

from __future__ import annotations

from devtools.local_node import engine_dtype, vllm_argv


def test_bfloat16_unless_the_cpu_has_amx_tiles(monkeypatch):
    monkeypatch.delenv("MINT_VLLM_DTYPE", raising=False)
    assert engine_dtype("flags : fpu avx2 avx512f avx512bw") == "bfloat16"
    assert engine_dtype("flags : fpu avx2 avx512f amx_tile amx_bf16 amx_int8") == "float16"


def test_the_dtype_can_be_chosen(monkeypatch, tmp_path):
    monkeypatch.setenv("MINT_VLLM_DTYPE", "float32")
    assert engine_dtype("flags : amx_tile") == "float32"
    argv = vllm_argv(model_dir=tmp_path, port=8001, served_name="tiny")
    assert argv[argv.index("--dtype") + 1] == "float32"
