"""The evaluation runner (serving): speculative placement, the node side with a faked vLLM, the baseline of
the live revision, metering, release, turns per tenant, and the ways it ends unavailable."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision, Evaluation, EvaluationSuite
from adapters.services.evaluation import evaluation_finish, evaluation_request, evaluation_start, evaluation_unavailable
from adapters.signals import evaluation_requested
from serving.models import Alias, Placement, Priority, UsageKind, UsageRecord, lora_name
from serving.services import capacity, evaluation, placement
from tests.serving.conftest import place
from tests.serving.sent_tasks import NODE_TASKS, recorded, sent_of

pytestmark = pytest.mark.django_db

CASES = [
    {"prompt": "one", "reference": "A", "grader": "exact"},
    {"prompt": "two", "reference": "B", "grader": "exact", "max_tokens": 500},
    {"messages": [{"role": "user", "content": "three"}], "reference": "C", "grader": "contains"},
]


@pytest.fixture(autouse=True)
def quiet_tasks():
    """Tasks recorded, not run: each test drives the runner's steps itself."""
    with recorded("evaluation_run", "evaluation_cases", *NODE_TASKS) as sent:
        yield sent


@pytest.fixture
def engine():
    """vLLM faked: the live revision answers every reference; the candidate gets case two wrong."""
    with mock.patch("serving.services.evaluation.VllmClient") as factory:
        client = factory.return_value.__enter__.return_value
        answers = {}

        def generate(model, *, prompt=None, messages=None, max_tokens, timeout, priority=None):
            text = prompt or messages[0]["content"]
            return answers[model][text], {"prompt_tokens": 3, "completion_tokens": 1}

        client.generate.side_effect = generate
        client.requests_in_flight.return_value = 0  # the node runs no one else's requests
        client.answers = answers
        yield client


@pytest.fixture
def world(adapter_a, node, engine):
    suite = EvaluationSuite.objects.create(adapter=adapter_a, version=1, cases=CASES, case_count=len(CASES))
    live = AdapterRevision.objects.create(
        adapter=adapter_a, number=1, state="approved", source_uri="x", export_uri="e1"
    )
    candidate = AdapterRevision.objects.create(
        adapter=adapter_a, number=2, state="exported", source_uri="x", export_uri="e2"
    )
    Alias.objects.create(adapter=adapter_a, name="production", revision=live, reserved=True)
    place(node, live, "ready", priority=Priority.ACTIVATION)
    engine.answers[lora_name(live)] = {"one": "A", "two": "B", "three": "xCx"}
    engine.answers[lora_name(candidate)] = {"one": " A\n", "two": "nope", "three": "C"}
    adapter_a.evaluation_no_regression = True
    adapter_a.save()
    return suite, live, candidate


def requested(revision, suite) -> Evaluation:
    return evaluation_request(revision=revision, suite=suite, notify=False)


def run_to_the_end(evaluation_id: int, node) -> str:
    """Step the runner as the workers would: ask for a placement, see it ready, run the cases."""
    assert evaluation.evaluation_run(evaluation_id=evaluation_id) == "waits for a placement"
    spec = Placement.objects.get(id=Evaluation.objects.get(id=evaluation_id).runner["placement_id"])
    assert (spec.priority, spec.state, spec.node_id) == (Priority.SPECULATIVE, "queued", node.id)
    Placement.objects.filter(id=spec.id).update(state="ready", ready_at=timezone.now())
    assert evaluation.evaluation_run(evaluation_id=evaluation_id) == "sent to the node"
    return evaluation.evaluation_cases(evaluation_id=evaluation_id, placement_id=spec.id)


def test_a_worse_candidate_fails_against_the_live_baseline(world, node, engine, quiet_tasks):
    suite, live, candidate = world
    ev = requested(candidate, suite)
    assert run_to_the_end(ev.id, node) == "finished"
    ev.refresh_from_db()
    assert ev.state == "failed"
    assert ev.score == pytest.approx(2 / 3) and ev.cases_passed == 2
    assert [c["passed"] for c in ev.case_results] == [True, False, True]
    assert ev.case_results[1]["answer"] == "nope"
    assert (ev.baseline_revision_id, ev.baseline_score) == (live.id, 1.0)
    assert "below the live revision's 1.000" in ev.reason
    # The live revision was scored on the same suite, and is kept for the next candidate.
    baseline = Evaluation.objects.get(revision=live, suite=suite)
    assert (baseline.state, baseline.score) == ("passed", 1.0)
    # The node was asked with greedy decoding, max_tokens capped by the plan (128) and the default (32).
    calls = [c.kwargs for c in engine.generate.call_args_list]
    assert [c["max_tokens"] for c in calls[:3]] == [32, 128, 32]
    assert calls[2]["messages"] == [{"role": "user", "content": "three"}] and calls[2]["prompt"] is None
    # Metered as MinT's own evaluation traffic, per revision: never inference.
    rows = UsageRecord.objects.filter(period="minute")
    assert {(r.kind, r.revision, r.requests, r.prompt_tokens) for r in rows} == {
        (UsageKind.EVALUATION, 1, 3, 9),
        (UsageKind.EVALUATION, 2, 3, 9),
    }
    # The borrowed slot is given back; the live placement is untouched.
    spec = Placement.objects.get(id=ev.runner["placement_id"])
    assert spec.state == "evicting"
    assert Placement.objects.get(revision=live).state == "ready"


def test_a_finished_baseline_is_reused(world, node, engine):
    suite, live, candidate = world
    base = requested(live, suite)
    evaluation_start(evaluation=base)
    evaluation_finish(evaluation=base, case_results=[{"passed": True, "score": 0.25}])
    assert run_to_the_end(requested(candidate, suite).id, node) == "finished"
    ev = Evaluation.objects.get(revision=candidate)
    assert (ev.state, ev.baseline_score) == ("passed", 0.25)
    assert all(c.args[0] == lora_name(candidate) for c in engine.generate.call_args_list)


def test_the_slot_is_kept_when_the_revision_was_pinned_meanwhile(world, node):
    suite, _live, candidate = world
    ev = requested(candidate, suite)
    evaluation.evaluation_run(evaluation_id=ev.id)
    spec_id = Evaluation.objects.get(id=ev.id).runner["placement_id"]
    Placement.objects.filter(id=spec_id).update(state="ready")
    Alias.objects.create(adapter=candidate.adapter, name="candidate", revision=candidate, reserved=True)
    evaluation.evaluation_run(evaluation_id=ev.id)
    evaluation.evaluation_cases(evaluation_id=ev.id, placement_id=spec_id)
    assert Placement.objects.get(id=spec_id).state == "ready"


def test_an_already_ready_revision_is_evaluated_where_it_is(world, node):
    suite, _live, candidate = world
    existing = place(node, candidate, "ready", priority=Priority.COLD_REQUEST)
    ev = requested(candidate, suite)
    assert evaluation.evaluation_run(evaluation_id=ev.id) == "sent to the node"
    assert evaluation.evaluation_cases(evaluation_id=ev.id, placement_id=existing.id) == "finished"
    assert Placement.objects.get(id=existing.id).state == "ready"  # not the runner's to release


def test_one_evaluation_per_tenant_runs_at_a_time(world, node, quiet_tasks):
    suite, _live, candidate = world
    other = AdapterRevision.objects.create(
        adapter=candidate.adapter, number=3, state="exported", source_uri="x", export_uri="e3"
    )
    first, second = requested(candidate, suite), requested(other, suite)
    assert evaluation.evaluation_run(evaluation_id=first.id) == "waits for a placement"
    assert evaluation.evaluation_run(evaluation_id=second.id) == "waits for its turn"
    assert Placement.objects.filter(priority=Priority.SPECULATIVE).count() == 1
    evaluation_unavailable(evaluation=Evaluation.objects.get(id=first.id), reason="test")
    quiet_tasks.reset_mock()
    evaluation.evaluation_next(tenant_id=candidate.adapter.tenant_id)
    assert evaluation.evaluation_run(evaluation_id=second.id) == "waits for a placement"


def test_no_node_that_can_load_it_is_unavailable(world, node):
    suite, _live, candidate = world
    AdapterRevision.objects.filter(id=candidate.id).update(policy_record={"engine_flags": ["--enable-moe-magic"]})
    candidate.refresh_from_db()
    ev = requested(candidate, suite)
    assert evaluation.evaluation_run(evaluation_id=ev.id) == "no node"
    ev.refresh_from_db()
    assert ev.state == "unavailable"
    assert "no node of test-dense can load r2" in ev.reason


def test_a_placement_that_fails_every_attempt_is_unavailable(world, node):
    suite, _live, candidate = world
    ev = requested(candidate, suite)
    evaluation.evaluation_run(evaluation_id=ev.id)
    spec_id = Evaluation.objects.get(id=ev.id).runner["placement_id"]
    Placement.objects.filter(id=spec_id).update(state="failed", failure_reason="triton: MoE LoRA needs a GPU")
    assert evaluation.evaluation_run(evaluation_id=ev.id) == "placement failed"
    ev.refresh_from_db()
    assert ev.state == "unavailable" and "triton: MoE LoRA needs a GPU" in ev.reason
    assert not Placement.objects.filter(id=spec_id).exists()  # its row is withdrawn


def test_the_time_limit_makes_it_unavailable(world, node, settings):
    suite, _live, candidate = world
    ev = requested(candidate, suite)
    evaluation.evaluation_run(evaluation_id=ev.id)
    Evaluation.objects.filter(id=ev.id).update(started_at=timezone.now() - timedelta(seconds=601))
    assert evaluation.evaluation_run(evaluation_id=ev.id) == "timed out"
    ev.refresh_from_db()
    assert ev.state == "unavailable" and "MINT_EVALUATION_TIMEOUT_S=600" in ev.reason


def test_a_node_error_makes_it_unavailable(world, node, engine):
    from serving.vllm import VllmError

    suite, _live, candidate = world
    engine.generate.side_effect = VllmError("connection refused", transient=True)
    assert run_to_the_end(requested(candidate, suite).id, node) == "failed to run"
    ev = Evaluation.objects.get(revision=candidate)
    assert ev.state == "unavailable" and "connection refused" in ev.reason


def test_the_signal_queues_the_runner(quiet_tasks):
    evaluation_requested.send(sender=Evaluation, evaluation_id=42)
    quiet_tasks.assert_called_once_with("evaluation_run", evaluation_id=42)


# ---------------------------------------------------------------- speculative placement


def _fill(node, tenant_world, dense_base, count: int, *, priority=Priority.COLD_REQUEST) -> list[Placement]:
    adapter = Adapter.objects.create(tenant=tenant_world.tenant, name=f"filler-{count}", base_model=dense_base)
    rows = []
    for n in range(1, count + 1):
        revision = AdapterRevision.objects.create(adapter=adapter, number=n, state="approved", source_uri="x")
        # Used a minute ago: in use recently, but not within MINT_RESIDENCY_MIN_RESIDENT_S (not busy).
        rows.append(
            place(node, revision, "ready", priority=priority, last_used_at=timezone.now() - timedelta(minutes=1))
        )
    return rows


def test_speculative_never_evicts_where_a_cold_request_would(node, adapter_a, tenant_b, dense_base):
    fillers = _fill(node, tenant_b, dense_base, node.cpu_slots)
    revision = AdapterRevision.objects.create(adapter=adapter_a, number=9, state="exported", source_uri="x")
    assert placement.placement_request(revision=revision, priority=Priority.SPECULATIVE) is None
    assert set(Placement.objects.filter(id__in=[p.id for p in fillers]).values_list("state", flat=True)) == {"ready"}
    # The same request as a cold one takes the least recently used slot: the difference is the point.
    assert placement.placement_request(revision=revision, priority=Priority.COLD_REQUEST) is not None
    assert Placement.objects.filter(state="evicting").count() == 1


def test_speculative_placements_are_the_first_victims(node, adapter_a, tenant_b, dense_base):
    older = _fill(node, tenant_b, dense_base, node.cpu_slots - 1)
    Placement.objects.filter(id__in=[p.id for p in older]).update(last_used_at=timezone.now() - timedelta(hours=1))
    revision = AdapterRevision.objects.create(adapter=adapter_a, number=9, state="exported", source_uri="x")
    spec = place(node, revision, "ready", priority=Priority.SPECULATIVE, last_used_at=timezone.now())
    victim = placement.eviction_victim(node, protected=set())
    assert victim.id == spec.id


def test_speculative_placements_are_not_counted_in_the_serving_quota(node, adapter_a, dense_base):
    revision = AdapterRevision.objects.create(adapter=adapter_a, number=9, state="exported", source_uri="x")
    place(node, revision, "ready", priority=Priority.SPECULATIVE)
    tenant_id = adapter_a.tenant_id
    assert capacity.tenant_unpinned_count(tenant_id=tenant_id, base_model_id=dense_base.id, pins={}) == 0
    other = AdapterRevision.objects.create(adapter=adapter_a, number=10, state="approved", source_uri="x")
    place(node, other, "ready", priority=Priority.COLD_REQUEST)
    assert capacity.tenant_unpinned_count(tenant_id=tenant_id, base_model_id=dense_base.id, pins={}) == 1


def test_releasing_withdraws_a_queued_one_and_leaves_a_raised_one(node, adapter_a):
    revision = AdapterRevision.objects.create(adapter=adapter_a, number=9, state="exported", source_uri="x")
    queued = place(node, revision, "queued", priority=Priority.SPECULATIVE)
    assert placement.placement_release_speculative(placement_id=queued.id)
    assert not Placement.objects.filter(id=queued.id).exists()
    raised = place(node, revision, "ready", priority=Priority.COLD_REQUEST)
    assert not placement.placement_release_speculative(placement_id=raised.id)
    assert Placement.objects.get(id=raised.id).state == "ready"


def test_the_sweep_ends_overdue_runs_and_starts_forgotten_ones(
    world, node, quiet_tasks, django_capture_on_commit_callbacks
):
    suite, _live, candidate = world
    other = AdapterRevision.objects.create(
        adapter=candidate.adapter, number=3, state="exported", source_uri="x", export_uri="e3"
    )
    stuck, forgotten = requested(candidate, suite), requested(other, suite)
    evaluation.evaluation_run(evaluation_id=stuck.id)
    Evaluation.objects.filter(id=stuck.id).update(started_at=timezone.now() - timedelta(hours=1))
    quiet_tasks.reset_mock()
    with django_capture_on_commit_callbacks(execute=True):
        assert evaluation.evaluations_sweep() == {"overdue": 1, "started": 1}
    assert Evaluation.objects.get(id=stuck.id).state == "unavailable"
    assert sent_of(quiet_tasks, "evaluation_run")[-1] == {"countdown": 0, "evaluation_id": forgotten.id}
    assert evaluation.evaluation_run(evaluation_id=forgotten.id) == "waits for a placement"
    assert evaluation.evaluations_sweep() == {"overdue": 0, "started": 0}


def test_the_node_agent_runs_a_slice_at_a_time_and_queues_the_rest(world, node, engine, quiet_tasks, settings):
    """With a budget that one case uses up, each task runs one case (the candidate's three, then the live
    revision's three for the baseline) and queues the next slice on the node's queue, behind other work."""
    settings.MINT_EVALUATION_SLICE_S = 0
    suite, live, candidate = world
    ev = requested(candidate, suite)
    assert run_to_the_end(ev.id, node) == "sliced"
    spec_id = Evaluation.objects.get(id=ev.id).runner["placement_id"]
    steps = 0
    while True:
        kwargs = sent_of(quiet_tasks, "evaluation_cases")[-1]
        queue = kwargs.pop("queue")
        kwargs.pop("countdown")
        assert queue == node.queue and kwargs["placement_id"] == spec_id
        steps += 1
        assert kwargs["step"] == steps
        # A copy of the slice just run (a redelivered task) does nothing.
        stale = evaluation.evaluation_cases(evaluation_id=ev.id, placement_id=spec_id, step=steps - 1)
        assert stale == "an earlier slice's copy"
        done = evaluation.evaluation_cases(**kwargs)
        if done != "sliced":
            break
    assert done == "finished" and steps == 5  # six tasks (the first and five queued), one case each
    ev.refresh_from_db()
    assert ev.state == "failed" and [c["passed"] for c in ev.case_results] == [True, False, True]
    assert [c["case"] for c in ev.case_results] == [1, 2, 3]
    assert (ev.baseline_revision_id, ev.baseline_score) == (live.id, 1.0)
    assert engine.generate.call_count == 6  # every case asked once, whatever the slicing
    rows = UsageRecord.objects.filter(period="minute")
    assert sorted((r.revision, r.requests) for r in rows) == [(1, 3), (2, 3)]


def test_a_queued_speculative_placement_gives_its_slot_to_an_activation(node, adapter_a, tenant_b, dense_base):
    """An evaluation's placement that is only queued (nothing loaded) holds no slot anyone else needs."""
    _fill(node, tenant_b, dense_base, node.cpu_slots - 1)
    evaluated = AdapterRevision.objects.create(adapter=adapter_a, number=9, state="exported", source_uri="x")
    borrowed = place(node, evaluated, "queued", priority=Priority.SPECULATIVE)
    other = Adapter.objects.create(tenant=tenant_b.tenant, name="wanted", base_model=dense_base)
    wanted = AdapterRevision.objects.create(adapter=other, number=1, state="approved", source_uri="x")
    Alias.objects.create(adapter=other, name="production", desired_revision=wanted)  # pinned: an activation
    got = placement.placement_request(revision=wanted, priority=Priority.ACTIVATION)
    assert got is not None and got.node_id == node.id and got.state == "queued"
    assert not Placement.objects.filter(id=borrowed.id).exists()
    assert Placement.objects.filter(state="evicting").count() == 0  # nothing had to be unloaded


def test_a_cold_request_over_its_quota_takes_only_its_own_borrowed_slot(node, adapter_a, tenant_b, dense_base):
    _fill(node, tenant_b, dense_base, node.cpu_slots - 1)
    evaluated = AdapterRevision.objects.create(adapter=adapter_a, number=9, state="exported", source_uri="x")
    borrowed = place(node, evaluated, "queued", priority=Priority.SPECULATIVE)
    tenant_b.tenant.max_ready_revisions = 1
    tenant_b.tenant.save(update_fields=["max_ready_revisions"])
    other = Adapter.objects.create(tenant=tenant_b.tenant, name="cold", base_model=dense_base)
    cold = AdapterRevision.objects.create(adapter=other, number=1, state="approved", source_uri="x")
    # Tenant B is over its unpinned quota: only its own placements may make room, not A's evaluation.
    assert placement.placement_request(revision=cold, priority=Priority.COLD_REQUEST).node_id == node.id
    assert Placement.objects.filter(id=borrowed.id).exists()
    assert Placement.objects.filter(state="evicting", revision__adapter__tenant=tenant_b.tenant).count() == 1
