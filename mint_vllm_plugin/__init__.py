"""MinT's vLLM general plugin: teaches vLLM 0.32 to load MinT's expert-major MoE LoRA layout.

vLLM calls `register()` in every process it starts (API server, engine core, workers) through
the `vllm.general_plugins` entry point. It patches one function (see `loader`) and only on the
vLLM version it was written for; on any other it logs a warning and changes nothing, and such
a node then refuses expert-major files as plain vLLM does. Every adapter not in the layout
loads exactly as before.

A node installs it with MinT's distribution and no dependencies (docs/operations.md, "Serving nodes"): it
imports no Django and none of MinT's control plane, only the file-layout contract and the
safetensors header reader of the Django-free artifacts package (adapters.artifacts.layout,
adapters.artifacts.safetensors_header); tests/mint_vllm_plugin/test_install.py checks that in a
virtual environment without Django.
"""

from __future__ import annotations

import logging

SUPPORTED_VLLM = "0.32.0"

log = logging.getLogger(__name__)


def register() -> None:
    """Entry point for `vllm.general_plugins`; safe to call more than once."""
    try:
        import vllm
    except ImportError:
        return
    version = getattr(vllm, "__version__", None)
    if version != SUPPORTED_VLLM:
        log.warning(
            "MinT expert-major MoE LoRA plugin written for vLLM %s, found %s: not installing; "
            "mint_expert_major adapters will be refused by this node",
            SUPPORTED_VLLM,
            version,
        )
        return
    from mint_vllm_plugin.loader import install

    if install():
        log.info("MinT expert-major MoE LoRA loader installed (vLLM %s)", version)
