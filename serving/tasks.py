"""Celery tasks of the serving plane.

On a node agent (queue `node.<name>`): `placement_prewarm` (two phases), `placement_unload`, `node_disk_trim`,
`node_cache_cleanup`, `node_queue_probe`, `evaluation_cases`. On the control queue: `nodes_heartbeat` (beat),
`alias_converge`, `evaluation_run`.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from celery import shared_task
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from adapters import store
from adapters.artifacts.export import sha256_file
from serving import selectors
from serving.models import AgentPing, NodeState, Placement, PlacementState, ServingNode, lora_name
from serving.services import (
    admission,
    aliases,
    evaluation,
    failover,
    nodes,
    residency,
    retention,
    retire,
    rollout,
    sweep,
    usage,
)
from serving.services.placement import placement_turn
from serving.vllm import VllmClient, VllmError, context_window
from tenants.access import Actor

log = logging.getLogger(__name__)
WARMUP_PROMPT = "Hello"


@shared_task(bind=True, acks_late=True, ignore_result=True)
def agent_ping(self, *, token: str) -> None:
    """Record which worker took this task from which queue. Idempotent per token."""
    delivery = self.request.delivery_info or {}
    queue = delivery.get("routing_key") or delivery.get("exchange") or "?"
    _, created = AgentPing.objects.get_or_create(
        token=token, defaults={"queue": queue, "hostname": self.request.hostname or "?"}
    )
    if not created:
        log.info("agent_ping %s already answered", token)


class CacheMismatch(Exception):
    pass


def _verified(directory: Path, files: list[dict]) -> bool:
    return all((directory / f["name"]).is_file() and sha256_file(directory / f["name"]) == f["sha256"] for f in files)


def fetch_to_node_cache(placement: Placement) -> Path:
    """Phase 1a: copy the revision's frozen export into the node's cache and verify every SHA-256 (the disk
    tier: a copy already there and intact is used as it is, `placement.load_source` says which).

    Files go to a fresh directory that is renamed into place only when complete, and a
    directory already in place is never rewritten: vLLM may re-read it at any time.
    """
    revision = placement.revision
    record = revision.policy_record or {}
    files = [f for f in record.get("files", []) if f["name"] != "policy_record.json"]
    if not revision.export_uri or not files:
        raise CacheMismatch(f"r{revision.number} has no frozen export to load")
    final = Path(placement.node.cache_dir) / lora_name(revision)
    if final.is_dir():
        if _verified(final, files):
            placement.load_source = "disk"
            return final
        raise CacheMismatch(f"{final} holds files that do not match the policy record; refusing to touch them")
    placement.load_source = "store"
    staging = final.parent / f".{final.name}.{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        for entry in files:
            store.download(f"{revision.export_uri}/{entry['name']}", staging / entry["name"])
        if not _verified(staging, files):
            raise CacheMismatch(f"the export of r{revision.number} does not match its recorded SHA-256")
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


@shared_task(bind=True, acks_late=True, ignore_result=True)
def placement_prewarm(self, *, placement_id: int) -> None:
    """Two-phase prewarm on the node agent: fetch + verify + load, then a real warm-up completion."""
    placement = Placement.objects.select_related("node", "revision__adapter").filter(id=placement_id).first()
    if placement is None or placement.state != PlacementState.LOADING:
        log.info("prewarm %s: nothing to do (%s)", placement_id, placement.state if placement else "gone")
        return
    if not sweep.prewarm_begin(placement):
        log.info("prewarm %s: this claim was begun by another copy of the task", placement_id)
        return
    name = lora_name(placement.revision)
    with VllmClient(placement.node.url) as engine:
        try:
            started = time.perf_counter()
            path = fetch_to_node_cache(placement)
            # A packed MoE export needs extras in the load request (e.g. is_3d_lora_weight).
            extra = (placement.revision.policy_record or {}).get("load_request") or {}
            engine.load_lora(name, str(path), **extra)
            residency.node_copy_used(placement=placement, size_bytes=_size_of(path))
            if not admission.placement_loaded(placement=placement, load_ms=(time.perf_counter() - started) * 1000):
                return
            started = time.perf_counter()
            answer = engine.complete(name, WARMUP_PROMPT, max_tokens=1)
            warm_ms = (time.perf_counter() - started) * 1000
            aliases.placement_ready(placement=placement, warm_ms=warm_ms)
            usage.usage_of_warmup(placement=placement, answer=answer, ms=warm_ms)
        except (VllmError, CacheMismatch, OSError) as exc:
            admission.placement_failed(placement=placement, reason=str(exc))


def _size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _drained(engine: VllmClient, name: str) -> bool:
    """Wait until the engine runs no request of `name` (its own metrics say), at most MINT_UNLOAD_DRAIN_S: an
    eviction never cuts a request or a stream under way. True if drained, False if the wait ran out."""
    deadline = time.monotonic() + settings.MINT_UNLOAD_DRAIN_S
    while True:
        try:
            busy = engine.busy_loras()
        except VllmError:
            busy = None  # cannot tell: wait like busy, up to the bound
        if busy is not None and name not in busy:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


@shared_task(bind=True, acks_late=True, ignore_result=True)
def placement_unload(self, *, placement_id: int) -> None:
    """Evict: once the engine runs no request of it, unload it from vLLM and forget the placement. Its files stay
    on the node's disk (the disk tier) until `node_disk_trim` needs the room."""
    placement = Placement.objects.select_related("node", "revision__adapter").filter(id=placement_id).first()
    if placement is None or placement.state != PlacementState.EVICTING:
        return
    sweep.unload_begin(placement)
    name = lora_name(placement.revision)
    try:
        with VllmClient(placement.node.url) as engine:
            if not _drained(engine, name):
                log.warning(
                    "unload of %s on %s: requests still running after %ss",
                    name,
                    placement.node,
                    settings.MINT_UNLOAD_DRAIN_S,
                )
            engine.unload_lora(name)
    except VllmError as exc:
        if exc.transient:
            raise self.retry(exc=exc, countdown=5, max_retries=5) from exc
        log.warning("unload of %s on %s: %s", name, placement.node, exc)
    failover.placement_forget(placement=placement)
    node_disk_trim.apply_async(kwargs={"node_id": placement.node_id}, queue=placement.node.queue)


@shared_task(bind=True, acks_late=True, ignore_result=True)
def node_lora_unload(self, *, node_id: int, name: str) -> None:
    """Unload a LoRA the engine holds that no placement accounts for (`residency.stray_loras`), once no request
    of it runs; a placement made for it meanwhile keeps it."""
    node = ServingNode.objects.filter(id=node_id).first()
    if node is None or name not in residency.stray_loras(node=node, loaded={name}):
        return
    try:
        with VllmClient(node.url) as engine:
            _drained(engine, name)
            engine.unload_lora(name)
    except VllmError as exc:
        log.warning("unload of stray %s on %s: %s", name, node, exc)


@shared_task(bind=True, acks_late=True, ignore_result=True)
def node_disk_trim(self, *, node_id: int) -> None:
    """Keep the node's disk tier within MINT_NODE_DISK_BYTES: remove its least recently used copies, never one a
    placement holds or vLLM still lists (vLLM may re-read files under a loaded name)."""
    node = ServingNode.objects.filter(id=node_id).first()
    if node is None:
        return
    victims = residency.node_copies_over_budget(node=node)
    if not victims:
        return
    try:
        with VllmClient(node.url) as engine:
            loaded = set(engine.models())
    except VllmError:
        return  # cannot tell what vLLM holds: keep the files
    for copy in victims:
        name = lora_name(copy.revision)
        if name in loaded:
            continue
        shutil.rmtree(Path(node.cache_dir) / name, ignore_errors=True)
        residency.node_copy_removed(copy=copy)


@shared_task(bind=True, ignore_result=True)
def node_queue_probe(self, *, node_id: int, sent_at: str) -> None:
    """Sent on a node's queue behind prewarms or unloads nobody began: the agent taking it has taken all sent
    before, so those were lost (services/sweep.py)."""
    sweep.node_queue_probed(node_id=node_id, passed_before=datetime.fromisoformat(sent_at))


@shared_task(bind=True, acks_late=True, ignore_result=True)
def node_cache_cleanup(self, *, node_id: int, name: str) -> None:
    """Remove a node-local adapter copy, but only if vLLM no longer lists it and nothing placed it again."""
    node = ServingNode.objects.filter(id=node_id).first()
    if node is None:
        return
    try:
        with VllmClient(node.url) as engine:
            if name in engine.models():
                return
    except VllmError:
        return  # cannot tell: keep the files
    if any(lora_name(p.revision) == name for p in node.placements.select_related("revision__adapter")):
        return
    shutil.rmtree(Path(node.cache_dir) / name, ignore_errors=True)
    residency.node_copy_forget(node=node, name=name)


@shared_task(bind=True, ignore_result=True)
def node_admit(self, *, node_id: int) -> None:
    """Admission again after a pacing pause (admission.prewarm_pacing_delay)."""
    admission.admit_after_pause(node_id=node_id)


@shared_task(bind=True, ignore_result=True)
def residency_turn(self, *, revision_id: int) -> None:
    """An ask refused on demand, asked again when the turn it waits for ends (a recurring ask), the entry it waits
    for should free, or its tenant's pacing lets its load start; how late the timer fired is measured (the next
    asks' `Retry-After` allow for it)."""
    if self.request.eta:
        eta = datetime.fromisoformat(str(self.request.eta))
        residency.turn_late((timezone.now() - (eta if eta.tzinfo else eta.replace(tzinfo=UTC))).total_seconds())
    placement_turn(revision_id=revision_id)


@shared_task(bind=True, ignore_result=True)
def nodes_heartbeat(self) -> None:
    """Beat: read each node's /health and /v1/models, record up/down, and reconcile up nodes."""
    for node in ServingNode.objects.select_related("base_model"):
        with VllmClient(node.url, timeout=5) as engine:
            healthy = engine.health()
            loaded: set[str] | None = None
            context = None
            seen_at = timezone.now()  # what vLLM lists, as of now: a load finished after it is not missing
            if healthy:
                try:
                    entries = engine.model_entries()
                    loaded, context = {e["id"] for e in entries}, context_window(entries)
                except VllmError:
                    healthy = False
            version = engine.version() if healthy else ""
        if not healthy:
            if node.state != NodeState.DOWN:
                nodes.node_set_state(node=node, state=NodeState.DOWN, by=Actor.system(), heartbeat=True)
            continue
        # A node is seen up again only with records that match what its engine holds: the gateway routes to
        # the ready placements of up and draining nodes, and a restarted engine holds none of them.
        with transaction.atomic():
            nodes.node_set_state(
                node=node,
                state=NodeState.UP,  # or draining, for a node staff drained before it went down
                only_from=(NodeState.DOWN,),  # a draining node stays draining, even if drained since it was read
                by=Actor.system(),
                engine_version=version,
                heartbeat=True,
                max_model_len=context,
            )
            if node.state in (NodeState.UP, NodeState.DRAINING):
                result = nodes.node_reconcile(node=node, loaded=loaded or set(), seen_at=seen_at)
                if any(result.values()):
                    log.info("reconciled %s: %s", node, result)
        if node.state == NodeState.UP:
            for name in residency.stray_loras(node=node, loaded=loaded or set()):
                log.warning("%s holds %s that no placement accounts for: unloading it", node, name)
                node_lora_unload.apply_async(kwargs={"node_id": node.id, "name": name}, queue=node.queue)
        elif node.state == NodeState.DRAINING:
            drained = nodes.drain_step(node=node)
            log.info("draining %s: %s", node, drained)
            with transaction.atomic():
                sweep.handoffs_overdue(node, now=timezone.now())  # its unloads, its last loads
        sweep.probe_node_queue(node=node)
    # A canary whose candidate a node took down with it (or its engine lost) ends before failover places anything.
    stranded = rollout.canaries_stranded_abort()
    if stranded:
        log.warning("canaries aborted, their candidates unreachable: %s", stranded)
    # What waits for capacity is placed as soon as a slot frees; this catches what no event announced.
    retried = failover.placements_retry()
    if any(retried.values()):
        log.info("placements retried: %s", retried)
    # Aliases whose convergence, or a rollback's re-export, was lost with the broker.
    swept = sweep.aliases_sweep()
    if any(swept.values()):
        log.info("aliases swept: %s", swept)
    # Evaluations whose next step was lost (serving/services/evaluation.py).
    evaluations = evaluation.evaluations_sweep()
    if any(evaluations.values()):
        log.info("evaluations swept: %s", evaluations)


@shared_task(bind=True, acks_late=True, ignore_result=True)
def alias_converge(self, *, alias_id: int) -> None:
    """After activation or rollback: flip at once if the revision is ready, else prewarm it first."""
    alias = selectors.alias_for_converge(alias_id)
    if alias is not None:
        aliases.alias_converge(alias=alias)


@shared_task(bind=True, ignore_result=True)
def node_probe(self, *, node_id: int) -> None:
    """A gateway could not reach the node (nodes.node_report_unreachable): check it now, and if it is dead,
    take it out of routing and place its revisions elsewhere without waiting for the next heartbeat."""
    node = ServingNode.objects.filter(id=node_id).first()
    if node is None or node.state == NodeState.DOWN:
        return
    with VllmClient(node.url, timeout=5) as engine:
        if engine.health():
            log.info("node %s was reported unreachable but answers its health check", node)
            return
    log.warning("node %s was reported unreachable and fails its health check: down", node)
    nodes.node_set_state(node=node, state=NodeState.DOWN, by=Actor.system())
    rollout.canaries_stranded_abort(base_model_id=node.base_model_id)
    failover.placements_retry(base_model_id=node.base_model_id)


@shared_task(ignore_result=True)
def usage_purge() -> None:
    """Beat (hourly): drop per-minute and per-hour usage rows past their retention."""
    purged = usage.usage_purge()
    if any(purged.values()):
        log.info("usage rows purged: %s", purged)


@shared_task(bind=True, acks_late=True, ignore_result=True)
def evaluation_run(self, *, evaluation_id: int) -> None:
    """An evaluation's next step: take its turn, find or ask for a placement, hand it to the node (it polls
    itself while it waits: serving/services/evaluation.py)."""
    log.info("evaluation %s: %s", evaluation_id, evaluation.evaluation_run(evaluation_id=evaluation_id))


@shared_task(bind=True, acks_late=True, ignore_result=True)
def evaluation_cases(self, *, evaluation_id: int, placement_id: int, step: int = 0) -> None:
    """On the node agent: run a slice of an evaluation's cases against its ready placement, grade and store
    them; the next slice is queued behind the node's other work."""
    done = evaluation.evaluation_cases(evaluation_id=evaluation_id, placement_id=placement_id, step=step)
    log.info("evaluation %s: %s", evaluation_id, done)


# ---------------------------------------------------------------- retiring and retention (serving/services/retire.py)


@shared_task(bind=True, acks_late=True, ignore_result=True)
def revision_leave_nodes(self, *, revision_id: int, attempt: int = 0) -> None:
    """A revision nothing names any more (its alias deactivated, or it was archived) leaves the nodes."""
    released = retire.revision_leave_nodes(revision_id=revision_id, attempt=attempt)
    if released and any(released.values()):
        log.info("revision %s leaves the nodes: %s", revision_id, released)


@shared_task(bind=True, acks_late=True, ignore_result=True)
def retention_adapter(self, *, adapter_id: int) -> None:
    """An adapter's retention, run now (a revision of it was just exported): archives what its policy lets go."""
    done = retention.retention_run_adapter(adapter_id=adapter_id)
    if done:
        log.info("retention of adapter %s archived %s", adapter_id, done)


@shared_task(ignore_result=True)
def retention_sweep() -> None:
    """Beat: retention over every adapter with a policy, a bounded number of archives per run."""
    done = retention.retention_sweep()
    if any(done.values()):
        log.info("retention sweep: %s", done)
