"""Looking inside revisions: what a frozen export holds module by module (tensor shapes, norms), two revisions side
by side (config, modules, evaluation scores), and a revision's lineage (its parent chain and children).

Norms are read from the export's safetensors files (never the tenant's upload): per LoRA module, the Frobenius
norm of lora_A, of lora_B and of the update they make, ‖ΔW‖ = (alpha/r)·‖B·A‖, computed from the r-by-r Gram matrices
(‖BA‖² = Σ (BᵀB ∘ AAᵀ)), so a module of any width costs O(r²) memory beyond its own tensors. An export larger
than MINT_INSPECT_MAX_BYTES is described by its headers only (shapes, no norms). A summary is cached per
revision: an export never changes.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from django.conf import settings
from django.core.cache import cache

from adapters import store
from adapters.artifacts.safetensors_io import read_header, tensor_bytes
from adapters.models import AdapterRevision, Evaluation
from adapters.runs import parent_chain

SUMMARY_CACHE_S = 24 * 3600
MAX_MODULES = 4000
LINEAGE_DEPTH = 12
_SUFFIXES = {".lora_A.weight": "a", ".lora_B.weight": "b"}
_NUMPY = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def _cache_key(revision: AdapterRevision) -> str:
    return f"adapters:inspect:v1:{revision.id}:{revision.sha256 or revision.number}"


def _array(dtype: str, data: bytes, shape: tuple[int, ...]) -> np.ndarray | None:
    if dtype == "BF16":  # the upper half of a float32
        widened = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return widened.view(np.float32).reshape(shape).astype(np.float64)
    kind = _NUMPY.get(dtype)
    if kind is None:
        return None
    return np.frombuffer(data, dtype=np.dtype(kind).newbyteorder("<")).reshape(shape).astype(np.float64)


def _delta_norm(a: np.ndarray, b: np.ndarray) -> float | None:
    """‖B·A‖ for A [r, in] and B [out, r], or summed over experts for stacked [E, r, in] and [E, out, r]."""
    if a.ndim == 2 and b.ndim == 2 and a.shape[0] == b.shape[1]:
        a, b = a[None], b[None]
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
        return None
    total = 0.0
    for expert in range(a.shape[0]):
        gram_a = a[expert] @ a[expert].T
        gram_b = b[expert].T @ b[expert]
        total += float(np.sum(gram_a * gram_b))
    return math.sqrt(max(total, 0.0))


def _module_of(name: str) -> tuple[str, str] | None:
    for suffix, which in _SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)].removeprefix("base_model.model."), which
    return None


def _read_export(revision: AdapterRevision, *, with_norms: bool) -> tuple[dict[str, dict], str | None]:
    """Per module {"a": {shape, norm}, "b": {…}}, from the export's safetensors files; and a note if partial."""
    record = revision.policy_record or {}
    names = [f["name"] for f in record.get("files", []) if f["name"].endswith(".safetensors")]
    modules: dict[str, dict] = {}
    arrays: dict[tuple[str, str], np.ndarray] = {}  # a half whose other half is not read yet
    scale = (revision.alpha or 0) / revision.rank if revision.rank else None
    with tempfile.TemporaryDirectory(prefix=f"mint-inspect-{revision.id}-", dir=settings.MINT_WORK_DIR) as work:
        for name in names:
            local = Path(work) / name
            try:
                store.download(f"{revision.export_uri}/{name}", local)
            except FileNotFoundError:
                return {}, "The export's files are not in the store (archived, or being written again)."
            header = read_header(local, max_header_bytes=settings.MINT_SAFETENSORS_MAX_HEADER_BYTES)
            for tensor in header.tensors.values():
                found = _module_of(tensor.name)
                if found is None:
                    continue
                module, which = found
                entry = modules.setdefault(module, {})
                entry[which] = {"shape": list(tensor.shape), "dtype": tensor.dtype, "norm": None}
                entry.setdefault("delta_norm", None)
                if not with_norms:
                    continue
                array = _array(tensor.dtype, tensor_bytes(header, tensor.name), tensor.shape)
                if array is None:
                    continue
                entry[which]["norm"] = float(np.linalg.norm(array))
                arrays[(module, which)] = array
                other = arrays.get((module, "b" if which == "a" else "a"))
                if other is not None:  # both halves read: the update's norm, then neither is kept
                    a, b = (array, other) if which == "a" else (other, array)
                    norm = _delta_norm(a, b)
                    entry["delta_norm"] = norm * scale if norm is not None and scale is not None else None
                    arrays.pop((module, "a")), arrays.pop((module, "b"))
            local.unlink()
    note = None if with_norms else "Norms are not computed for exports over MINT_INSPECT_MAX_BYTES."
    return dict(sorted(modules.items())[:MAX_MODULES]), note


def revision_summary(revision: AdapterRevision) -> dict[str, Any]:
    """What a revision is: its config (from the catalog and its policy record) and, while its export is in the
    store, its modules with shapes and norms. Cached per revision."""
    record = revision.policy_record or {}
    config = {
        "rank": revision.rank,
        "alpha": revision.alpha,
        "target_modules": list(revision.target_modules or []),
        "training_step": revision.training_step,
        "parent": f"r{revision.parent.number}" if revision.parent_id and revision.parent else None,
        "dtype": record.get("dtype"),
        "tensor_count": record.get("tensor_count"),
        "engine_layout": record.get("engine_layout"),
        "size_bytes": revision.size_bytes,
        "export_bytes": revision.export_bytes,
        "sha256": revision.sha256,
    }
    summary: dict[str, Any] = {"revision": revision.label, "state": revision.state, "config": config}
    if not (revision.export_uri and record.get("files")) or revision.state == "archived":
        return summary | {"modules": {}, "note": "No export to read (not exported yet, or archived)."}
    key = _cache_key(revision)
    cached = cache.get(key)
    if cached is None:
        with_norms = revision.export_bytes <= settings.MINT_INSPECT_MAX_BYTES
        modules, note = _read_export(revision, with_norms=with_norms)
        cached = {"modules": modules, "note": note}
        if note is None or with_norms is False:
            cache.set(key, cached, SUMMARY_CACHE_S)
    return summary | cached


def _scores(revision: AdapterRevision) -> dict[int, float | None]:
    rows = Evaluation.objects.filter(revision=revision).values_list("suite__version", "score", "state")
    return {version: score for version, score, _ in rows}


def revision_diff(a: AdapterRevision, b: AdapterRevision) -> dict[str, Any]:
    """Two revisions side by side: each config field (with whether it changed), each module (shapes, norms, the
    change of ‖ΔW‖), and their evaluation scores on each suite version."""
    left, right = revision_summary(a), revision_summary(b)
    config = {
        name: {"a": left["config"][name], "b": right["config"][name], "changed": left["config"][name] != value}
        for name, value in right["config"].items()
    }
    modules = []
    for name in sorted(set(left["modules"]) | set(right["modules"])):
        one, two = left["modules"].get(name), right["modules"].get(name)
        shapes = (
            [(one or {}).get(w, {}).get("shape") for w in "ab"],
            [(two or {}).get(w, {}).get("shape") for w in "ab"],
        )
        norms = ((one or {}).get("delta_norm"), (two or {}).get("delta_norm"))
        modules.append(
            {
                "module": name,
                "a": one,
                "b": two,
                "only_in": "a" if two is None else "b" if one is None else None,
                "shape_changed": one is not None and two is not None and shapes[0] != shapes[1],
                "delta_norm_change": norms[1] - norms[0] if None not in norms else None,
            }
        )
    scores_a, scores_b = _scores(a), _scores(b)
    evaluations = [
        {"suite_version": v, "a": scores_a.get(v), "b": scores_b.get(v)}
        for v in sorted(set(scores_a) | set(scores_b), reverse=True)
    ]
    return {
        "a": a.label,
        "b": b.label,
        "config": config,
        "modules": modules,
        "evaluations": evaluations,
        "notes": [n for n in (left.get("note"), right.get("note")) if n],
    }


def revision_lineage(revision: AdapterRevision) -> dict[str, Any]:
    """The parent chain (nearest first, at most LINEAGE_DEPTH: adapters.runs.parent_chain) and the direct children
    (at most LINEAGE_DEPTH)."""
    chain = parent_chain(revision=revision, limit=LINEAGE_DEPTH + 2)[1:]  # [0] is the revision itself
    children = [
        {"revision": f"r{n}", "number": n, "state": s}
        for n, s in AdapterRevision.objects.filter(parent=revision)
        .order_by("number")
        .values_list("number", "state")[:LINEAGE_DEPTH]
    ]
    return {
        "revision": revision.label,
        "state": revision.state,
        "ancestors": [{key: step[key] for key in ("revision", "number", "state")} for step in chain[:LINEAGE_DEPTH]],
        "more_ancestors": len(chain) > LINEAGE_DEPTH,
        "children": children,
    }
