"""A hostile tenant against the serving plane's capacity rules and the gateway's request policy.

Tests marked `# Found:` reproduce a weakness a hostile review found (each failed on the code it was written
against, and guards its fix); the others prove that a defence holds.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from unittest import mock

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone

from adapters.models import AdapterRevision
from mint_site.errors import QuotaExceeded
from serving import services
from serving.gateway import GatewayError
from serving.gateway.auth import GatewayPlan
from serving.gateway.policy.fields import check_request
from serving.models import Alias, Placement, Priority
from serving.selectors import pins
from serving.services import capacity
from serving.services.failover import placement_forget, placements_retry
from serving.services.placement import placement_request
from tenants.access import Actor
from tests.serving import test_capacity
from tests.serving.conftest import place
from tests.serving.gateway_world import call, complete
from tests.serving.test_capacity import a_fills_the_node, activate, pin, plan

# test_capacity's fixture, used here by name: its revisions.
revisions_of = test_capacity.revisions_of

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]


def tenant_pins(tenant_id: int) -> set[int]:
    return {rid for rid, tid in pins.pinned_revisions().items() if tid == tenant_id}


# ---------------------------------------------------------------- pinned-revision quota


# Found: re-activating an alias on the revision it already wants skips the quota check (nothing new is
# pinned) but still rewrites `updated_at`, which is also the start of the previous revision's rollback grace.
# So a tenant that re-activates its live revision every few minutes keeps its previous revision pinned (and
# loaded) forever, beyond max_ready_revisions.
def test_reactivating_the_live_revision_does_not_extend_the_previous_ones_grace(tenant_a, adapter_a, revisions_of):
    plan(adapter_a, max_ready_revisions=1)
    first, second = revisions_of("a", 2)
    alias = pin(second, "production")
    expired = timezone.now() - timedelta(seconds=django_settings.MINT_ROLLBACK_GRACE_S + 60)
    Alias.objects.filter(id=alias.id).update(previous_revision=first, updated_at=expired, previous_pinned_until=expired)
    assert tenant_pins(adapter_a.tenant_id) == {second.id}  # the grace of r1 is over

    assert activate(tenant_a, adapter_a, 2, "production").status_code == 200  # a no-op: r2 is live already

    assert tenant_pins(adapter_a.tenant_id) == {second.id}, "r1's grace was restarted by a no-op activation"


# Found: the README allows a swap in flight "one more [pin] per alias"; a second activation inside the
# rollback grace of the first pins three revisions through one alias (previous in grace, live, desired), so
# a tenant with quota 1 and one alias holds three pinned revisions (with 8 aliases on each of 4 adapters and the
# default quota 4: 4 + 2 * 32 = 68, where the documented bound is 4 + 32).
def test_one_alias_pins_at_most_one_revision_more_than_the_quota(tenant_a, adapter_a, revisions_of):
    plan(adapter_a, max_ready_revisions=1)
    first, second, third = revisions_of("a", 3)
    alias = pin(second, "production")
    grace = timedelta(seconds=django_settings.MINT_ROLLBACK_GRACE_S)
    just_flipped = {"updated_at": timezone.now(), "previous_pinned_until": timezone.now() + grace}
    Alias.objects.filter(id=alias.id).update(previous_revision=first, **just_flipped)
    assert tenant_pins(adapter_a.tenant_id) == {first.id, second.id}

    assert activate(tenant_a, adapter_a, 3, "production").status_code == 200

    pinned = tenant_pins(adapter_a.tenant_id)
    assert third.id in pinned
    assert len(pinned) <= 1 + 1, f"one alias with quota 1 pins {len(pinned)} revisions"


def test_the_last_pin_cannot_be_taken_twice_by_racing_activations(transactional_db, adapter_a, revisions_of):
    """Defence holds: the tenant's row lock serialises two activations that each would take the last pin."""
    assert connection.vendor == "postgresql"
    plan(adapter_a, max_ready_revisions=1)
    first, second = revisions_of("a", 2)
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def go(revision: AdapterRevision, alias: str) -> None:
        try:
            barrier.wait()
            services.revision_activate(
                adapter=adapter_a, revision=revision, by=Actor.system(), alias=alias, reserve=True
            )
            outcomes.append("ok")
        except QuotaExceeded:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=go, args=a) for a in ((first, "one"), (second, "two"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["ok", "refused"]
    assert len(tenant_pins(adapter_a.tenant_id)) == 1


# Found: activation locks the tenant row, then the alias row (`_check_capacity`, then `rollout.lock_alias`); a
# rollback locks the alias row, then the tenant row. An activation and a rollback of the same alias at once
# deadlock: PostgreSQL aborts one of them after deadlock_timeout and the caller gets a 500.
def test_an_activation_and_a_rollback_of_one_alias_at_once_do_not_deadlock(transactional_db, adapter_a, revisions_of):
    assert connection.vendor == "postgresql"
    first, second, third = revisions_of("a", 3)
    alias = pin(second, "production")
    Alias.objects.filter(id=alias.id).update(previous_revision=first)
    rollback_holds_alias, activation_holds_tenant = threading.Event(), threading.Event()
    real_lock_tenant = capacity.lock_tenant
    errors: list[BaseException] = []

    def lock_tenant(tenant_id: int):
        if threading.current_thread().name == "rollback":
            rollback_holds_alias.set()  # revision_rollback has locked the alias already
            activation_holds_tenant.wait(5)
            return real_lock_tenant(tenant_id)
        rollback_holds_alias.wait(5)
        tenant = real_lock_tenant(tenant_id)
        activation_holds_tenant.set()
        return tenant

    def run(fn) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [
        threading.Thread(
            name="activation",
            target=run,
            args=(lambda: services.revision_activate(adapter=adapter_a, revision=third, by=Actor.system()),),
        ),
        threading.Thread(
            name="rollback",
            target=run,
            args=(lambda: services.revision_rollback(adapter=adapter_a, by=Actor.system()),),
        ),
    ]
    with mock.patch.object(capacity, "lock_tenant", lock_tenant):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert errors == [], f"lock-order inversion: {errors!r}"


# ---------------------------------------------------------------- waiting placements and their retry


def _hog_and_newcomer(node, adapter_a, revisions_of, waiting: int) -> Placement:
    """A pins 3 + `waiting` revisions: 3 ready (the node's 3 slots), the rest waiting for an hour. B pins one,
    waiting since now. Returns B's waiting placement."""
    now = timezone.now()
    old = now - timedelta(hours=1)
    hog = AdapterRevision.objects.bulk_create(
        [
            AdapterRevision(adapter=adapter_a, number=n, state="approved", source_uri="x", export_uri=f"e/{n}")
            for n in range(1, 4 + waiting)
        ]
    )
    Alias.objects.bulk_create(
        [Alias(adapter=adapter_a, name=f"a{i}", revision=r, desired_revision=r) for i, r in enumerate(hog)]
    )
    for i, revision in enumerate(hog[:3]):
        place(node, revision, "ready", last_used_at=now - timedelta(minutes=10 - i))
    Placement.objects.bulk_create(
        [
            Placement(node=node, revision=r, state="waiting", priority=Priority.ACTIVATION, queued_at=old)
            for r in hog[3:]
        ]
    )
    (theirs,) = revisions_of("b", 1)
    pin(theirs, "production", live=False)
    return place(node, theirs, "waiting", priority=Priority.ACTIVATION, queued_at=now)


def test_a_tenant_under_its_share_is_placed_by_the_retry_behind_a_few_waiting_rows(node, adapter_a, revisions_of):
    """Defence holds (control for the finding below): with 10 of A's rows waiting, B (0 of 3 slots held, fair
    share 1.5) takes a slot of A (3 held) at the next retry."""
    mine = _hog_and_newcomer(node, adapter_a, revisions_of, waiting=10)
    placements_retry()
    assert Placement.objects.get(id=mine.id).state == "queued"


# Found: placements_retry takes the oldest `limit` (200) waiting rows by (priority, queued_at) *before* it
# orders them by slots held. Rows that cannot be placed keep their old queued_at, so once 200 such rows exist
# (of a tenant over its fair share, or of a few tenants together, across base models on the heartbeat's
# retry), a newer waiting row of a tenant under its share, which could take a slot from the over-share tenant,
# is never tried again: it waits forever. (Each retry also runs _place, ~15 queries with two scans of the
# base model's aliases, for each of those 200 rows, on every heartbeat and every unload.)
def test_a_tenant_under_its_share_is_placed_even_behind_200_unplaceable_waiting_rows(node, adapter_a, revisions_of):
    mine = _hog_and_newcomer(node, adapter_a, revisions_of, waiting=200)
    placements_retry()
    assert Placement.objects.get(id=mine.id).state == "queued"


def test_fair_share_eviction_does_not_ping_pong(node, adapter_a, revisions_of, django_capture_on_commit_callbacks):
    """Defence holds: once B took a slot of A's (A over its share), A's evicted revision waits; retries do not take
    it back from B, however often they run."""
    now = timezone.now()
    a, b = a_fills_the_node(node, revisions_of)
    with django_capture_on_commit_callbacks(execute=True):
        taken = placement_request(revision=b, priority=Priority.ACTIVATION)
    evicted = Placement.objects.get(revision=a[0])
    placement_forget(placement=evicted)
    Placement.objects.filter(id=taken.id).update(state="ready", ready_at=now)
    for _ in range(3):
        placements_retry()
    assert Placement.objects.get(id=taken.id).state == "ready"
    assert Placement.objects.get(revision=a[0]).state == "waiting"


# ---------------------------------------------------------------- gateway request policy

PLAN = GatewayPlan()


@pytest.fixture
def gw(transactional_db, world):
    """The gateway's test world on committed rows (the gateway reads them on its own threads)."""
    return world


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "extra_body": {"priority": -10}}),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x", "image_url": {"url": "file:///etc/passwd"}}],
                    }
                ]
            },
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "reasoning": "y"}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True, "priority": 1}},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "chat_template": "{{x}}"}}],
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "guided_json": {}},
                },
            },
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "priorit\u0443": 1}),
        ("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}),
        ("/v1/completions", {"prompt": "x", "n": True}),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}),
        ("/v1/completions", {"prompt": "x", "temperature": float("nan")}),
        ("/v1/completions", {"prompt": ["a"] * 5}),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a" * 5000}}),
    ],
)
def test_forbidden_fields_do_not_slip_through_nesting_or_lookalikes(path, body):
    """Defence holds: nested, look-alike and out-of-range fields are refused by name."""
    with pytest.raises(GatewayError) as refused:
        check_request(path, body, PLAN)
    assert refused.value.status == 400


def test_duplicate_json_keys_forward_only_what_was_checked(gw):
    world = gw
    """Defence holds: the body is parsed once and forwarded re-serialised, so a duplicate key can neither smuggle an
    unchecked value to the node nor slip a refused one past the check."""
    over = call(
        world,
        "POST",
        "/v1/completions",
        world.token,
        '{"model":"support-bot","prompt":"Hi","max_tokens":4,"max_tokens":100000}',
    )
    assert over.status == 400 and over.error()["code"] == "max_tokens_too_large"
    ok = call(
        world,
        "POST",
        "/v1/completions",
        world.token,
        '{"model":"support-bot","prompt":"Hi","max_tokens":100000,"max_tokens":4}',
    )
    assert ok.status == 200
    assert world.vllm.calls[-1][2]["max_tokens"] == 4


# Found: a deeply nested body makes json.loads raise RecursionError, which is not a ValueError: the gateway
# answers 500 server_error and logs a full traceback per request, instead of 400 invalid_json.
def test_a_deeply_nested_body_is_a_400_not_a_500(gw):
    world = gw
    body = '{"model":"support-bot","prompt":' + "[" * 100_000 + "]" * 100_000 + "}"
    answer = call(world, "POST", "/v1/completions", world.token, body)
    assert world.state.inflight_cap.live(world.tenant_a.tenant.id) == 0
    assert answer.status == 400, answer.content[:200]


def test_the_inflight_slot_comes_back_on_every_path(gw):
    world = gw
    """Defence holds: refusals, unknown models, not-ready adapters, node failures and streams all let go of the slot."""
    from serving.gateway.upstream import UpstreamError

    tenant = world.tenant_a.tenant.id
    assert complete(world, world.token, n=100).status == 400
    assert complete(world, world.token, model="nothing-here").status == 404
    assert complete(world, world.token, model="support-bot@r2").status in (404, 503)
    assert complete(world, world.token, stream=True).status == 200
    world.vllm.failure = UpstreamError("boom")
    assert complete(world, world.token).status == 502
    assert world.state.inflight_cap.live(tenant) == 0
