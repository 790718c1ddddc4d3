"""Loading MinT's expert-major MoE LoRA layout in vLLM 0.32: one patched function, the rest is vLLM's own code.

The patch wraps `WorkerLoRAManager._load_adapter`, the one place where a worker turns a load
request into a `LoRAModel`. For a directory whose `adapter_model.safetensors` is not in the
expert-major layout (a header byte search decides) it calls vLLM's function untouched. For
one that is, it checks that this node can hold the layout, then runs vLLM's same function
with `ExpertMajorLoRAModel` as the LoRA model class: that class reads each layer's six
expert-major tensors into the `PackedLoRALayerWeights` (lists `[w1, w2, w3]` = gate, down,
up; `[E, r, in]` and `[E, out, r]`) that vLLM's `pack_moe` would have built from the
per-expert tensors, and hands every other tensor to vLLM's `LoRAModel.from_lora_tensors`.
From there vLLM's own code runs as for a per-expert adapter: `optimize()` multiplies each
lora_B by its scaling in the LoRA dtype, `set_lora` zeroes the slot and copies. The slot
buffers therefore end up bit for bit as when the per-expert source is loaded; what is saved
is reading and stacking 36,864 small tensors.

Before anything is registered, the model's fused-MoE LoRA layers are checked against the
file (experts, hidden and intermediate sizes, rank), so a malformed or foreign file is
refused with a `ValueError` naming the problem and the engine keeps serving.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict

import torch
from safetensors import safe_open
from vllm.lora.layers.fused_moe import FusedMoE3DWithLoRA, FusedMoEWithLoRA
from vllm.lora.lora_model import LoRAModel
from vllm.lora.lora_weights import PackedLoRALayerWeights
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.utils import get_lora_id, is_base_embedding_weights, parse_fine_tuned_lora_name
from vllm.lora.worker_manager import WorkerLoRAManager

from adapters.artifacts import layout
from mint_vllm_plugin.detect import TENSOR_FILE, adapter_description

log = logging.getLogger(__name__)

TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
# FusedMoEWithLoRA.set_lora unpacks lora_a/lora_b as [w1, w2, w3]: gate, down, up (pack_moe's order).
SLOT_ORDER = ("gate_proj", "down_proj", "up_proj")
_MARK = "_mint_expert_major_patch"


def install() -> bool:
    """Wrap `WorkerLoRAManager._load_adapter`; idempotent (vLLM may load plugins more than once)."""
    original = WorkerLoRAManager._load_adapter
    if getattr(original, _MARK, False):
        return False

    def _load_adapter(self: WorkerLoRAManager, lora_request) -> LoRAModel:
        description = adapter_description(lora_request.lora_path)
        if description is None:
            return original(self, lora_request)
        return load_expert_major(self, lora_request, description, original)

    _load_adapter.__wrapped__ = original  # type: ignore[attr-defined]
    _load_adapter.__doc__ = original.__doc__
    setattr(_load_adapter, _MARK, True)
    WorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign]
    return True


def load_expert_major(worker: WorkerLoRAManager, lora_request, description: dict, original) -> LoRAModel:
    """vLLM's `_load_adapter` with the expert-major reader, between checks that the node can hold the file."""
    layout.check_description(description)
    manager = worker._adapter_manager
    if manager._enable_moe_shared_loras:
        raise ValueError(
            f"{lora_request.lora_path}: this node runs with --enable-moe-shared-loras, which keeps one gate/up "
            f"lora_A for all experts; it cannot serve a {layout.LAYOUT} adapter"
        )
    if manager._is_3d_moe_model:
        raise ValueError(f"{lora_request.lora_path}: this model's MoE LoRA layers are 3-D; {layout.LAYOUT} needs 2-D")
    if worker._lora_model_cls is not LoRAModel:
        raise ValueError(f"{lora_request.lora_path}: {layout.LAYOUT} needs vLLM's LoRAModel on this worker")
    worker._lora_model_cls = ExpertMajorLoRAModel
    try:
        lora = original(worker, lora_request)
    finally:
        worker._lora_model_cls = LoRAModel
    check_fits_model(manager, lora, lora_request.lora_path)
    return lora


def check_fits_model(manager, lora: LoRAModel, where: str) -> None:
    """ValueError unless every expert-major layer of `lora` fits a 2-D fused-MoE LoRA layer of the model."""
    for name in getattr(lora, "mint_expert_modules", ()):
        module = manager.modules.get(name)
        if not isinstance(module, FusedMoEWithLoRA) or isinstance(module, FusedMoE3DWithLoRA):
            raise ValueError(f"{where}: the model has no 2-D fused-MoE LoRA layer {name!r}")
        if module._w13_slices != 2 or module.tp_size != 1:
            raise ValueError(f"{where}: {name!r} is not a gated MoE on one tensor-parallel rank")
        weights = lora.loras[name]
        a_buffers = (module.w13_lora_a_stacked[0], module.w2_lora_a_stacked[0], module.w13_lora_a_stacked[1])
        b_buffers = (module.w13_lora_b_stacked[0], module.w2_lora_b_stacked[0], module.w13_lora_b_stacked[1])
        for proj, a, b, a_buf, b_buf in zip(
            SLOT_ORDER, weights.lora_a, weights.lora_b, a_buffers, b_buffers, strict=True
        ):
            experts, rank, in_f = a.shape
            out_f = b.shape[1]
            fits = (
                experts == module.global_num_experts
                and rank <= a_buf.shape[2]
                and in_f == a_buf.shape[3]
                and out_f == b_buf.shape[2]
            )
            if not fits:
                raise ValueError(
                    f"{where}: {name}.{proj} is {experts} experts x rank {rank} x ({in_f} -> {out_f}); "
                    f"the model's layer has {module.global_num_experts} experts, rank <= {a_buf.shape[2]}, "
                    f"({a_buf.shape[3]} -> {b_buf.shape[2]})"
                )


class ExpertMajorLoRAModel(LoRAModel):
    """A `LoRAModel` read from an expert-major file. Only its constructor differs: it returns plain `LoRAModel`s."""

    @classmethod
    def from_local_checkpoint(
        cls,
        lora_dir: str,
        expected_lora_modules: set[str],
        peft_helper: PEFTHelper,
        *,
        lora_model_id: int | None = None,
        device: str = "cuda",
        dtype: torch.dtype | None = None,
        model_vocab_size: int | None = None,
        weights_mapper=None,
        skip_prefixes: list[str] | None = None,
        moe_ep_spec=None,  # expert-parallel slicing happens later, in vLLM's _slice_moe_lora_ep
    ) -> LoRAModel:
        path = os.path.join(lora_dir, TENSOR_FILE)
        experts: dict[tuple[str, int], dict[tuple[str, str], torch.Tensor]] = defaultdict(dict)
        others: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as f:
            description = layout.check_description(layout.description_from_metadata(f.metadata()))
            file_dtype = TORCH_DTYPES[description["dtype"]]
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                key = layout.parse_name(name)
                if key is None:
                    if ".experts." in name:
                        raise ValueError(
                            f"{path}: {name} is not an expert-major tensor; a {layout.LAYOUT} file holds experts "
                            "only as experts.<proj>.lora_A/B"
                        )
                    others[name] = f.get_tensor(name)
                    continue
                prefix, layer, proj, which = key
                tensor = f.get_tensor(name)
                if tensor.dtype != file_dtype:
                    raise ValueError(f"{path}: {name} is {tensor.dtype}, the description says {description['dtype']}")
                experts[(prefix, layer)][(proj, which)] = tensor
        _check_expected(path, others, expected_lora_modules, peft_helper, weights_mapper, skip_prefixes)
        if experts and "experts" not in expected_lora_modules:
            raise ValueError(f"{path}: the model has no MoE experts to adapt")
        described = set(description["layers"])
        found = {str(layer) for _, layer in experts}
        if found != described:
            raise ValueError(
                f"{path}: the description lists layers {sorted(described, key=int)} but the file has expert tensors "
                f"for {sorted(found, key=int)}"
            )
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=get_lora_id() if lora_model_id is None else lora_model_id,
            tensors=others,
            peft_helper=peft_helper,
            device=device,
            dtype=dtype,
            model_vocab_size=model_vocab_size,
            weights_mapper=weights_mapper,
            skip_prefixes=skip_prefixes,
        )
        names = []
        for (prefix, _layer), tensors in sorted(experts.items(), key=lambda item: item[0][1]):
            any_name = f"{prefix}.gate_proj.lora_A.weight"
            if skip_prefixes and LoRAModel._should_skip_module(any_name, skip_prefixes):
                continue
            module_name = parse_fine_tuned_lora_name(any_name, weights_mapper)[0].rpartition(".")[0]
            peft_module = parse_fine_tuned_lora_name(any_name)[0].rpartition(".")[0]
            lora.loras[module_name] = _packed_experts(
                path, module_name, peft_module, tensors, description, peft_helper, device=device, dtype=dtype
            )
            names.append(module_name)
        lora.mint_expert_modules = names  # type: ignore[attr-defined]
        return lora


def _check_expected(path, tensors, expected_lora_modules, peft_helper, weights_mapper, skip_prefixes) -> None:
    """vLLM's check_unexpected_modules (lora_model.py) for the non-expert tensors."""
    unexpected = []
    for name in tensors:
        if is_base_embedding_weights(name):
            continue
        if skip_prefixes and LoRAModel._should_skip_module(name, skip_prefixes):
            continue
        module_name, _ = parse_fine_tuned_lora_name(name, weights_mapper)
        base_name = module_name.rsplit(".", 1)[-1]
        if base_name not in expected_lora_modules and base_name not in (peft_helper.modules_to_save or ()):
            unexpected.append(module_name)
    if unexpected:
        raise ValueError(
            f"While loading {path}, expected target modules in {expected_lora_modules} but received {unexpected}."
        )


def _packed_experts(
    path: str,
    module_name: str,
    peft_module: str,
    tensors: dict[tuple[str, str], torch.Tensor],
    description: dict,
    peft_helper: PEFTHelper,
    *,
    device: str,
    dtype: torch.dtype | None,
) -> PackedLoRALayerWeights:
    """What `PackedLoRALayerWeights.pack_moe` returns for this layer's per-expert weights, without stacking them.

    Same conversions in the same order: each factor `.to(device, dtype)` as `from_lora_tensors`
    does, and where a projection's experts have different scalings (rank/alpha patterns), each
    expert's lora_B multiplied by its own before packing, as `pack_moe` does through `optimize()`.
    """
    n = description["num_experts"]
    lora_a, lora_b, scalings, ranks = [], [], [], []
    for proj in SLOT_ORDER:
        missing = [w for w in "AB" if (proj, w) not in tensors]
        if missing:
            raise ValueError(f"{path}: {peft_module}.{proj} has no lora_{'/'.join(missing)}")
        a, b = tensors[(proj, "A")], tensors[(proj, "B")]
        rank = a.shape[1] if a.dim() == 3 else -1
        if tuple(a.shape) != layout.expected_shape(description, proj, "A", rank) or tuple(b.shape) != (
            layout.expected_shape(description, proj, "B", rank)
        ):
            raise ValueError(
                f"{path}: {peft_module}.{proj} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match "
                f"{n} experts x {description['shapes'][proj]} at one rank"
            )
        if peft_helper.rank_pattern or peft_helper.alpha_pattern:
            per_expert = [peft_helper.get_rank_and_scaling(f"{peft_module}.{e}.{proj}") for e in range(n)]
        else:
            per_expert = [peft_helper.get_rank_and_scaling(f"{peft_module}.0.{proj}")]
        if {r for r, _ in per_expert} != {rank}:
            raise ValueError(
                f"{path}: {peft_module}.{proj} has rank {rank} but adapter_config.json gives "
                f"{sorted({r for r, _ in per_expert})}"
            )
        a = a.to(device=device, dtype=dtype)
        b = b.to(device=device, dtype=dtype)
        scaling = per_expert[0][1]
        if len({s for _, s in per_expert}) > 1:
            for e, (_, s) in enumerate(per_expert):
                if s != 1:
                    b[e] *= s
            scaling = 1
        lora_a.append(a)
        lora_b.append(b)
        scalings.append(scaling)
        ranks.append(rank)
    return PackedLoRALayerWeights(
        module_name,
        ranks[0],
        [peft_helper.lora_alpha] * 3,
        lora_a,
        lora_b,
        scaling=scalings,
    )
