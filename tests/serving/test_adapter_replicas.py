"""Replicas per adapter: the count (override, platform default, plan bound), `PATCH adapters/<name>/`, and every
rule that places, flips or drains by it (convergence after a change, the heartbeat's retry, drains, the
explanation of a waiting activation)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from adapters.models import Adapter, replicas_for, replicas_sql
from serving import selectors
from serving.models import Alias, NodeState, Placement, PlacementState, ServingNode
from serving.services.aliases import placement_ready
from serving.services.failover import placements_retry
from serving.services.nodes import drain_step
from serving.services.placement import placement_request
from tenants.access import Actor
from tenants.models import AuditEvent, Tenant
from tenants.services import tenant_update
from tests.conftest import error_of
from tests.factories import ServingNodeFactory
from tests.serving.conftest import approved_revision, make_live, place
from tests.serving.sent_tasks import NODE_TASKS, recorded

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/"


@pytest.fixture
def node_tasks():
    """Tasks for node agents recorded instead of sent; convergence (`alias_converge`) runs, eagerly."""
    with recorded(*NODE_TASKS) as send:
        yield send


@pytest.fixture
def nodes(node) -> list[ServingNode]:
    return [node, ServingNodeFactory(name="node-2", base_model=node.base_model, cpu_slots=3)]


def plan(adapter: Adapter, **fields) -> None:
    Tenant.objects.filter(id=adapter.tenant_id).update(**fields)
    adapter.tenant.refresh_from_db()


def override(adapter: Adapter, replicas: int | None) -> None:
    Adapter.objects.filter(id=adapter.id).update(replicas=replicas)
    adapter.refresh_from_db()


def patch(client, replicas, url: str = URL):
    return client.patch(url, {"replicas": replicas}, format="json")


def nodes_of(revision) -> list[str]:
    return sorted(Placement.objects.filter(revision=revision).values_list("node__name", flat=True))


# ---------------------------------------------------------------- the count


def test_the_count_is_the_override_else_the_default_and_never_above_the_plan(settings):
    settings.MINT_ALIAS_READY_REPLICAS = 1
    assert replicas_for(override=None, max_replicas=2) == 1
    assert replicas_for(override=2, max_replicas=2) == 2
    assert replicas_for(override=5, max_replicas=3) == 3  # a plan lowered below the override clamps it
    settings.MINT_ALIAS_READY_REPLICAS = 4
    assert replicas_for(override=None, max_replicas=2) == 2  # so does a platform default above the plan
    assert replicas_for(override=1, max_replicas=2) == 1


def test_the_database_expression_counts_as_the_rule_does(adapter_a, adapter_b, settings):
    settings.MINT_ALIAS_READY_REPLICAS = 2
    plan(adapter_a, max_replicas=3)
    plan(adapter_b, max_replicas=1)
    extra = Adapter.objects.create(tenant=adapter_a.tenant, name="other", base_model=adapter_a.base_model, replicas=3)
    override(adapter_b, 2)
    rows = Adapter.objects.select_related("tenant").annotate(wanted=replicas_sql())
    assert {a.name: (a.wanted, a.replica_count) for a in rows} == {
        "support-bot": (2, 2),  # the default, within the plan
        "other": (3, 3),
        "globex-secret-bot": (1, 1),  # its override, clamped to its plan
    }
    assert extra.replicas == 3


def test_a_plan_lowered_below_an_override_clamps_it_and_raising_it_again_restores_it(adapter_a):
    plan(adapter_a, max_replicas=3)
    override(adapter_a, 3)
    tenant_update(tenant=adapter_a.tenant, changes={"max_replicas": "1"}, by=Actor.system())
    adapter = Adapter.objects.select_related("tenant").get(id=adapter_a.id)
    assert (adapter.replicas, adapter.replica_count) == (3, 1)
    tenant_update(tenant=adapter_a.tenant, changes={"max_replicas": "3"}, by=Actor.system())
    assert Adapter.objects.select_related("tenant").get(id=adapter_a.id).replica_count == 3


def test_the_plan_field_is_at_least_one(adapter_a):
    from mint_site.errors import MintError

    with pytest.raises(MintError) as refused:
        tenant_update(tenant=adapter_a.tenant, changes={"max_replicas": "0"}, by=Actor.system())
    assert "max_replicas" in refused.value.message


# ---------------------------------------------------------------- the API


@pytest.mark.parametrize("principal", ["approver", "owner", "key:deploy"])
def test_an_approver_or_a_deploy_key_sets_replicas_shown_and_audited(tenant_a, adapter_a, principal, node_tasks):
    response = patch(tenant_a.client_as(principal), 2)

    assert response.status_code == 200, response.content
    assert (response.json()["replicas"], response.json()["replica_count"]) == (2, 2)
    shown = tenant_a.client_as("viewer").get(URL).json()
    assert (shown["replicas"], shown["replica_count"]) == (2, 2)
    [event] = AuditEvent.objects.filter(tenant=adapter_a.tenant, action="adapter.replicas")
    assert event.target == "adapter:support-bot"
    assert event.before == {"replicas": None} and event.after == {"replicas": 2, "count": 2}


def test_null_goes_back_to_the_platform_default(tenant_a, adapter_a, settings, node_tasks):
    settings.MINT_ALIAS_READY_REPLICAS = 1
    override(adapter_a, 2)
    response = patch(tenant_a.client_as("approver"), None)
    assert response.status_code == 200
    assert (response.json()["replicas"], response.json()["replica_count"]) == (None, 1)
    assert Adapter.objects.get(id=adapter_a.id).replicas is None


def test_setting_the_same_value_records_nothing(tenant_a, adapter_a, node_tasks):
    client = tenant_a.client_as("approver")
    assert patch(client, 2).status_code == 200
    assert patch(client, 2).status_code == 200
    assert AuditEvent.objects.filter(action="adapter.replicas").count() == 1


@pytest.mark.parametrize("principal", ["developer", "viewer", "key:pipeline", "key:inference"])
def test_who_may_not_activate_may_not_set_replicas(tenant_a, adapter_a, principal):
    response = patch(tenant_a.client_as(principal), 2)
    assert response.status_code in (401, 403)
    assert Adapter.objects.get(id=adapter_a.id).replicas is None


@pytest.mark.parametrize("bad", [0, -1, "two", 2.5, True, [2], {"n": 2}])
def test_replicas_must_be_a_whole_number_of_at_least_one(tenant_a, adapter_a, bad):
    response = patch(tenant_a.client_as("approver"), bad)
    assert response.status_code == 400, response.content
    assert error_of(response)["message"].startswith("replicas:")
    assert Adapter.objects.get(id=adapter_a.id).replicas is None


def test_an_empty_patch_or_an_unknown_field_is_refused_and_nothing_is_changed(tenant_a, adapter_a):
    client = tenant_a.client_as("approver")
    missing = client.patch(URL, {}, format="json")
    assert missing.status_code == 400 and "replicas, description or tags" in error_of(missing)["message"]
    other = client.patch(URL, {"replicas": 2, "description": "changed", "name": "renamed"}, format="json")
    assert other.status_code == 400 and error_of(other)["message"].startswith("name:")
    adapter = Adapter.objects.get(id=adapter_a.id)
    assert adapter.replicas is None and adapter.description == "" and adapter.name == "support-bot"


def test_replicas_above_the_plan_are_refused_naming_the_limit(tenant_a, adapter_a):
    plan(adapter_a, max_replicas=2)
    response = patch(tenant_a.client_as("approver"), 3)

    assert response.status_code == 429
    error = error_of(response)
    assert error["code"] == "replicas_above_plan"
    assert error["detail"] == {"quota": "max_replicas", "limit": 2, "requested": 3}
    assert "max_replicas" in error["message"]
    assert Adapter.objects.get(id=adapter_a.id).replicas is None
    assert not AuditEvent.objects.filter(action="adapter.replicas").exists()


def test_another_tenants_adapter_is_not_found(tenant_a, tenant_b, adapter_a, adapter_b):
    for principal in ("approver", "owner", "key:deploy"):
        response = patch(tenant_b.client_as(principal), 2)
        assert response.status_code == 404, (principal, response.content)
    assert patch(tenant_a.client_as("approver"), 2, url="/api/v1/adapters/globex-secret-bot/").status_code == 404
    assert set(Adapter.objects.values_list("replicas", flat=True)) == {None}


# ---------------------------------------------------------------- convergence after a change


def test_raising_replicas_places_the_pinned_revisions_on_more_nodes_now(
    tenant_a, adapter_a, nodes, node_tasks, django_capture_on_commit_callbacks
):
    first, _ = nodes
    previous, live = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    alias = make_live(live)
    Alias.objects.filter(id=alias.id).update(
        previous_revision=previous, previous_pinned_until=timezone.now() + timedelta(minutes=10)
    )
    place(first, live, "ready")
    place(first, previous, "ready")

    with django_capture_on_commit_callbacks(execute=True):
        assert patch(tenant_a.client_as("approver"), 2).status_code == 200

    assert nodes_of(live) == ["node-1", "node-2"]  # the live revision: a second replica now
    assert nodes_of(previous) == ["node-1", "node-2"]  # the rollback target keeps the count while pinned
    added = Placement.objects.filter(node__name="node-2")
    assert {p.state for p in added} <= {"queued", "loading"}


def test_a_raised_count_makes_a_pending_activation_wait_for_more_nodes(
    tenant_a, adapter_a, nodes, node_tasks, django_capture_on_commit_callbacks
):
    live, wanted = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    make_live(live, desired=wanted)
    place(nodes[0], live, "ready")
    place(nodes[1], live, "ready")
    place(nodes[0], wanted, "queued")

    with django_capture_on_commit_callbacks(execute=True):
        assert patch(tenant_a.client_as("approver"), 2).status_code == 200

    assert nodes_of(wanted) == ["node-1", "node-2"]
    Placement.objects.filter(revision=wanted).update(state=PlacementState.WARMING, load_ms=1)
    first, second = Placement.objects.filter(revision=wanted).order_by("id")
    assert placement_ready(placement=first, warm_ms=1)
    assert Alias.objects.get(adapter=adapter_a).revision_id == live.id  # ready on 1 of 2: no flip
    assert placement_ready(placement=second, warm_ms=1)
    assert Alias.objects.get(adapter=adapter_a).revision_id == wanted.id


def test_lowering_replicas_flips_what_is_ready_on_enough_nodes_and_unloads_nothing(
    tenant_a, adapter_a, nodes, node_tasks, django_capture_on_commit_callbacks
):
    override(adapter_a, 2)
    live, wanted = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    make_live(live, desired=wanted)
    live_here, live_there = place(nodes[0], live, "ready"), place(nodes[1], live, "ready")
    place(nodes[0], wanted, "ready")  # ready on 1 of the 2 a flip needs

    with django_capture_on_commit_callbacks(execute=True):
        response = patch(tenant_a.client_as("approver"), 1)

    assert response.status_code == 200
    assert Alias.objects.get(adapter=adapter_a).revision_id == wanted.id  # 1 of 1 now: flipped
    states = set(Placement.objects.filter(id__in=[live_here.id, live_there.id]).values_list("state", flat=True))
    assert states == {"ready"}  # the surplus replicas stay; nothing is unloaded by the change


def test_a_change_that_leaves_the_count_alone_converges_nothing(tenant_a, adapter_a, settings):
    settings.MINT_ALIAS_READY_REPLICAS = 2
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    with recorded("alias_converge") as converge:
        assert patch(tenant_a.client_as("approver"), 2).status_code == 200  # the default was 2 already
    converge.assert_not_called()


# ---------------------------------------------------------------- the rules that use the count


@pytest.mark.usefixtures("sent")
def test_the_heartbeat_retry_tops_each_revision_up_to_its_own_adapters_count(nodes, adapter_a, adapter_b):
    override(adapter_a, 2)
    mine, theirs = approved_revision(adapter_a, 1), approved_revision(adapter_b, 1)
    make_live(mine)
    make_live(theirs)
    place(nodes[0], mine, "ready")
    place(nodes[0], theirs, "ready")

    assert placements_retry()["requested"] == 1

    assert nodes_of(mine) == ["node-1", "node-2"]
    assert nodes_of(theirs) == ["node-1"]  # the platform default: 1


@pytest.mark.usefixtures("sent")
def test_a_clamped_override_places_no_more_than_the_plan(nodes, adapter_a):
    plan(adapter_a, max_replicas=3)
    override(adapter_a, 3)
    plan(adapter_a, max_replicas=1)
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    place(nodes[0], revision, "ready")

    assert placements_retry()["requested"] == 0
    assert nodes_of(revision) == ["node-1"]


@pytest.mark.usefixtures("sent")
def test_a_rollback_target_keeps_its_replicas_through_the_grace_and_not_after(nodes, adapter_a):
    third = ServingNodeFactory(name="node-3", base_model=nodes[0].base_model, cpu_slots=3)
    override(adapter_a, 2)
    previous, live = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    alias = make_live(live)
    Alias.objects.filter(id=alias.id).update(
        previous_revision=previous, previous_pinned_until=timezone.now() + timedelta(minutes=10)
    )
    for node in nodes:
        place(node, live, "ready")
        place(node, previous, "ready")
    ServingNode.objects.filter(id=nodes[1].id).update(state=NodeState.DOWN)

    placements_retry()
    assert nodes_of(previous) == ["node-1", "node-2", "node-3"]  # node-2's replica placed again on node-3

    Alias.objects.filter(id=alias.id).update(previous_pinned_until=timezone.now() - timedelta(seconds=1))
    ServingNode.objects.filter(id=third.id).update(state=NodeState.DOWN)
    placements_retry()
    assert nodes_of(previous) == ["node-1", "node-2", "node-3"]  # the grace is over: not placed again


@pytest.mark.usefixtures("sent")
def test_a_drain_waits_for_the_adapters_own_count_elsewhere(nodes, adapter_a, adapter_b):
    draining, other = nodes
    third = ServingNodeFactory(name="node-3", base_model=draining.base_model, cpu_slots=3)
    override(adapter_a, 2)
    mine, theirs = approved_revision(adapter_a, 1), approved_revision(adapter_b, 1)
    make_live(mine)
    make_live(theirs)
    mine_here, theirs_here = place(draining, mine, "ready"), place(draining, theirs, "ready")
    place(other, mine, "ready")
    place(other, theirs, "ready")
    ServingNode.objects.filter(id=draining.id).update(state=NodeState.DRAINING)

    drain_step(node=ServingNode.objects.get(id=draining.id))

    assert Placement.objects.get(id=theirs_here.id).state == "evicting"  # ready on its 1 elsewhere
    assert Placement.objects.get(id=mine_here.id).state == "ready"  # ready on 1 of its 2 elsewhere: stays
    place(third, mine, "ready")
    drain_step(node=ServingNode.objects.get(id=draining.id))
    assert Placement.objects.get(id=mine_here.id).state == "evicting"


@pytest.mark.usefixtures("sent")
def test_a_waiting_activation_explains_the_adapters_count(node, adapter_a, settings):
    settings.MINT_ALIAS_READY_REPLICAS = 1
    override(adapter_a, 2)
    live, wanted = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    make_live(live, desired=wanted)
    place(node, wanted, "ready")

    status = selectors.activation_status(Alias.objects.get(adapter=adapter_a))

    assert status.phase == "waiting"
    assert "Ready on 1 of the 2 nodes a flip needs (the adapter's replicas)" in status.reason


# ---------------------------------------------------------------- capacity: quota in revisions, shares in slots


@pytest.mark.usefixtures("sent")
def test_the_pinned_quota_counts_a_revision_once_however_many_replicas(tenant_a, adapter_a):
    plan(adapter_a, max_ready_revisions=1, max_replicas=3)
    override(adapter_a, 3)
    approved_revision(adapter_a, 1)
    response = tenant_a.client_as("approver").post(f"{URL}activate/", {"revision": 1}, format="json")
    assert response.status_code == 200, response.content


@pytest.mark.usefixtures("sent")
def test_replicas_count_in_fair_shares_so_a_high_override_gives_way(nodes, adapter_a, adapter_b):
    """Two nodes of 3 slots; A's override of 2 puts 3 revisions on all 6: A is over its share (6 / 2 tenants)."""
    override(adapter_a, 2)
    now = timezone.now()
    for n in (1, 2, 3):
        revision = approved_revision(adapter_a, n)
        Alias.objects.create(adapter=adapter_a, name=f"a{n}", revision=revision, desired_revision=revision)
        for node in nodes:
            place(node, revision, "ready", last_used_at=now - timedelta(minutes=10 - n))
    theirs = approved_revision(adapter_b, 1)
    make_live(theirs)

    placement = placement_request(revision=theirs, priority=2, replicas=1)

    assert placement.state == "queued"
    evicted = Placement.objects.get(state="evicting")
    assert evicted.revision.adapter_id == adapter_a.id and evicted.node_id == placement.node_id


@pytest.mark.usefixtures("sent")
def test_the_activation_warning_names_too_few_nodes_for_the_adapters_count(node, adapter_a):
    revision = approved_revision(adapter_a, 1)
    assert selectors.activation_room(adapter_a, revision) is None
    override(adapter_a, 2)
    warning = selectors.activation_room(adapter_a, revision)
    assert "support-bot has 2 replicas and only 1 node of test-dense" in warning


def test_the_admin_shows_the_override_but_leaves_changing_it_to_the_api(client, adapter_a):
    from tests.factories import UserFactory

    client.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    override(adapter_a, 2)
    url = f"/admin/adapters/adapter/{adapter_a.id}/change/"
    page = client.get(url)
    assert page.status_code == 200 and b"replicas" in page.content.lower()
    assert b'name="replicas"' not in page.content  # read-only: no input to post
