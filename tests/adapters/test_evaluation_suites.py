"""Evaluation suites: the JSONL format and its graders, the upload API's bounds, versions, and tenancy."""

from __future__ import annotations

import json
import time

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from adapters.models import AdapterRevision, Evaluation, EvaluationSuite
from adapters.suites import SuiteError, SuiteLimits, grade, parse_suite
from tenants.models import AuditEvent
from tests.conftest import error_of

URL = "/api/v1/adapters/support-bot/evaluation-suites/"
LIMITS = SuiteLimits(
    max_cases=5, max_tokens=16, max_bytes=4096, max_line_bytes=512, max_pattern_bytes=64, regex_max_mem=1 << 20
)


def jsonl(*cases: dict) -> bytes:
    return "\n".join(json.dumps(c) for c in cases).encode()


def problem(body: bytes, limits: SuiteLimits = LIMITS) -> SuiteError:
    with pytest.raises(SuiteError) as caught:
        parse_suite(body, limits=limits)
    return caught.value


# ---------------------------------------------------------------- parsing


def test_every_grader_and_input_form_parses():
    cases = parse_suite(
        jsonl(
            {"prompt": "2+2=", "reference": "4", "grader": "exact", "max_tokens": 4},
            {"messages": [{"role": "user", "content": "hi"}], "reference": "hello", "grader": "contains"},
            {"prompt": "date", "reference": r"^\d{4}-\d{2}$", "grader": "regex"},
            {"prompt": "rate", "grader": "json_score", "field": "a.score", "reference": 0.7},
        )
        + b"\n\n",
        limits=LIMITS,
    )
    assert [c["grader"] for c in cases] == ["exact", "contains", "regex", "json_score"]
    assert cases[0]["max_tokens"] == 4 and cases[3]["reference"] == 0.7


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ({"prompt": "x", "reference": "y", "grader": "fuzzy"}, "grader must be one of"),
        ({"reference": "y", "grader": "exact"}, "exactly one of prompt"),
        ({"prompt": "x", "messages": [], "reference": "y", "grader": "exact"}, "exactly one of prompt"),
        ({"messages": [{"role": "robot", "content": "x"}], "reference": "y", "grader": "exact"}, "messages[0]"),
        ({"prompt": "x", "reference": 3, "grader": "contains"}, "contains needs reference"),
        ({"prompt": "x", "reference": "y", "grader": "exact", "max_tokens": 0}, "max_tokens must be"),
        ({"prompt": "x", "reference": "y", "grader": "exact", "temperature": 1}, "unknown field(s) temperature"),
        ({"prompt": "x", "grader": "json_score"}, "json_score needs field"),
        ({"prompt": "x", "grader": "json_score", "field": "s", "reference": 2}, "number in [0, 1]"),
        ({"prompt": "x", "reference": r"(a)\1", "grader": "regex"}, "RE2 refuses the pattern"),
        ({"prompt": "x", "reference": "(?=a)", "grader": "regex"}, "RE2 refuses the pattern"),
    ],
)
def test_a_bad_case_names_its_line_and_problem(case, needle):
    good = {"prompt": "p", "reference": "r", "grader": "exact"}
    error = problem(jsonl(good, case))
    assert error.line == 2
    assert error.message.startswith("line 2: ")
    assert needle in error.message


def test_not_json_names_the_line():
    error = problem(jsonl({"prompt": "p", "reference": "r", "grader": "exact"}) + b"\n{oops")
    assert (error.line, error.code) == (2, "invalid_suite")
    assert "not JSON" in error.message


def test_max_tokens_above_the_plan_is_refused():
    error = problem(jsonl({"prompt": "p", "reference": "r", "grader": "exact", "max_tokens": 17}))
    assert error.code == "evaluation_tokens_exceeded"
    assert "max_evaluation_tokens=16" in error.message


def test_more_cases_than_the_plan_is_refused_without_parsing_the_rest():
    line = json.dumps({"prompt": "p", "reference": "r", "grader": "exact"})
    body = "\n".join([line] * 5 + ["not json at all"] * 100).encode()
    error = problem(body, SuiteLimits(**{**LIMITS.__dict__, "max_bytes": 1 << 20}))
    assert (error.code, error.line) == ("evaluation_cases_exceeded", 6)


def test_size_bounds_line_bytes_suite_bytes_and_pattern_bytes():
    assert problem(b"x" * 5000).code == "suite_too_large"
    long_prompt = jsonl({"prompt": "p" * 600, "reference": "r", "grader": "exact"})
    assert problem(long_prompt).code == "suite_line_too_long"
    long_pattern = jsonl({"prompt": "p", "reference": "a" * 65, "grader": "regex"})
    assert "MINT_EVALUATION_MAX_PATTERN_BYTES=64" in problem(long_pattern).message
    assert problem(b"\n \n").message.startswith("the suite has no cases")
    assert "not UTF-8" in problem(b"\xff\xfe").message


# ---------------------------------------------------------------- grading


def test_graders_score_answers():
    mem = 1 << 20
    assert grade({"grader": "exact", "reference": " 4 "}, "4\n", regex_max_mem=mem) == (True, 1.0)
    assert grade({"grader": "exact", "reference": "4"}, "44", regex_max_mem=mem) == (False, 0.0)
    assert grade({"grader": "contains", "reference": "lo w"}, "hello world", regex_max_mem=mem) == (True, 1.0)
    assert grade({"grader": "regex", "reference": r"\d{3}"}, "ab123", regex_max_mem=mem) == (True, 1.0)
    assert grade({"grader": "regex", "reference": r"^\d+$"}, "ab123", regex_max_mem=mem) == (False, 0.0)
    case = {"grader": "json_score", "field": "r.s", "reference": 0.5}
    assert grade(case, '{"r": {"s": 0.8}}', regex_max_mem=mem) == (True, 0.8)
    assert grade(case, '{"r": {"s": 0.2}}', regex_max_mem=mem) == (False, 0.2)
    assert grade(case, '{"r": {"s": 7}}', regex_max_mem=mem) == (True, 1.0)  # clamped
    assert grade(case, "not json", regex_max_mem=mem) == (False, 0.0)
    assert grade(case, '{"r": {"s": true}}', regex_max_mem=mem) == (False, 0.0)
    assert grade(case, '{"r": {"s": NaN}}', regex_max_mem=mem) == (False, 0.0)


def test_a_regex_bomb_runs_in_linear_time():
    # Catastrophic for a backtracking engine (2^n steps on Python's re); RE2 answers at once.
    case = {"grader": "regex", "reference": "^(a+)+$"}
    started = time.perf_counter()
    passed, _ = grade(case, "a" * 50_000 + "!", regex_max_mem=1 << 20)
    assert not passed
    assert time.perf_counter() - started < 1.0


# ---------------------------------------------------------------- the upload API


@pytest.fixture
def suite_body() -> bytes:
    return jsonl(
        {"prompt": "Hello", "reference": "there", "grader": "contains"},
        {"prompt": "2+2=", "reference": "4", "grader": "exact", "max_tokens": 2},
    )


def post_jsonl(client, body: bytes, url: str = URL):
    return client.post(url, data=body, content_type="application/jsonl")


@pytest.mark.django_db
def test_upload_as_jsonl_or_multipart_makes_versions(tenant_a, adapter_a, suite_body):
    client = tenant_a.client_as("key:pipeline")
    first = post_jsonl(client, suite_body)
    assert first.status_code == 201, first.content
    assert first.json()["version"] == 1 and first.json()["case_count"] == 2
    second = client.post(URL, {"file": SimpleUploadedFile("suite.jsonl", suite_body)}, format="multipart")
    assert second.status_code == 201, second.content
    assert second.json()["version"] == 2
    listed = tenant_a.client_as("viewer").get(URL)
    assert listed.status_code == 200
    assert [s["version"] for s in listed.json()["results"]] == [2, 1]
    assert "cases" not in listed.json()["results"][0]
    detail = tenant_a.client_as("viewer").get(f"{URL}1/")
    assert detail.json()["cases"][1] == {"prompt": "2+2=", "reference": "4", "grader": "exact", "max_tokens": 2}
    event = AuditEvent.objects.get(action="evaluation_suite.upload", after__version=1)
    assert event.after == {"version": 1, "cases": 2, "bytes": len(suite_body), "dropped_versions": []}


@pytest.mark.django_db
def test_a_bad_line_is_a_400_naming_it_and_nothing_is_stored(tenant_a, adapter_a):
    body = jsonl({"prompt": "ok", "reference": "r", "grader": "exact"}, {"prompt": "x", "grader": "regex"})
    response = post_jsonl(tenant_a.client_as("developer"), body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "invalid_suite"
    assert error["message"].startswith("line 2: regex needs reference")
    assert error["detail"] == {"line": 2}
    assert not EvaluationSuite.objects.exists()


@pytest.mark.django_db
def test_plan_bounds_cases_and_tokens(tenant_a, adapter_a):
    tenant_a.tenant.max_evaluation_cases = 3
    tenant_a.tenant.max_evaluation_tokens = 8
    tenant_a.tenant.save()
    client = tenant_a.client_as("developer")
    case = {"prompt": "p", "reference": "r", "grader": "exact"}
    too_many = post_jsonl(client, jsonl(*[case] * 4))
    assert too_many.status_code == 400
    assert error_of(too_many)["code"] == "evaluation_cases_exceeded"
    too_long = post_jsonl(client, jsonl(case | {"max_tokens": 9}))
    assert error_of(too_long)["code"] == "evaluation_tokens_exceeded"
    assert not EvaluationSuite.objects.exists()


@pytest.mark.django_db
def test_a_body_over_the_byte_limit_is_refused(tenant_a, adapter_a, settings):
    settings.MINT_EVALUATION_MAX_SUITE_BYTES = 1024
    line = json.dumps({"prompt": "p" * 200, "reference": "r", "grader": "exact"})
    response = post_jsonl(tenant_a.client_as("developer"), "\n".join([line] * 6).encode())
    assert response.status_code == 413
    assert error_of(response)["code"] == "suite_too_large"
    huge = "\n".join([line] * 400).encode()  # past the multipart slack too: refused before the body is read
    assert post_jsonl(tenant_a.client_as("developer"), huge).status_code == 413
    assert not EvaluationSuite.objects.exists()


@pytest.mark.django_db
def test_viewers_cannot_upload(tenant_a, adapter_a, suite_body):
    assert post_jsonl(tenant_a.client_as("viewer"), suite_body).status_code == 403
    assert post_jsonl(tenant_a.client_as("key:inference"), suite_body).status_code == 403


@pytest.mark.django_db
def test_uploading_evaluates_revisions_awaiting_a_decision(tenant_a, adapter_a, suite_body):
    waiting = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="pending_approval", source_uri="x")
    AdapterRevision.objects.create(adapter=adapter_a, number=2, state="approved", source_uri="x")
    post_jsonl(tenant_a.client_as("developer"), suite_body)
    assert list(Evaluation.objects.values_list("revision_id", "state")) == [(waiting.id, "pending")]


@pytest.mark.django_db
def test_another_tenant_can_neither_read_nor_upload(tenant_a, tenant_b, adapter_a, adapter_b, suite_body):
    post_jsonl(tenant_a.client_as("developer"), suite_body)
    intruder = tenant_b.client_as("owner")
    assert intruder.get(URL).status_code == 404
    assert intruder.get(f"{URL}1/").status_code == 404
    assert post_jsonl(intruder, suite_body).status_code == 404
    assert tenant_b.client_as("key:pipeline").get(f"{URL}1/").status_code == 404
    assert tenant_a.client_as("outsider").get(URL).status_code in (403, 404)
    assert EvaluationSuite.objects.filter(adapter=adapter_a).count() == 1
    # B's own adapter has none; A's suite is not visible under B's adapter either.
    assert intruder.get("/api/v1/adapters/globex-secret-bot/evaluation-suites/").json()["results"] == []


@pytest.mark.django_db
def test_an_adapter_keeps_only_its_newest_versions(tenant_a, adapter_a, suite_body, settings):
    settings.MINT_EVALUATION_SUITE_VERSIONS_KEPT = 3
    client = tenant_a.client_as("key:pipeline")
    for _ in range(5):
        assert post_jsonl(client, suite_body).status_code == 201
    versions = sorted(EvaluationSuite.objects.filter(adapter=adapter_a).values_list("version", flat=True))
    assert versions == [3, 4, 5]  # numbering goes on: 6 is next, never a reused 1
    assert post_jsonl(client, suite_body).json()["version"] == 6
    event = AuditEvent.objects.get(action="evaluation_suite.upload", after__version=5)
    assert event.after["dropped_versions"] == [2]


@pytest.mark.django_db
def test_suites_count_against_the_storage_quota(tenant_a, adapter_a, suite_body):
    from tenants.models import Tenant

    Tenant.objects.filter(id=tenant_a.tenant.id).update(max_storage_bytes=1000, stored_bytes=1000 - len(suite_body))
    client = tenant_a.client_as("key:pipeline")
    assert post_jsonl(client, suite_body).status_code == 201  # exactly up to the limit
    refused = post_jsonl(client, suite_body)
    assert refused.status_code == 429
    error = error_of(refused)
    assert error["code"] == "storage_quota_exceeded" and "evaluation suites" in error["message"]
    assert error["detail"]["suite_bytes"] == len(suite_body)
    assert EvaluationSuite.objects.filter(adapter=adapter_a).count() == 1


def test_json_nested_past_the_parser_is_a_bad_line_and_scores_nothing():
    deep = b'{"prompt": "x", "reference": "y", "grader": "exact", "name": ' + b"[" * 3000 + b"}"
    limits = SuiteLimits(
        max_cases=5, max_tokens=16, max_bytes=8192, max_line_bytes=4096, max_pattern_bytes=64, regex_max_mem=1 << 20
    )
    error = problem(jsonl({"prompt": "a", "reference": "b", "grader": "exact"}) + b"\n" + deep, limits)
    assert error.line == 2 and "nested too deeply" in error.message
    case = {"grader": "json_score", "field": "score", "reference": 0.5}
    assert grade(case, "[" * 5000, regex_max_mem=1 << 20) == (False, 0.0)


@pytest.mark.django_db
def test_a_version_with_an_evaluation_under_way_is_kept_past_the_limit(tenant_a, adapter_a, suite_body, settings):
    settings.MINT_EVALUATION_SUITE_VERSIONS_KEPT = 1
    client = tenant_a.client_as("key:pipeline")
    assert post_jsonl(client, suite_body).status_code == 201
    first = EvaluationSuite.objects.get(adapter=adapter_a, version=1)
    revision = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="approved", source_uri="x")
    Evaluation.objects.create(revision=revision, suite=first, state="running")
    assert post_jsonl(client, suite_body).status_code == 201
    assert sorted(EvaluationSuite.objects.filter(adapter=adapter_a).values_list("version", flat=True)) == [1, 2]
    Evaluation.objects.filter(suite=first).update(state="passed")
    assert post_jsonl(client, suite_body).status_code == 201
    assert sorted(EvaluationSuite.objects.filter(adapter=adapter_a).values_list("version", flat=True)) == [3]
