"""Which adapter directories are in MinT's expert-major layout: a header byte scan, no torch, no vLLM.

Runs on every adapter a node loads, so it is cheap for the files it is not meant for
(adapters.artifacts.layout.description_from_header searches bytes before it parses anything).
"""

from __future__ import annotations

import os

from adapters.artifacts import layout
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.safetensors_header import read_header_bytes

TENSOR_FILE = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def adapter_description(lora_path: object) -> dict | None:
    """The expert-major description of the adapter directory `lora_path`, or None (any other adapter).

    A file that cannot be read, or whose framing is wrong, is not expert-major: vLLM's own loader
    then reads it and reports the problem as it would without the plugin.
    """
    if not isinstance(lora_path, str):
        return None
    path = os.path.join(os.path.expanduser(lora_path), TENSOR_FILE)
    try:
        header, _ = read_header_bytes(path, max_header_bytes=MAX_HEADER_BYTES)
    except (OSError, ArtifactError):
        return None
    return layout.description_from_header(header)
