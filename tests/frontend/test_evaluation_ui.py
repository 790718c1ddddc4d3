"""The evaluation gate on the dashboard: the suite and policy panel (upload, set), each revision's score with its
delta against live, the failing cases on a revision's page, the gate's verdict in the approve form and the
audited override; roles, tenants and pinned query counts."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test.utils import CaptureQueriesContext

from adapters.models import Adapter, AdapterRevision, Evaluation, EvaluationSuite
from tenants.models import AuditEvent
from tests.frontend.conftest import fill, page_client

pytestmark = pytest.mark.django_db

PAGE = "/adapters/support-bot/"
CASES = [
    {"prompt": "2+2=", "reference": "4", "grader": "exact"},
    {"prompt": "Capital of France?", "reference": "Paris", "grader": "contains", "name": "capital"},
]


def _suite(adapter: Adapter, version: int = 1) -> EvaluationSuite:
    return EvaluationSuite.objects.create(adapter=adapter, version=version, cases=CASES, case_count=len(CASES))


def _evaluate(revision: AdapterRevision, suite: EvaluationSuite, *, score: float, baseline=None, **fields):
    results = [
        {"case": 1, "passed": score >= 0.5, "score": 1.0 if score >= 0.5 else 0.0, "answer": "4"},
        {"case": 2, "passed": score >= 1.0, "score": 1.0 if score >= 1.0 else 0.0, "answer": "Lyon", "name": "capital"},
    ]
    return Evaluation.objects.create(
        revision=revision,
        suite=suite,
        state=fields.pop("state", "passed"),
        score=score,
        cases_passed=sum(r["passed"] for r in results),
        case_count=2,
        case_results=results,
        baseline_revision=baseline,
        baseline_score=1.0 if baseline is not None else None,
        **fields,
    )


@pytest.fixture
def gated(catalog_a) -> EvaluationSuite:
    """Suite v1 with no regression on; r2 (live) scored 1.0, r1 (pending) scored 0.5 against it: refused."""
    adapter = catalog_a.adapter
    Adapter.objects.filter(id=adapter.id).update(evaluation_no_regression=True)
    suite = _suite(adapter)
    _evaluate(catalog_a.approved, suite, score=1.0)
    _evaluate(
        catalog_a.pending,
        suite,
        score=0.5,
        baseline=catalog_a.approved,
        state="failed",
        reason="score 0.500 is below the live revision's 1.000 (no regression)",
    )
    return suite


def test_the_panel_names_the_suite_and_the_policy(gated, as_role):
    content = as_role("viewer").get(PAGE).content.decode()
    assert "suite v1, 2 cases, gating approval" in content
    assert "<strong>no regression</strong> against the live revision" in content
    assert 'data-action="upload-suite"' not in content and 'data-action="set-policy"' not in content
    developer = as_role("developer").get(PAGE).content.decode()
    assert 'data-action="upload-suite"' in developer and 'data-action="set-policy"' not in developer
    assert 'data-action="set-policy"' in as_role("approver").get(PAGE).content.decode()


def test_each_revision_shows_its_score_and_the_delta_against_live(gated, as_role):
    content = as_role("viewer").get(PAGE).content.decode()
    r1 = content.split('id="r1"')[1].split("</article>")[0]
    assert 'data-evaluation="failed"' in r1 and "score <strong data-score>0.500</strong> (1 of 2 cases" in r1
    assert "<span data-delta>-0.500</span> against live r2 (1.000)" in r1
    assert "below the live revision" in r1 and "See the failing cases" in r1
    r2 = content.split('id="r2"')[1].split("</article>")[0]
    assert 'data-evaluation="passed"' in r2 and "data-delta" not in r2


def test_the_revision_page_lists_only_the_failing_cases(gated, as_role):
    def table(role: str) -> str:
        content = as_role(role).get(f"{PAGE}revisions/1/").content.decode()
        return content.split('class="grid failing-cases"')[1].split("</table>")[0]

    developer = table("developer")
    assert 'data-case="2"' in developer and "capital" in developer and "<code>Lyon</code>" in developer
    assert 'data-case="1"' not in developer
    # A viewer, who may not sample the unapproved revision, sees the case but not what it answered.
    viewer = table("viewer")
    assert 'data-case="2"' in viewer and "capital" in viewer and "Lyon" not in viewer


def test_the_approve_form_shows_the_verdict_and_asks_for_an_override(gated, as_role):
    content = as_role("approver").get(f"{PAGE}revisions/1/").content.decode()
    assert 'data-verdict="evaluation_failed"' in content and 'name="override_reason"' in content
    assert 'name="override_reason"' not in as_role("approver").get(f"{PAGE}revisions/2/").content.decode()


def test_approving_without_an_override_is_refused_with_the_reason(gated, catalog_a, as_role):
    response = as_role("approver").post(f"{PAGE}revisions/1/approve/", {"comment": "ship"}, follow=True)
    assert "fails the policy: score 0.500 is below the live revision" in response.content.decode()
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "pending_approval"


def test_an_override_approves_and_is_audited(gated, catalog_a, as_role):
    response = as_role("approver").post(
        f"{PAGE}revisions/1/approve/", {"comment": "ship", "override_reason": "the capital case is wrong"}, follow=True
    )
    assert "r1 of support-bot approved." in response.content.decode()
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "approved"
    event = AuditEvent.objects.get(action="revision.approve", target__endswith="r1")
    assert event.after["override_reason"] == "the capital case is wrong"
    assert event.after["evaluation"]["verdict"] == "evaluation_failed"


def test_a_pending_evaluation_is_shown_and_gates_too(catalog_a, as_role):
    Adapter.objects.filter(id=catalog_a.adapter.id).update(evaluation_min_score=0.8)
    suite = _suite(catalog_a.adapter)
    Evaluation.objects.create(revision=catalog_a.pending, suite=suite, state="running")
    content = as_role("approver").get(f"{PAGE}revisions/1/").content.decode()
    assert 'data-evaluation="running"' in content and 'data-verdict="evaluation_pending"' in content
    assert "a score of at least <strong>0.800</strong>" in as_role("approver").get(PAGE).content.decode()


def test_a_suite_without_a_policy_scores_but_does_not_gate(catalog_a, as_role):
    suite = _suite(catalog_a.adapter)
    _evaluate(catalog_a.pending, suite, score=0.5, state="passed")
    content = as_role("approver").get(f"{PAGE}revisions/1/").content.decode()
    assert 'data-evaluation="passed"' in content and "data-verdict" not in content
    assert "no policy: scores are shown, approval is not gated" in as_role("approver").get(PAGE).content.decode()


def _jsonl(cases) -> SimpleUploadedFile:
    body = "\n".join(json.dumps(c) for c in cases).encode()
    return SimpleUploadedFile("suite.jsonl", body, content_type="application/jsonl")


def test_a_developer_uploads_the_next_suite(catalog_a, as_role):
    _suite(catalog_a.adapter)
    response = as_role("developer").post(f"{PAGE}evaluation-suite/", {"file": _jsonl(CASES)}, follow=True)
    assert "Suite v2 uploaded (2 cases)" in response.content.decode()
    assert EvaluationSuite.objects.filter(adapter=catalog_a.adapter).count() == 2


def test_a_bad_line_is_named_and_nothing_is_stored(catalog_a, as_role):
    bad = [CASES[0], {"prompt": "x", "reference": "(a)\\1", "grader": "regex"}]
    response = as_role("developer").post(f"{PAGE}evaluation-suite/", {"file": _jsonl(bad)}, follow=True)
    assert "line 2" in response.content.decode()
    assert not EvaluationSuite.objects.filter(adapter=catalog_a.adapter).exists()


def test_a_suite_over_the_size_limit_is_refused(catalog_a, as_role, settings):
    settings.MINT_EVALUATION_MAX_SUITE_BYTES = 64
    response = as_role("developer").post(f"{PAGE}evaluation-suite/", {"file": _jsonl(CASES)}, follow=True)
    assert "over MINT_EVALUATION_MAX_SUITE_BYTES=64" in response.content.decode()
    assert not EvaluationSuite.objects.exists()


def test_viewers_cannot_upload_and_developers_cannot_set_the_policy(catalog_a, as_role):
    assert as_role("viewer").post(f"{PAGE}evaluation-suite/", {"file": _jsonl(CASES)}).status_code == 403
    assert as_role("developer").post(f"{PAGE}evaluation-policy/", {"min_score": "0.9"}).status_code == 403
    adapter = Adapter.objects.get(id=catalog_a.adapter.id)
    assert adapter.evaluation_min_score is None and not EvaluationSuite.objects.exists()


def test_an_approver_sets_the_policy_audited(catalog_a, as_role):
    response = as_role("approver").post(
        f"{PAGE}evaluation-policy/", {"min_score": "0.75", "no_regression": "on"}, follow=True
    )
    assert "Evaluation policy saved." in response.content.decode()
    adapter = Adapter.objects.get(id=catalog_a.adapter.id)
    assert adapter.evaluation_min_score == 0.75 and adapter.evaluation_no_regression
    assert AuditEvent.objects.get(action="adapter.evaluation_policy").after == {
        "min_score": 0.75,
        "no_regression": True,
    }


def test_a_score_outside_0_to_1_is_named(catalog_a, as_role):
    response = as_role("approver").post(f"{PAGE}evaluation-policy/", {"min_score": "1.5"}, follow=True)
    assert "Minimum score" in response.content.decode()
    assert Adapter.objects.get(id=catalog_a.adapter.id).evaluation_min_score is None


def test_another_tenant_cannot_upload_or_set_the_policy(catalog_a, tenant_b, as_role):
    outsider = page_client(tenant_b.users["owner"])
    assert outsider.post(f"{PAGE}evaluation-suite/", {"file": _jsonl(CASES)}).status_code == 404
    assert outsider.post(f"{PAGE}evaluation-policy/", {"min_score": "0.9"}).status_code == 404
    assert not EvaluationSuite.objects.exists()
    assert Adapter.objects.get(id=catalog_a.adapter.id).evaluation_min_score is None


@pytest.mark.parametrize("url", [PAGE, f"{PAGE}?fragment=revisions", f"{PAGE}revisions/1/"])
def test_evaluations_cost_one_query_whatever_the_rows(tenant_a, adapter_a, node, url, django_assert_num_queries):
    catalog = fill(tenant_a, adapter_a, node, extra=12)
    suite = _suite(adapter_a)
    Adapter.objects.filter(id=adapter_a.id).update(evaluation_min_score=0.5)
    for rev in AdapterRevision.objects.filter(adapter=adapter_a):
        _evaluate(rev, suite, score=0.5, baseline=catalog.approved)
    client = page_client(tenant_a.users["owner"])
    client.get("/")
    with django_assert_num_queries(3 + 3 + 4 + 1):  # the page's reads (test_page_queries.py) and the evaluations
        assert client.get(url).status_code == 200


def test_the_revisions_section_refreshes_on_evaluation_events(catalog_a, as_role):
    content = as_role("viewer").get(PAGE).content.decode()
    section = content.split('data-fragment="revisions"')[1].split(">")[0]
    assert "evaluation.state" in section


def test_a_page_with_evaluations_needs_no_query_per_revision(tenant_a, adapter_a, node):
    from django.db import connection

    fill(tenant_a, adapter_a, node)
    suite = _suite(adapter_a)
    client = page_client(tenant_a.users["owner"])
    client.get("/")
    counts = []
    for first in (100, 110):  # one pending revision more, then ten
        for n in range(first, first + (1 if first == 100 else 10)):
            rev = AdapterRevision.objects.create(adapter=adapter_a, number=n, state="pending_approval", source_uri="x")
            _evaluate(rev, suite, score=0.5)
        with CaptureQueriesContext(connection) as queries:
            assert client.get(PAGE).status_code == 200
        counts.append(len(queries))
    assert counts[0] == counts[1], counts
