"""A route: the revision a `model` string names now, and the ready placements that serve it.

The values serving/gateway/resolve.py reads from the database and caches, and that the parts routing a request
read (proxy.py, residency.py, canary.py, sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """One ready placement of a revision: where to send a request and under which LoRA name."""

    placement_id: int
    node_name: str
    node_url: str
    lora_name: str
    draining: bool = False  # the node is being drained: it serves until the revision is ready elsewhere
    max_model_len: int | None = None  # the node's context window, as its heartbeat read it (None: not known)
    gpu_slots: int = 0  # the node's --max-loras: how many adapters its batch holds (serving/gateway/residency.py)
    routed_experts: bool = False  # the node's engine returns routed experts (serving/gateway/sampling.py)


@dataclass(frozen=True)
class Resolution:
    """A revision a model string points at now, and its ready placements (possibly none)."""

    adapter_id: int
    adapter_name: str
    revision_id: int
    revision_number: int
    lora_name: str
    targets: tuple[Target, ...]
    canary: Canary | None = None  # an alias's running canary (never for a pinned `@rN`)
    # The revision's state: aliases name approved ones only; a pin `@rN` may name any (who may call which:
    # serving/gateway/sampling.py).
    state: str = "approved"


@dataclass(frozen=True)
class Canary:
    """An alias's canary as the gateway routes it (serving/gateway/canary.py): `percent` % of its requests go to
    `arm` (the candidate's resolution, its targets possibly none) once `routing`; the counters' key names the
    canary by its alias and start."""

    alias_id: int
    percent: int
    started_us: int
    routing: bool  # ready on its replica count once: its share is routed to it, and counted
    arm: Resolution
