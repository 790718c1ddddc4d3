"""The evaluation gate: the policy API, evaluation states, approve refused (409) or overridden (audited),
the evaluation API, and tenancy."""

from __future__ import annotations

import pytest

from adapters.models import AdapterRevision, Evaluation, EvaluationSuite
from adapters.services.evaluation import evaluation_finish, evaluation_request, evaluation_start, evaluation_unavailable
from adapters.signals import evaluation_requested
from tenants.models import AuditEvent
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

BASE = "/api/v1/adapters/support-bot"
CASES = [{"prompt": "a", "reference": "x", "grader": "exact"}, {"prompt": "b", "reference": "y", "grader": "exact"}]


def suite_of(adapter, version: int = 1) -> EvaluationSuite:
    return EvaluationSuite.objects.create(adapter=adapter, version=version, cases=CASES, case_count=2)


def pending(adapter, world, number: int = 1) -> AdapterRevision:
    return AdapterRevision.objects.create(
        adapter=adapter,
        number=number,
        state="pending_approval",
        source_uri="x",
        created_by=world.users["developer"],
    )


def policy(adapter, *, min_score=None, no_regression=False):
    adapter.evaluation_min_score, adapter.evaluation_no_regression = min_score, no_regression
    adapter.save()


def finished(revision, suite, *, results, baseline=None, baseline_score=None) -> Evaluation:
    evaluation = evaluation_request(revision=revision, suite=suite)
    evaluation_start(evaluation=evaluation)
    return evaluation_finish(
        evaluation=evaluation, case_results=results, baseline_revision=baseline, baseline_score=baseline_score
    )


def approve(world, number: int = 1, **body):
    return world.client_as("approver").post(f"{BASE}/revisions/{number}/approve/", body, format="json")


ONE_OF_TWO = [{"passed": True, "score": 1.0}, {"passed": False, "score": 0.0}]
BOTH = [{"passed": True, "score": 1.0}, {"passed": True, "score": 1.0}]


def test_without_a_policy_or_a_suite_approve_is_not_gated(tenant_a, adapter_a):
    pending(adapter_a, tenant_a)
    suite_of(adapter_a)  # a suite but no policy
    assert approve(tenant_a).status_code == 200


def test_a_policy_without_a_suite_does_not_gate(tenant_a, adapter_a):
    pending(adapter_a, tenant_a)
    policy(adapter_a, min_score=0.9)
    assert approve(tenant_a).status_code == 200


@pytest.mark.parametrize("started", [False, True])
def test_no_evaluation_or_a_running_one_is_pending(tenant_a, adapter_a, started):
    revision = pending(adapter_a, tenant_a)
    suite = suite_of(adapter_a)
    policy(adapter_a, min_score=0.5)
    if started:
        evaluation_start(evaluation=evaluation_request(revision=revision, suite=suite))
    response = approve(tenant_a)
    assert response.status_code == 409
    assert error_of(response)["code"] == "evaluation_pending"
    revision.refresh_from_db()
    assert revision.state == "pending_approval"


def test_an_unavailable_evaluation_refuses_with_its_reason(tenant_a, adapter_a):
    revision = pending(adapter_a, tenant_a)
    suite = suite_of(adapter_a)
    policy(adapter_a, no_regression=True)
    evaluation = evaluation_request(revision=revision, suite=suite)
    evaluation_unavailable(evaluation=evaluation, reason="no node of test-dense can run it")
    response = approve(tenant_a)
    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "evaluation_unavailable"
    assert "no node of test-dense can run it" in error["message"]


def test_below_the_minimum_score_fails(tenant_a, adapter_a):
    revision = pending(adapter_a, tenant_a)
    policy(adapter_a, min_score=0.75)
    evaluation = finished(revision, suite_of(adapter_a), results=ONE_OF_TWO)
    assert (evaluation.state, evaluation.score, evaluation.cases_passed) == ("failed", 0.5, 1)
    response = approve(tenant_a)
    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "evaluation_failed"
    assert "below the adapter's minimum 0.750" in error["message"]
    assert error["detail"]["score"] == 0.5


def test_a_regression_against_the_live_revision_fails(tenant_a, adapter_a):
    live = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="approved", source_uri="x")
    pending(adapter_a, tenant_a, number=2)
    policy(adapter_a, no_regression=True)
    evaluation = finished(
        AdapterRevision.objects.get(number=2), suite_of(adapter_a), results=ONE_OF_TWO, baseline=live, baseline_score=1
    )
    assert evaluation.state == "failed"
    response = approve(tenant_a, number=2)
    assert response.status_code == 409
    assert error_of(response)["code"] == "evaluation_failed"
    assert "below the live revision's 1.000" in error_of(response)["message"]


def test_no_baseline_means_nothing_to_regress_from(tenant_a, adapter_a):
    revision = pending(adapter_a, tenant_a)
    policy(adapter_a, no_regression=True)
    finished(revision, suite_of(adapter_a), results=ONE_OF_TWO)
    assert approve(tenant_a).status_code == 200


def test_an_equal_score_is_no_regression(tenant_a, adapter_a):
    revision = pending(adapter_a, tenant_a)
    policy(adapter_a, no_regression=True, min_score=0.5)
    finished(revision, suite_of(adapter_a), results=ONE_OF_TWO, baseline_score=0.5)
    response = approve(tenant_a)
    assert response.status_code == 200
    event = AuditEvent.objects.get(action="revision.approve")
    assert event.after["evaluation"] == {
        "suite": 1,
        "state": "passed",
        "score": 0.5,
        "baseline_score": 0.5,
        "verdict": "passed",
    }
    assert "override_reason" not in event.after


def test_the_newest_suite_is_the_one_that_counts(tenant_a, adapter_a):
    revision = pending(adapter_a, tenant_a)
    policy(adapter_a, min_score=1.0)
    finished(revision, suite_of(adapter_a, 1), results=BOTH)
    suite_of(adapter_a, 2)
    assert error_of(approve(tenant_a))["code"] == "evaluation_pending"


def test_tightening_the_policy_after_the_run_applies_at_once(tenant_a, adapter_a):
    revision = pending(adapter_a, tenant_a)
    policy(adapter_a, min_score=0.5)
    assert finished(revision, suite_of(adapter_a), results=ONE_OF_TWO).state == "passed"
    policy(adapter_a, min_score=0.9)
    assert error_of(approve(tenant_a))["code"] == "evaluation_failed"


def test_an_override_reason_approves_and_is_audited(tenant_a, adapter_a):
    revision = pending(adapter_a, tenant_a)
    policy(adapter_a, min_score=0.9)
    finished(revision, suite_of(adapter_a), results=ONE_OF_TWO)
    assert error_of(approve(tenant_a, override_reason="   "))["code"] == "evaluation_failed"
    response = approve(tenant_a, comment="ship it", override_reason="the suite's case 2 is known wrong")
    assert response.status_code == 200, response.content
    revision.refresh_from_db()
    assert revision.state == "approved"
    event = AuditEvent.objects.get(action="revision.approve")
    assert event.actor_user == tenant_a.users["approver"]
    assert event.after["override_reason"] == "the suite's case 2 is known wrong"
    assert event.after["evaluation"]["score"] == 0.5
    assert event.after["evaluation"]["verdict"] == "evaluation_failed"


def test_four_eyes_and_state_come_before_the_gate(tenant_a, adapter_a):
    AdapterRevision.objects.create(
        adapter=adapter_a, number=1, state="pending_approval", source_uri="x", created_by=tenant_a.users["approver"]
    )
    AdapterRevision.objects.create(adapter=adapter_a, number=2, state="exported", source_uri="x")
    suite_of(adapter_a)
    policy(adapter_a, min_score=0.5)
    assert error_of(approve(tenant_a, number=1))["code"] == "four_eyes"
    assert approve(tenant_a, number=2).status_code == 409
    assert error_of(approve(tenant_a, number=2))["code"] == "invalid_transition"


def test_reject_is_never_gated(tenant_a, adapter_a):
    pending(adapter_a, tenant_a)
    suite_of(adapter_a)
    policy(adapter_a, min_score=0.5)
    response = tenant_a.client_as("approver").post(f"{BASE}/revisions/1/reject/", {"comment": "no"}, format="json")
    assert response.status_code == 200


# ---------------------------------------------------------------- evaluation states and events


def test_states_are_audited_and_sent_live(tenant_a, adapter_a, django_capture_on_commit_callbacks, monkeypatch):
    sent = []
    monkeypatch.setattr("adapters.services.evaluation.live_event", lambda **event: sent.append(event))
    revision = pending(adapter_a, tenant_a)
    requested = []

    def receiver(sender, evaluation_id, **kwargs):
        requested.append(evaluation_id)

    # Only this test's receiver: the serving runner (connected by serving's app) would run it at once.
    evaluation_requested.disconnect(dispatch_uid="serving.evaluation_runner")
    evaluation_requested.connect(receiver)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            evaluation = evaluation_request(revision=revision, suite=suite_of(adapter_a))
    finally:
        evaluation_requested.disconnect(receiver)
        from serving.services.evaluation import evaluation_requested as run_evaluation

        evaluation_requested.connect(run_evaluation, dispatch_uid="serving.evaluation_runner")
    assert requested == [evaluation.id]
    evaluation_start(evaluation=evaluation)
    evaluation_finish(evaluation=evaluation, case_results=BOTH)
    assert [(e["type"], e["state"], e["revision"], e["adapter"]) for e in sent] == [
        ("evaluation.state", "pending", "r1", "support-bot"),
        ("evaluation.state", "running", "r1", "support-bot"),
        ("evaluation.state", "passed", "r1", "support-bot"),
    ]
    assert sent[-1]["score"] == 1.0 and sent[-1]["id"] == evaluation.id
    actions = list(AuditEvent.objects.filter(action__startswith="evaluation.").values_list("action", flat=True))
    assert sorted(actions) == ["evaluation.passed", "evaluation.running"]


def test_a_finished_evaluation_cannot_be_started_again(tenant_a, adapter_a):
    evaluation = finished(pending(adapter_a, tenant_a), suite_of(adapter_a), results=BOTH)
    with pytest.raises(Exception) as caught:
        evaluation_start(evaluation=evaluation)
    assert "passed" in str(caught.value)


def test_export_requests_an_evaluation_on_the_newest_suite(tenant_a, adapter_a):
    from adapters.services.evaluation import evaluation_request_on_export

    revision = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="exported", source_uri="x")
    assert evaluation_request_on_export(revision=revision) is None
    suite_of(adapter_a, 1)
    newest = suite_of(adapter_a, 2)
    evaluation = evaluation_request_on_export(revision=revision)
    assert (evaluation.suite_id, evaluation.state, evaluation.case_count) == (newest.id, "pending", 2)


# ---------------------------------------------------------------- the policy and evaluation APIs


def test_policy_is_read_by_members_and_set_by_approvers(tenant_a, adapter_a):
    url = f"{BASE}/evaluation-policy/"
    assert tenant_a.client_as("viewer").get(url).json() == {"min_score": None, "no_regression": False}
    body = {"min_score": 0.8, "no_regression": True}
    assert tenant_a.client_as("developer").put(url, body, format="json").status_code == 403
    response = tenant_a.client_as("approver").put(url, body, format="json")
    assert response.status_code == 200 and response.json() == body
    adapter_a.refresh_from_db()
    assert (adapter_a.evaluation_min_score, adapter_a.evaluation_no_regression) == (0.8, True)
    event = AuditEvent.objects.get(action="adapter.evaluation_policy")
    assert event.before == {"min_score": None, "no_regression": False} and event.after == body
    bad = tenant_a.client_as("approver").put(url, {"min_score": 1.5}, format="json")
    assert bad.status_code == 400 and "min_score" in error_of(bad)["message"]


def test_a_misspelt_policy_field_is_400_and_keeps_the_policy(tenant_a, adapter_a):
    url = f"{BASE}/evaluation-policy/"
    approver = tenant_a.client_as("approver")
    assert approver.put(url, {"min_score": 0.8, "no_regression": True}, format="json").status_code == 200
    bad = approver.put(url, {"evaluation_no_regression": False}, format="json")
    assert bad.status_code == 400 and "evaluation_no_regression" in error_of(bad)["message"]
    adapter_a.refresh_from_db()
    assert (adapter_a.evaluation_min_score, adapter_a.evaluation_no_regression) == (0.8, True)


def test_the_evaluation_api_shows_score_baseline_delta_and_cases(tenant_a, adapter_a):
    live = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="approved", source_uri="x")
    revision = pending(adapter_a, tenant_a, number=2)
    results = [{"passed": True, "score": 1.0, "answer": "x"}, {"passed": False, "score": 0.0, "answer": "z"}]
    finished(revision, suite_of(adapter_a), results=results, baseline=live, baseline_score=1.0)
    body = tenant_a.client_as("developer").get(f"{BASE}/revisions/2/evaluation/").json()
    assert body["state"] == "passed" and body["score"] == 0.5
    assert body["baseline_revision"] == "r1" and body["delta"] == -0.5
    assert body["case_results"][1]["answer"] == "z"
    assert tenant_a.client_as("viewer").get(f"{BASE}/revisions/1/evaluation/").status_code == 404


@pytest.mark.parametrize(
    ("principal", "sees"),
    [("viewer", False), ("key:deploy", False), ("developer", True), ("key:pipeline", True), ("owner", True)],
)
def test_answers_of_an_unapproved_revision_go_only_to_callers_who_may_sample_it(tenant_a, adapter_a, principal, sees):
    """The decision (adapters.selectors.evaluation_answers_visible): an unapproved revision's answers are a sample
    of it, for those who may sample it; everyone who may read the catalog sees each case's verdict and score."""
    revision = pending(adapter_a, tenant_a)
    results = [{"case": 1, "passed": True, "score": 1.0, "answer": "secret-ish"}]
    finished(revision, suite_of(adapter_a), results=results)
    body = tenant_a.client_as(principal).get(f"{BASE}/revisions/1/evaluation/").json()
    assert body["case_results"][0]["passed"] is True and body["case_results"][0]["score"] == 1.0
    assert ("answer" in body["case_results"][0]) is sees
    assert (b"secret-ish" in tenant_a.client_as(principal).get(f"{BASE}/revisions/1/evaluation/").content) is sees


def test_an_approved_revisions_answers_are_every_readers(tenant_a, adapter_a):
    revision = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="approved", source_uri="x")
    finished(revision, suite_of(adapter_a), results=[{"case": 1, "passed": False, "score": 0.0, "answer": "z"}])
    for principal in ("viewer", "key:deploy"):
        body = tenant_a.client_as(principal).get(f"{BASE}/revisions/1/evaluation/").json()
        assert body["case_results"][0]["answer"] == "z"


def test_the_dashboard_shows_an_unapproved_revisions_answers_only_to_who_may_sample_it(tenant_a, adapter_a):
    from django.test import Client

    revision = pending(adapter_a, tenant_a)
    finished(revision, suite_of(adapter_a), results=[{"case": 1, "passed": False, "score": 0.0, "answer": "zq-xj"}])
    pages = {}
    for role in ("viewer", "developer"):
        client = Client()
        client.force_login(tenant_a.users[role])
        pages[role] = client.get(f"/adapters/{adapter_a.name}/revisions/1/").content
    assert b"zq-xj" in pages["developer"] and b"zq-xj" not in pages["viewer"]


def test_asking_again_resets_an_unavailable_evaluation(tenant_a, adapter_a):
    revision = pending(adapter_a, tenant_a)
    evaluation = evaluation_request(revision=revision, suite=suite_of(adapter_a))
    evaluation_unavailable(evaluation=evaluation, reason="time limit")
    assert tenant_a.client_as("viewer").post(f"{BASE}/revisions/1/evaluation/").status_code == 403
    response = tenant_a.client_as("developer").post(f"{BASE}/revisions/1/evaluation/")
    assert response.status_code == 202
    assert response.json()["state"] == "pending" and response.json()["reason"] == ""


def test_another_tenant_sees_no_evaluation_or_policy(tenant_a, tenant_b, adapter_a, adapter_b):
    revision = pending(adapter_a, tenant_a)
    finished(revision, suite_of(adapter_a), results=BOTH)
    intruder = tenant_b.client_as("owner")
    assert intruder.get(f"{BASE}/revisions/1/evaluation/").status_code == 404
    assert intruder.post(f"{BASE}/revisions/1/evaluation/").status_code == 404
    assert intruder.get(f"{BASE}/evaluation-policy/").status_code == 404
    assert intruder.put(f"{BASE}/evaluation-policy/", {"min_score": 0}, format="json").status_code == 404
    assert intruder.post(f"{BASE}/revisions/1/approve/", {"override_reason": "mine"}, format="json").status_code == 404
    adapter_a.refresh_from_db()
    assert adapter_a.evaluation_min_score is None
