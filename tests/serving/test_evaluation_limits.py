# ruff: noqa: F811  (the fixtures of test_evaluation_runner.py, imported to be used)
"""Evaluations are the tenant's own traffic: their tokens count against its budget and tokens per minute, they
go below every tenant's inference on the node (priority, and the gaps between requests), and at most the plan's
number of cases at once (vLLM faked at the client: tests/e2e/test_evaluation.py runs the real engine)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest
import redis
from django.conf import settings as django_settings

from adapters.models import Evaluation
from serving.engine_flags import PRIORITY_SCHEDULING_FLAG
from serving.models import USAGE_COUNTS, UsageKind, lora_name
from serving.services import budgets, evaluation
from serving.services.evaluation_tokens import evaluation_token_limit
from tenants.models import Tenant
from tests.serving.sent_tasks import sent_of
from tests.serving.test_evaluation_runner import engine, quiet_tasks, requested, run_to_the_end, world  # noqa: F401

pytestmark = pytest.mark.django_db

TOKENS_PER_CASE = 4  # the fake engine's usage: 3 prompt + 1 completion


@pytest.fixture(autouse=True)
def fresh_counters():
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    try:
        for key in client.scan_iter(match=f"{budgets.KEY_PREFIX}:*", count=1000):
            client.delete(key)
        yield client
        for key in client.scan_iter(match=f"{budgets.KEY_PREFIX}:*", count=1000):
            client.delete(key)
    finally:
        client.close()


def plan(tenant, **fields) -> None:
    Tenant.objects.filter(id=tenant.id).update(**fields)


def period():
    return budgets.Period.at(time.time())


def test_evaluation_tokens_count_against_the_tenants_month_and_minute(world, node, fresh_counters, adapter_a):
    suite, _live, candidate = world
    tenant = adapter_a.tenant
    plan(tenant, monthly_token_budget=10_000, max_tokens_per_minute=10_000)
    month = budgets.month_key(tenant.id, None, period().month)
    fresh_counters.set(month, 100)  # the gateway's counter of the month, as it seeded it
    ev = requested(candidate, suite)
    assert run_to_the_end(ev.id, node) == "finished"
    six_cases = 6 * TOKENS_PER_CASE  # the candidate's three and the live revision's three (the baseline)
    assert int(fresh_counters.get(month)) == 100 + six_cases
    window = budgets.window_key(tenant.id, None, period().minute)
    assert int(fresh_counters.get(window) or 0) in (six_cases, 0)  # 0 only if the minute turned meanwhile
    # Billed and counted in the month the database rebuilds a lost counter from.
    start, end = period().month_start, period().month_end
    assert budgets.usage_month_tokens(tenant_id=tenant.id, start=start, end=end) == six_cases


def test_an_evaluation_of_a_tenant_past_its_budget_ends_unavailable_without_a_case(world, node, engine, adapter_a):
    suite, _live, candidate = world
    plan(adapter_a.tenant, monthly_token_budget=5)
    month = budgets.month_key(adapter_a.tenant_id, None, period().month)
    redis.Redis.from_url(django_settings.REDIS_URL).set(month, 5)
    ev = requested(candidate, suite)
    assert run_to_the_end(ev.id, node) == "budget exhausted"
    ev.refresh_from_db()
    assert ev.state == "unavailable" and "monthly budget of 5 tokens" in ev.reason
    assert engine.generate.call_count == 0


def test_a_tenant_past_its_tokens_per_minute_waits_for_the_next_minute(world, node, engine, quiet_tasks, adapter_a):
    suite, _live, candidate = world
    plan(adapter_a.tenant, max_tokens_per_minute=50)
    now = time.time()
    redis.Redis.from_url(django_settings.REDIS_URL).set(
        budgets.window_key(adapter_a.tenant_id, None, int(now // 60)), 50
    )
    ev = requested(candidate, suite)
    assert run_to_the_end(ev.id, node) == "sliced"
    assert engine.generate.call_count == 0
    sent = sent_of(quiet_tasks, "evaluation_cases")[-1]
    assert 1 <= sent["countdown"] <= 61  # the next slice once the minute is over
    assert Evaluation.objects.get(id=ev.id).state == "running"


def test_the_limit_check_reads_the_database_while_redis_has_no_month(world, adapter_a):
    from serving.services.usage import usage_add

    tenant = Tenant.objects.get(id=adapter_a.tenant_id)
    Tenant.objects.filter(id=tenant.id).update(monthly_token_budget=10)
    tenant.refresh_from_db()
    at = datetime.now(UTC).replace(second=0, microsecond=0)
    values = [1, 8, 4] + [0] * (len(USAGE_COUNTS) - 3)
    usage_add(counts={(at, UsageKind.EVALUATION, tenant.id, 0, adapter_a.id, adapter_a.name, 1, "n", 200): values})
    hit = evaluation_token_limit(tenant=tenant)
    assert hit is not None and hit.code == "budget_exhausted"


@pytest.mark.parametrize("flags", [[PRIORITY_SCHEDULING_FLAG], ["--scheduling-policy", "priority"], []])
def test_cases_go_below_every_tenants_inference_on_a_node_that_schedules_by_priority(world, node, engine, flags):
    node.engine_flags = flags
    node.save()
    suite, _live, candidate = world
    run_to_the_end(requested(candidate, suite).id, node)
    priorities = {c.kwargs.get("priority") for c in engine.generate.call_args_list}
    assert priorities == ({evaluation.EVALUATION_PRIORITY} if flags else {None})


def test_a_case_waits_for_the_gap_between_other_requests(world, node, engine, settings):
    settings.MINT_EVALUATION_YIELD_S = 5.0
    suite, _live, candidate = world
    busy = iter([3, 2, 1] + [0] * 100)  # the node's requests in flight, as its metrics tell them
    seen: list[int] = []

    def in_flight() -> int:
        seen.append(next(busy))
        return seen[-1]

    engine.requests_in_flight.side_effect = in_flight
    asked_at: list[int] = []
    answer = engine.generate.side_effect

    def generate(*args, **kwargs):
        asked_at.append(len(seen))
        return answer(*args, **kwargs)

    engine.generate.side_effect = generate
    run_to_the_end(requested(candidate, suite).id, node)
    assert asked_at[0] == 4  # after three looks at a busy node, at the fourth (idle)
    assert seen[:4] == [3, 2, 1, 0]


def test_a_busy_node_is_waited_for_at_most_the_yield_time(world, node, engine, settings):
    settings.MINT_EVALUATION_YIELD_S = 0.2
    suite, _live, candidate = world
    engine.requests_in_flight.return_value = 7  # never idle: cases go anyway, below inference by priority
    started = time.monotonic()
    assert run_to_the_end(requested(candidate, suite).id, node) == "finished"
    assert engine.generate.call_count == 6
    assert time.monotonic() - started < 6 * 0.2 + 3


@pytest.mark.parametrize("cap", [1, 3])
def test_a_tenant_has_at_most_its_plans_cases_on_the_node_at_once(world, node, engine, adapter_a, cap):
    plan(adapter_a.tenant, max_evaluation_requests=cap)
    suite, live, candidate = world
    suite.cases = suite.cases * 3  # nine cases
    suite.case_count = len(suite.cases)
    suite.save()
    lock, now, most = threading.Lock(), [0], [0]
    answer = engine.generate.side_effect

    def generate(*args, **kwargs):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.05)
        with lock:
            now[0] -= 1
        return answer(*args, **kwargs)

    engine.generate.side_effect = generate
    assert run_to_the_end(requested(candidate, suite).id, node) == "finished"
    assert most[0] == cap
    ev = Evaluation.objects.get(revision=candidate)
    assert [c["case"] for c in ev.case_results] == list(range(1, 10))  # in order, whatever the concurrency
    assert engine.generate.call_count == 18
    assert {c.args[0] for c in engine.generate.call_args_list} == {lora_name(candidate), lora_name(live)}


def test_an_answer_with_nul_characters_is_stored(world, node, engine):
    """The tiny model (and any adapter) may generate NUL, which PostgreSQL's jsonb refuses: the slice must not fail."""
    suite, _live, candidate = world
    engine.answers[lora_name(candidate)] = {"one": "A\x00B", "two": "nope", "three": "C"}
    assert run_to_the_end(requested(candidate, suite).id, node) == "finished"
    ev = Evaluation.objects.get(revision=candidate)
    assert ev.case_results[0]["answer"] == "A\ufffdB"
