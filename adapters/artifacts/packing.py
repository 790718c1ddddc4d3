"""Packing per-expert MoE LoRA tensors into vLLM's 3-D PEFT layout, and unpacking them again.

A MoE adapter as trainers write it has one (lora_A, lora_B) pair per layer, expert and
projection: 48 layers x 128 experts x 3 projections is 36,864 pairs. vLLM 0.32 reads that
layout, but every tensor costs a header entry, a read and a Python object at load. Its
3-D PEFT layout (`--enable-mixed-moe-lora-format`, `"is_3d_lora_weight": true` in the
load request) holds one stacked pair per layer for gate+up and one for down:

    layers.L.mlp.experts.base_layer.lora_A.weight  [E*R, hidden]     row e*R + k
    layers.L.mlp.experts.base_layer.lora_B.weight  [2*inter, R*E]    column k*E + e (gate rows, then up rows)
    layers.L.mlp.experts.lora_A.weight             [E*r, inter]      row e*r + k
    layers.L.mlp.experts.lora_B.weight             [hidden, r*E]     column k*E + e

(the index orders are the ones vLLM's `_convert_3d_to_2d_moe_lora` reshapes with). In that
layout gate and up share one lora_A, so where a layer's gate and up factors differ they are
packed exactly with rank R = 2r: A = [A_gate; A_up] and a block-diagonal B whose zero
blocks contribute exact zeros; the node's `--max-lora-rank` must then be at least 2r. Where
they are bit-identical in every expert (adapters trained on the fused gate_up weight) the
layer keeps rank r. A projection the adapter does not adapt is packed as zeros (an exact
no-op); the file's metadata names what each layer holds, so `unpack_moe` returns exactly
the source's tensors, bit for bit.

vLLM's other stacked layout, shared-outer (`experts.w1/w2/w3`, `--enable-moe-shared-loras`),
stores the gate/up lora_A and the down lora_B once for all experts. It is exact only for
adapters trained that way, and a node started with that flag silently keeps only expert
0's factor of any other adapter, so MinT does not emit it.

MinT's own expert-major layout (`mint_expert_major`, see adapters.artifacts.layout) keeps every
projection's factors separate and expert-major, per layer L and projection P:

    layers.L.mlp.experts.P.lora_A.weight  [E, r, in]    expert e's slice is its lora_A, byte for byte
    layers.L.mlp.experts.P.lora_B.weight  [E, out, r]   expert e's slice is its lora_B, byte for byte

so any adapter, tied or not, keeps its rank r, and a node copies each tensor straight into
its LoRA slot. Plain vLLM refuses these names; only nodes running MinT's vLLM plugin (which
declare `EXPERT_MAJOR_ENGINE_FLAGS` in their engine_flags) load it, several times faster than
the 3-D PEFT layout. A projection the adapter does not adapt is stored as zeros, as above.

Packing streams: each stacked tensor is built from its experts' bytes, written, and
dropped before the next is read, so memory holds one stacked tensor, never the adapter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.artifacts import layout as expert_major
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.peft_config import parse_tensor_name
from adapters.artifacts.safetensors_io import SafetensorsHeader, read_header, tensor_bytes, write_safetensors
from adapters.artifacts.spec import BaseModelSpec

LAYOUT = "peft_3d_moe"
EXPERT_MAJOR = expert_major.LAYOUT
LAYOUTS = (LAYOUT, EXPERT_MAJOR)
# What a node must declare in its engine_flags to be given the expert-major layout: a MinT capability
# token (the plugin is installed on a vLLM it supports), never passed to vLLM itself.
EXPERT_MAJOR_ENGINE_FLAGS = (expert_major.CAPABILITY,)
# Flags a node needs to load this layout; its --max-lora-rank must also cover the file's packed rank (r or 2r).
ENGINE_FLAGS = ("--enable-mixed-moe-lora-format",)
# What the load request must carry for this layout.
LOAD_REQUEST = {"is_3d_lora_weight": True}
METADATA_KEY = "mint.packing"
EXPERT_PROJECTIONS = ("down_proj", "gate_proj", "up_proj")
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
PREFIX = "base_model.model.model.layers"

Tensor = tuple[str, str, tuple[int, ...], bytes | memoryview]


@dataclass(frozen=True)
class PackingPlan:
    """Which per-expert tensors exist, by (layer, projection), and how each layer's gate+up pair is stacked."""

    spec: BaseModelSpec
    rank: int
    dtype: str
    # (layer, projection) -> per-expert (lora_A name, lora_B name), expert order
    experts: dict[tuple[int, str], list[tuple[str, str]]]
    passthrough: list[str]  # tensors outside the experts, copied as they are
    # layer -> (rank of the packed gate+up pair, first lora_A row of up's factor); empty for EXPERT_MAJOR
    gate_up: dict[int, tuple[int, int]]
    layout: str = LAYOUT

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.experts})

    def present(self, layer: int) -> list[str]:
        return sorted(proj for (lay, proj) in self.experts if lay == layer)

    @property
    def packed_rank(self) -> int:
        return max([self.rank, *(r for r, _ in self.gate_up.values())])

    def description(self) -> dict:
        """What `unpack_moe` needs, stored in the packed file's metadata."""
        if self.layout == EXPERT_MAJOR:
            return {
                "layout": EXPERT_MAJOR,
                "format": expert_major.FORMAT_VERSION,
                "rank": self.rank,
                "packed_rank": self.rank,
                "num_experts": self.spec.num_experts,
                "dtype": self.dtype,
                "layers": {str(layer): {"projections": self.present(layer)} for layer in self.layers},
                "shapes": {p: list(self.spec.expert_module_shapes[p]) for p in EXPERT_PROJECTIONS},
            }
        return {
            "layout": LAYOUT,
            "rank": self.rank,
            "packed_rank": self.packed_rank,
            "num_experts": self.spec.num_experts,
            "dtype": self.dtype,
            "layers": {
                str(layer): {"projections": self.present(layer), "gate_up_rank": r, "up_offset": up}
                for layer, (r, up) in sorted(self.gate_up.items())
            },
            "shapes": {p: list(self.spec.expert_module_shapes[p]) for p in EXPERT_PROJECTIONS},
        }


def packed_rank(rank: int) -> int:
    """The largest rank a packed adapter of this rank can need (gate and up each keep their own r rows)."""
    return 2 * rank


def node_max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that loads a packed pair of this rank."""
    return next(r for r in VLLM_MAX_LORA_RANKS if r >= rank)


def needs_packing(spec: BaseModelSpec, names: list[str]) -> bool:
    """Whether an adapter with these tensor names has per-expert MoE tensors to pack."""
    return spec.architecture == "moe" and any((k := parse_tensor_name(n)) and k.expert is not None for n in names)


def plan_packing(
    spec: BaseModelSpec,
    headers: list[SafetensorsHeader],
    *,
    rank: int,
    dtype: str,
    read: Callable[[str], bytes],
    layout: str = LAYOUT,
) -> PackingPlan:
    """Group a validated adapter's tensors by layer and projection. Every expert must be adapted.

    Validation has checked names, shapes, pairs and the single dtype; what is left is that
    each adapted (layer, projection) covers all experts, since the stacked layout has no
    way to say "expert 7 has no LoRA" other than zeros, which would not round-trip. For the
    3-D PEFT layout, reads the gate and up lora_A of each expert (small) to find layers where
    they are tied; the expert-major layout keeps them apart and needs no such read.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown MoE layout {layout!r}")
    if layout == LAYOUT and packed_rank(rank) > VLLM_MAX_LORA_RANKS[-1]:
        raise ArtifactError(
            "rank_too_high",
            f"A MoE adapter of rank {rank} packs to rank {packed_rank(rank)}, above vLLM's largest "
            f"--max-lora-rank ({VLLM_MAX_LORA_RANKS[-1]}); train it with rank {VLLM_MAX_LORA_RANKS[-1] // 2} or less.",
        )
    by_key: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
    passthrough: list[str] = []
    for header in headers:
        for name in header.tensors:
            key = parse_tensor_name(name)
            if key is None or key.expert is None:
                passthrough.append(name)
                continue
            by_key.setdefault((key.layer, key.module), {}).setdefault(key.expert, {})[key.which] = name
    experts: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for (layer, proj), found in by_key.items():
        if sorted(found) != list(range(spec.num_experts)):
            missing = sorted(set(range(spec.num_experts)) - set(found))
            raise ArtifactError(
                "partial_experts",
                f"layer {layer} adapts {proj} in {len(found)} of {spec.num_experts} experts (missing {missing[:5]}); "
                "MoE adapters must adapt a projection in every expert or in none.",
            )
        experts[(layer, proj)] = [(found[e]["A"], found[e]["B"]) for e in range(spec.num_experts)]
    gate_up: dict[int, tuple[int, int]] = {}
    for layer in sorted({layer for layer, _ in experts}) if layout == LAYOUT else ():
        gate, up = experts.get((layer, "gate_proj")), experts.get((layer, "up_proj"))
        tied = gate is None or up is None or all(read(g[0]) == read(u[0]) for g, u in zip(gate, up, strict=True))
        gate_up[layer] = (rank, 0) if tied else (2 * rank, rank)
    return PackingPlan(
        spec=spec,
        rank=rank,
        dtype=dtype,
        experts=experts,
        passthrough=sorted(passthrough),
        gate_up=gate_up,
        layout=layout,
    )


def _experts(plan: PackingPlan, layer: int, proj: str, which: str, read: Callable[[str], bytes]) -> torch.Tensor | None:
    """[E, rows, cols] of one projection's lora_A or lora_B across experts, or None if not adapted."""
    names = plan.experts.get((layer, proj))
    if names is None:
        return None
    in_f, out_f = plan.spec.expert_module_shapes[proj]
    shape = (plan.rank, in_f) if which == "A" else (out_f, plan.rank)
    dtype = TORCH_DTYPES[plan.dtype]
    out = torch.empty((len(names), *shape), dtype=dtype)
    for e, (a_name, b_name) in enumerate(names):
        data = bytearray(read(a_name if which == "A" else b_name))
        out[e] = torch.frombuffer(data, dtype=dtype).view(shape)
    return out


def _zeros(plan: PackingPlan, proj: str, which: str) -> torch.Tensor:
    in_f, out_f = plan.spec.expert_module_shapes[proj]
    shape = (plan.rank, in_f) if which == "A" else (out_f, plan.rank)
    return torch.zeros((plan.spec.num_experts, *shape), dtype=TORCH_DTYPES[plan.dtype])


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _gate_up_a(plan: PackingPlan, layer: int, read) -> tuple[tuple[int, ...], memoryview]:
    rank, up_offset = plan.gate_up[layer]
    gate = _experts(plan, layer, "gate_proj", "A", read)
    if up_offset or gate is None:  # untied (both kept), or up alone (or nothing: zeros)
        up = _experts(plan, layer, "up_proj", "A", read)
        parts = [p for p in (gate, up) if p is not None] or [_zeros(plan, "up_proj", "A")]
        gate = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    n, r, hidden = gate.shape  # [E, R, hidden]: row e*R + k
    assert r == rank
    return (n * r, hidden), _raw(gate)


def _gate_up_b(plan: PackingPlan, layer: int, read) -> tuple[tuple[int, ...], memoryview]:
    rank, up_offset = plan.gate_up[layer]
    r, n = plan.rank, plan.spec.num_experts
    inter = plan.spec.expert_module_shapes["gate_proj"][1]
    out = torch.zeros((2 * inter, rank, n), dtype=TORCH_DTYPES[plan.dtype])  # column k*E + e
    gate = _experts(plan, layer, "gate_proj", "B", read)
    if gate is not None:
        out[:inter, :r, :] = gate.permute(1, 2, 0)
    del gate
    up = _experts(plan, layer, "up_proj", "B", read)
    if up is not None:
        out[inter:, up_offset : up_offset + r, :] = up.permute(1, 2, 0)
    return (2 * inter, rank * n), _raw(out)


def _down(plan: PackingPlan, layer: int, read, which: str) -> tuple[tuple[int, ...], memoryview]:
    stacked = _experts(plan, layer, "down_proj", which, read)
    stacked = _zeros(plan, "down_proj", which) if stacked is None else stacked
    n, rows, cols = stacked.shape
    if which == "A":
        return (n * rows, cols), _raw(stacked)  # row e*r + k
    return (rows, cols * n), _raw(stacked.permute(1, 2, 0))  # column k*E + e


def _expert_major(plan: PackingPlan, layer: int, proj: str, which: str, read) -> tuple[tuple[int, ...], memoryview]:
    stacked = _experts(plan, layer, proj, which, read)
    stacked = _zeros(plan, proj, which) if stacked is None else stacked
    return tuple(stacked.shape), _raw(stacked)  # [E, r, in] or [E, out, r]: expert e's bytes, then e+1's


def describe(
    spec: BaseModelSpec, headers: list[SafetensorsHeader], *, rank: int, dtype: str, layout: str = LAYOUT
) -> dict:
    """The description `write_packed` would store, without writing anything."""
    source = {name: header for header in headers for name in header.tensors}
    plan = plan_packing(spec, headers, rank=rank, dtype=dtype, read=lambda n: tensor_bytes(source[n], n), layout=layout)
    return plan.description()


def write_packed(
    spec: BaseModelSpec,
    headers: list[SafetensorsHeader],
    dest: Path,
    *,
    rank: int,
    dtype: str,
    metadata: dict,
    layout: str = LAYOUT,
) -> dict:
    """Pack the adapter whose (checked) headers are given into one safetensors file at `dest`.

    Returns the packing description also stored in the file's metadata under `mint.packing`.
    """
    source = {name: header for header in headers for name in header.tensors}

    def read(name: str) -> bytes:
        return tensor_bytes(source[name], name)

    plan = plan_packing(spec, headers, rank=rank, dtype=dtype, read=read, layout=layout)
    description = plan.description()
    shapes = {name: source[name].tensors[name].shape for name in plan.passthrough}
    write_safetensors(
        dest,
        packed_tensors(plan, read, shapes),
        metadata={**metadata, METADATA_KEY: json.dumps(description, sort_keys=True)},
    )
    return description


def packed_tensors(
    plan: PackingPlan, read: Callable[[str], bytes], passthrough_shapes: dict[str, tuple[int, ...]]
) -> Iterator[Tensor]:
    """Yield the packed adapter's tensors in name order, each built only when the writer asks for it.

    `read(name)` returns a source tensor's raw bytes. Memory: one stacked tensor and the
    per-expert pieces it is built from.
    """
    builders: dict[str, Callable[[], tuple[tuple[int, ...], bytes | memoryview]]] = {}
    for name, shape in passthrough_shapes.items():
        builders[name] = lambda name=name, shape=shape: (shape, read(name))
    for layer in plan.layers if plan.layout == EXPERT_MAJOR else ():
        for proj in EXPERT_PROJECTIONS:
            for which in "AB":
                name = expert_major.tensor_name(PREFIX, layer, proj, which)
                builders[name] = lambda layer=layer, proj=proj, which=which: _expert_major(
                    plan, layer, proj, which, read
                )
    for layer in plan.layers if plan.layout == LAYOUT else ():
        base = f"{PREFIX}.{layer}.mlp.experts"
        builders[f"{base}.base_layer.lora_A.weight"] = lambda layer=layer: _gate_up_a(plan, layer, read)
        builders[f"{base}.base_layer.lora_B.weight"] = lambda layer=layer: _gate_up_b(plan, layer, read)
        builders[f"{base}.lora_A.weight"] = lambda layer=layer: _down(plan, layer, read, "A")
        builders[f"{base}.lora_B.weight"] = lambda layer=layer: _down(plan, layer, read, "B")
    for name in sorted(builders):
        shape, data = builders[name]()
        yield name, plan.dtype, shape, data


def read_description(path: Path) -> dict | None:
    """The packing description stored in a packed file, or None for an unpacked one."""
    header = read_header(path, max_header_bytes=Path(path).stat().st_size)
    raw = header.metadata.get(METADATA_KEY)
    return json.loads(raw) if raw else None


def unpack_moe(path: Path) -> Iterator[Tensor]:
    """Yield the per-expert (and passthrough) tensors a packed file was made from, bit for bit.

    One stacked tensor in memory at a time; names, dtypes and shapes are the source's.
    """
    path = Path(path)
    header = read_header(path, max_header_bytes=path.stat().st_size)
    description = json.loads(header.metadata[METADATA_KEY])
    dtype_name = description["dtype"]
    dtype = TORCH_DTYPES[dtype_name]
    r, n = description["rank"], description["num_experts"]
    inter = description["shapes"]["gate_proj"][1]

    def load(name: str) -> torch.Tensor:
        info = header.tensors[name]
        return torch.frombuffer(bytearray(tensor_bytes(header, name)), dtype=dtype).view(info.shape)

    def per_expert(layer: int, proj: str, which: str, stacked: torch.Tensor) -> Iterator[Tensor]:
        for e in range(n):
            t = stacked[e].contiguous()
            name = f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}.lora_{which}.weight"
            yield name, dtype_name, tuple(t.shape), _raw(t)

    for name in sorted(header.tensors):
        if ".mlp.experts." not in name:
            yield name, header.tensors[name].dtype, header.tensors[name].shape, tensor_bytes(header, name)
            continue
        if description["layout"] == EXPERT_MAJOR:
            _, layer, proj, which = expert_major.parse_name(name)
            if proj in description["layers"][str(layer)]["projections"]:
                yield from per_expert(layer, proj, which, load(name))
            continue
        layer = int(name[len(PREFIX) + 1 :].split(".", 1)[0])
        entry = description["layers"][str(layer)]
        present, rank, up = entry["projections"], entry["gate_up_rank"], entry["up_offset"]
        gate_rows, up_rows = slice(0, r), slice(up, up + r)
        packed = load(name)
        if name.endswith("base_layer.lora_A.weight"):
            both = packed.view(n, rank, -1)
            for proj, rows in (("gate_proj", gate_rows), ("up_proj", up_rows)):
                if proj in present:
                    yield from per_expert(layer, proj, "A", both[:, rows, :])
        elif name.endswith("base_layer.lora_B.weight"):
            both = packed.view(2 * inter, rank, n).permute(2, 0, 1)  # [E, 2*inter, R]
            for proj, rows, cols in (
                ("gate_proj", slice(0, inter), gate_rows),
                ("up_proj", slice(inter, 2 * inter), up_rows),
            ):
                if proj in present:
                    yield from per_expert(layer, proj, "B", both[:, rows, cols])
        elif "down_proj" in present and name.endswith("experts.lora_A.weight"):
            yield from per_expert(layer, "down_proj", "A", packed.view(n, r, -1))
        elif "down_proj" in present and name.endswith("experts.lora_B.weight"):
            yield from per_expert(layer, "down_proj", "B", packed.view(-1, r, n).permute(2, 0, 1))
