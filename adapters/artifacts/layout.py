"""MinT's expert-major MoE LoRA layout: the file contract shared by the exporter (packing) and the vLLM plugin.

Per layer L, six 3-D tensors (and the adapter's other tensors, e.g. attention, as PEFT names them):

    base_model.model.model.layers.L.mlp.experts.<proj>.lora_A.weight  [E, r, in]   expert-major
    base_model.model.model.layers.L.mlp.experts.<proj>.lora_B.weight  [E, out, r]  expert-major

for <proj> in gate_proj, up_proj, down_proj. Gate and up keep their own lora_A, so an adapter
is stored (and served) at its own rank r, tied or not. Expert e's slice of a tensor is the
per-expert source tensor `experts.<e>.<proj>.lora_A/B.weight` byte for byte, which is also the
block vLLM copies into a LoRA slot: a node loads a layer with one copy per buffer.

The safetensors metadata key `mint.packing` holds a JSON description whose `layout` is
`LAYOUT`; that is how the plugin recognises the file. Plain vLLM 0.32 refuses these names
(`experts.gate_proj` is not an expected module), so a node without the plugin fails the load
loudly instead of serving something else. Nodes with the plugin declare `CAPABILITY` in their
engine_flags; it is a MinT capability token, not a vLLM flag (no leading dashes), and must
never be passed to vLLM.

This module imports neither torch nor vLLM nor Django: mint_vllm_plugin imports it inside vLLM.
"""

from __future__ import annotations

import json
import re

LAYOUT = "mint_expert_major"
FORMAT_VERSION = 1
METADATA_KEY = "mint.packing"
CAPABILITY = "mint:moe-expert-major/1"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DTYPES = ("F16", "BF16", "F32")

_NAME = re.compile(
    r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)\.lora_(?P<which>[AB])\.weight$"
)


def tensor_name(prefix: str, layer: int, proj: str, which: str) -> str:
    """`prefix` is the PEFT layer prefix, e.g. `base_model.model.model.layers`."""
    return f"{prefix}.{layer}.mlp.experts.{proj}.lora_{which}.weight"


def parse_name(name: str) -> tuple[str, int, str, str] | None:
    """(experts module prefix, layer, projection, "A"|"B") of an expert-major tensor name, else None."""
    m = _NAME.match(name)
    if m is None:
        return None
    return m["prefix"], int(m["layer"]), m["proj"], m["which"]


def expected_shape(description: dict, proj: str, which: str, rank: int) -> tuple[int, int, int]:
    in_f, out_f = description["shapes"][proj]
    n = description["num_experts"]
    return (n, rank, in_f) if which == "A" else (n, out_f, rank)


def check_description(description: object) -> dict:
    """The description if it is a well-formed expert-major one; ValueError saying what is wrong otherwise."""
    if not isinstance(description, dict) or description.get("layout") != LAYOUT:
        raise ValueError(f"not a {LAYOUT} description")
    if description.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{LAYOUT} format {description.get('format')!r} is not supported (this node reads {FORMAT_VERSION})"
        )
    n, rank = description.get("num_experts"), description.get("rank")
    if not isinstance(n, int) or n < 1 or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{LAYOUT}: num_experts and rank must be positive integers, got {n!r} and {rank!r}")
    if description.get("dtype") not in DTYPES:
        raise ValueError(f"{LAYOUT}: dtype {description.get('dtype')!r} is not one of {DTYPES}")
    shapes = description.get("shapes")
    if not isinstance(shapes, dict) or any(
        not isinstance(shapes.get(p), list)
        or len(shapes[p]) != 2
        or not all(isinstance(v, int) and v > 0 for v in shapes[p])
        for p in PROJECTIONS
    ):
        raise ValueError(f"{LAYOUT}: shapes must give [in, out] for each of {PROJECTIONS}")
    hidden, inter = shapes["gate_proj"]
    if shapes["up_proj"] != [hidden, inter] or shapes["down_proj"] != [inter, hidden]:
        raise ValueError(f"{LAYOUT}: gate/up must be [hidden, inter] and down [inter, hidden], got {shapes}")
    layers = description.get("layers")
    if not isinstance(layers, dict) or not all(k.isdigit() for k in layers):
        raise ValueError(f"{LAYOUT}: layers must map layer numbers to entries")
    return description


def description_from_header(header: bytes) -> dict | None:
    """The expert-major description in a safetensors JSON header, or None if the file is not in this layout.

    Cheap for the files it is not meant for: a byte search precedes any JSON parsing, so a
    37,000-tensor per-expert header costs a scan, not a parse.
    """
    if LAYOUT.encode() not in header:
        return None
    try:
        raw = json.loads(header).get("__metadata__", {}).get(METADATA_KEY)
        description = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, AttributeError):
        return None
    if not isinstance(description, dict) or description.get("layout") != LAYOUT:
        return None
    return description


def description_from_metadata(metadata: dict | None) -> dict | None:
    """The description stored under `METADATA_KEY` in a file's safetensors metadata, or None."""
    raw = (metadata or {}).get(METADATA_KEY)
    try:
        return json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
