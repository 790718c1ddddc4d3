"""Writes about serving nodes: registering one, and recording its state (heartbeats, staff draining it)."""

from __future__ import annotations

import math

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from mint_site.errors import MintError
from mint_site.events import live_event
from serving import tasks
from serving.models import NodeState, ServingNode
from tenants.access import Actor
from tenants.services import audit_record


@transaction.atomic
def node_register(
    *,
    name: str,
    base_model,
    url: str,
    served_model_name: str,
    gpu_slots: int,
    cpu_slots: int,
    max_lora_rank: int,
    cache_dir: str,
    engine_flags: list[str] | None = None,
    by: Actor,
) -> ServingNode:
    """Add a serving node, or update the one with this name. It starts `down` until a heartbeat sees it."""
    if gpu_slots < 1 or cpu_slots < gpu_slots:
        raise MintError("cpu_slots must be at least gpu_slots, and gpu_slots at least 1.", code="invalid_slots")
    node, created = ServingNode.objects.update_or_create(
        name=name,
        defaults={
            "base_model": base_model,
            "url": url.rstrip("/"),
            "served_model_name": served_model_name,
            "gpu_slots": gpu_slots,
            "cpu_slots": cpu_slots,
            "max_lora_rank": max_lora_rank,
            "cache_dir": cache_dir,
            "engine_flags": engine_flags or [],
        },
    )
    audit_record(
        tenant=None,
        actor=by,
        action="node.create" if created else "node.update",
        target=f"node:{name}",
        after={
            "url": node.url,
            "base_model": base_model.name,
            "gpu_slots": gpu_slots,
            "cpu_slots": cpu_slots,
            "engine_flags": node.engine_flags,
        },
    )
    return node


@transaction.atomic
def node_set_state(
    *,
    node: ServingNode,
    state: str,
    by: Actor,
    engine_version: str = "",
    heartbeat: bool = False,
    max_model_len: int | None = None,
) -> bool:
    """Record a node's state (from a heartbeat, or staff draining it), and what its engine reports (version,
    context window). Returns whether the state changed."""
    now = timezone.now()
    fields: dict = {"last_heartbeat_at": now} if heartbeat else {}
    if engine_version:
        fields["engine_version"] = engine_version
    if max_model_len:
        fields["max_model_len"] = max_model_len
    changed = (
        ServingNode.objects.filter(id=node.id).exclude(state=state).update(state=state, state_changed_at=now, **fields)
    )
    if not changed and fields:
        ServingNode.objects.filter(id=node.id).update(**fields)
    if changed:
        before = node.state
        node.state = state
        audit_record(
            tenant=None,
            actor=by,
            action="node.state",
            target=f"node:{node.name}",
            before={"state": before},
            after={"state": state},
        )
        live_event(tenant_id=None, type="node.state", id=node.id, state=state, node=node.name)
    return bool(changed)


def _probe_key(node_id: int) -> str:
    return f"serving:node-probe:{node_id}"


def node_report_unreachable(*, name: str) -> bool:
    """A gateway could not reach the node: probe it now rather than at the next heartbeat. Returns whether asked.

    Every gateway process reports its own failures; one probe per node is sent per
    MINT_GATEWAY_NODE_SUSPECT_S whichever process reports (a mark in the shared cache), so a flood of
    failures costs one task. A node already down (or unknown) is not probed: the heartbeat watches for its
    return.
    """
    node_id = (
        ServingNode.objects.filter(name=name, state__in=(NodeState.UP, NodeState.DRAINING))
        .values_list("id", flat=True)
        .first()
    )
    if node_id is None:
        return False
    if not cache.add(_probe_key(node_id), 1, timeout=max(1, math.ceil(settings.MINT_GATEWAY_NODE_SUSPECT_S))):
        return False
    tasks.node_probe.apply_async(kwargs={"node_id": node_id})
    return True
