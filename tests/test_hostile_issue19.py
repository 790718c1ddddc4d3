"""Hostile review of issue 19 (evaluation gate, canary rollout, webhooks): what one tenant, holding a key or a
session of its own, or someone holding none, can do to the others. Every test here is an attack the code
defends against today; it guards against a regression.

- Webhooks: every spelling of a private address (decimal, octal, hex, short forms, IPv4-compatible and
  -translated IPv6, 6to4, zone ids, a trailing dot) is refused at creation, and again at each attempt without a
  connection; user-info and fragment tricks name the address that is really called; one tenant's events never
  reach another tenant's endpoints; nothing of the API answers without a session.
- Canary: the split is keyed by the alias, and a huge `user` costs no more to hash than its bounded prefix.
- Evaluation gate: the policy refuses NaN and infinities (a NaN minimum would pass every score); a suite line
  with a non-finite or huge number, a back-reference, look-around or a pattern past the RE2 memory bound is a
  400 naming the line; the json_score grader never raises on numbers Python cannot hold; a suite case's
  name, an answer and a reason are escaped on the dashboard; another tenant's evaluations, suites and policy
  are a 404.
"""

from __future__ import annotations

import json
import socket

import pytest
from django.test import Client
from django.utils import timezone

from adapters.models import Adapter, Evaluation, EvaluationSuite
from adapters.suites import grade
from serving.gateway import canary as gateway_canary
from tenants.access import Actor
from tests.conftest import error_of
from tests.factories import ServingNodeFactory
from tests.frontend.conftest import fill
from tests.webhooks.receiver import Receiver
from webhooks import services, transport
from webhooks.models import WebhookDelivery, WebhookEndpoint

pytestmark = pytest.mark.django_db


@pytest.fixture
def refuse_private(settings):
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = False
    settings.MINT_WEBHOOK_TIMEOUT_S = 2.0
    return settings


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def node(dense_base):
    return ServingNodeFactory(
        name="node-h19",
        base_model=dense_base,
        url="http://127.0.0.1:9",
        gpu_slots=4,
        cpu_slots=8,
        cache_dir="/tmp/none",
        last_heartbeat_at=timezone.now(),
    )


# ---------------------------------------------------------------- webhooks: SSRF


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://2130706433/hook", "127.0.0.1 is a loopback address"),  # decimal
        ("http://0x7f000001/hook", "127.0.0.1 is a loopback address"),  # hex
        ("http://0177.0.0.1/hook", "127.0.0.1 is a loopback address"),  # octal
        ("http://0x7f.0.0.1/hook", "127.0.0.1 is a loopback address"),  # mixed
        ("http://0251.0376.0251.0376/latest/meta-data/", "169.254.169.254 is a link-local address"),
        ("http://127.0.0.1.:8080/hook", "127.0.0.1 is a loopback address"),  # trailing dot
        ("http://LOCALHOST./hook", "resolves to 127.0.0.1"),
        ("http://[::127.0.0.1]/hook", "is a reserved address"),  # IPv4-compatible
        ("http://[::ffff:0:7f00:1]/hook", "is a reserved address"),  # IPv4-translated
        ("http://[::ffff:a9fe:a9fe]/hook", "embeds 169.254.169.254 is a link-local address"),
        ("http://[2002:a9fe:a9fe::]/hook", "embeds 169.254.169.254 is a link-local address"),  # 6to4
        ("http://[fe80::1%25eth0]/hook", "is a link-local address"),  # a zone id
        ("http://[fec0::1]/hook", "is a site-local address"),
    ],
)
def test_every_spelling_of_a_private_address_is_refused_at_creation(tenant_a, refuse_private, url, named):
    response = tenant_a.client_as("owner").post("/api/v1/webhooks/", {"url": url}, format="json")
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["code"] == "webhook_url_refused"
    assert named in error["message"]
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.parametrize(
    ("url", "named"),
    [
        # The name before "@" is not where the request would go: refused outright.
        ("http://example.com@127.0.0.1/hook", "user name or password"),
        ("http://example.com\\@127.0.0.1/hook", "user name or password"),
        ("http://127.0.0.1:80\\@example.com/hook", "user name or password"),
        ("http://:@127.0.0.1/hook", "user name or password"),
        # After "#" is a fragment: the host really called is 127.0.0.1, and it is named.
        ("http://127.0.0.1#@example.com/hook", "127.0.0.1 is a loopback address"),
        ("http://127.0.0.1?@example.com/", "127.0.0.1 is a loopback address"),
    ],
)
def test_user_info_and_fragment_tricks_are_refused(tenant_a, refuse_private, url, named):
    response = tenant_a.client_as("owner").post("/api/v1/webhooks/", {"url": url}, format="json")
    assert response.status_code == 400, response.content
    assert named in error_of(response)["message"]
    assert not WebhookEndpoint.objects.exists()


def test_a_changed_url_in_a_numeric_spelling_is_refused_and_the_old_one_kept(tenant_a, refuse_private, monkeypatch):
    public = "https://hooks.example.com/h"
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host == "hooks.example.com":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(transport.socket, "getaddrinfo", getaddrinfo)
    owner = tenant_a.users["owner"]
    endpoint, _ = services.endpoint_create(tenant=tenant_a.tenant, url=public, created_by=owner, by=Actor(user=owner))
    response = tenant_a.client_as("owner").patch(
        f"/api/v1/webhooks/{endpoint.id}/", {"url": "http://0x7f000001:6379/"}, format="json"
    )
    assert response.status_code == 400
    assert "127.0.0.1 is a loopback address" in error_of(response)["message"]
    endpoint.refresh_from_db()
    assert endpoint.url == public


@pytest.mark.parametrize(
    "host",
    ["2130706433", "0x7f000001", "0177.0.0.1", "127.1", "[::ffff:127.0.0.1]", "[::127.0.0.1]", "localhost."],
)
def test_the_attempt_refuses_a_numeric_spelling_without_connecting(receiver, host):
    """An endpoint row that never went through the API (the admin, an old row, a setting turned off since)
    is checked again at the attempt: nothing reaches the loopback receiver, and the failure is final."""
    outcome = transport.post_signed(
        url=f"http://{host}:{receiver.port}/hook",
        body=b"{}",
        headers={},
        secret="whsec_x",
        timeout_s=2.0,
        max_bytes=1024,
        allow_private=False,
        max_url_length=2000,
    )
    assert not outcome.delivered and outcome.permanent
    assert "Webhook receivers on private networks are refused" in outcome.error
    assert receiver.received == []


def test_one_tenants_event_never_reaches_another_tenants_endpoint(tenant_a, tenant_b):
    b_endpoint = WebhookEndpoint.objects.create(tenant=tenant_b.tenant, url="https://b.example/h", secret="whsec_b")
    a_endpoint = WebhookEndpoint.objects.create(tenant=tenant_a.tenant, url="https://a.example/h", secret="whsec_a")
    # Handed B's endpoint explicitly, an event of A is still A's only.
    assert (
        services.webhook_emit(
            tenant_id=tenant_a.tenant.id, event="revision.approved", subject="s", data={}, endpoints=[b_endpoint]
        )
        == []
    )
    # A live event of tenant A (an alias flip) becomes deliveries to A's endpoints only.
    services.webhook_live_event(
        event={"type": "alias.flip", "id": 1, "adapter": "support-bot", "revision": "r2", "at": "x"},
        tenant_id=tenant_a.tenant.id,
    )
    assert list(WebhookDelivery.objects.values_list("endpoint_id", flat=True)) == [a_endpoint.id]
    # An event of no tenant (platform: a node's state) reaches nobody.
    services.webhook_live_event(event={"type": "placement.state", "state": "failed", "id": 9}, tenant_id=None)
    assert WebhookDelivery.objects.count() == 1


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/v1/webhooks/"),
        ("post", "/api/v1/webhooks/"),
        ("get", "/api/v1/webhooks/{id}/"),
        ("patch", "/api/v1/webhooks/{id}/"),
        ("delete", "/api/v1/webhooks/{id}/"),
        ("post", "/api/v1/webhooks/{id}/ping/"),
        ("get", "/api/v1/webhooks/{id}/deliveries/"),
        ("post", "/api/v1/webhooks/{id}/deliveries/{delivery}/redeliver/"),
    ],
)
def test_nobody_without_a_key_or_session_reaches_the_webhooks_api(tenant_a, method, path):
    endpoint = WebhookEndpoint.objects.create(tenant=tenant_a.tenant, url="https://a.example/h", secret="whsec_a")
    (delivery,) = services.webhook_emit(
        tenant_id=tenant_a.tenant.id, event="revision.approved", subject="s", data={}, endpoints=[endpoint]
    )
    client = Client()
    url = path.format(id=endpoint.id, delivery=delivery.id)
    if method == "get":
        response = client.get(url)
    else:
        response = getattr(client, method)(url, data=json.dumps({"url": "http://x"}), content_type="application/json")
    assert response.status_code in (401, 403), (url, response.status_code)
    assert WebhookDelivery.objects.count() == 1
    endpoint.refresh_from_db()
    assert endpoint.url == "https://a.example/h"


# ---------------------------------------------------------------- canary: the split


def test_a_huge_user_costs_no_more_than_its_bounded_prefix(settings):
    settings.MINT_CANARY_USER_MAX_CHARS = 256
    prefix = "u" * 256
    assert gateway_canary.user_share(7, prefix + "a" * 4_000_000) == gateway_canary.user_share(7, prefix + "b")
    assert gateway_canary.user_share(7, prefix) == gateway_canary.user_share(7, prefix + "zzz")


def test_the_split_is_keyed_by_the_alias_so_a_chosen_user_says_nothing_of_another(settings):
    """Users a tenant picked to land on its own candidate (alias 1) fall on another alias's candidate only as
    often as anybody's do: the alias id is part of what is hashed."""
    settings.MINT_CANARY_USER_MAX_CHARS = 256
    chosen = [u for u in (f"user-{n}" for n in range(20_000)) if gateway_canary.user_share(1, u) < 500][:500]
    assert len(chosen) == 500
    elsewhere = sum(1 for u in chosen if gateway_canary.user_share(2, u) < 500)
    assert elsewhere < 75  # about 5 % (25) expected; all 500 if the alias were not hashed


@pytest.mark.parametrize("user", [None, "", 12, ["a"], {"id": "x"}])
def test_a_user_that_is_no_string_goes_at_random_and_never_raises(user):
    from types import SimpleNamespace

    canary = SimpleNamespace(alias_id=3, percent=10)
    assert gateway_canary.to_candidate(canary, user, rng=lambda: 0.05) is True
    assert gateway_canary.to_candidate(canary, user, rng=lambda: 0.5) is False


# ---------------------------------------------------------------- evaluation gate


@pytest.mark.parametrize(
    "answer",
    [
        "1" * 5000,  # more digits than Python turns into an int
        '{"score": ' + "9" * 5000 + "}",
        '{"score": 1e999}',  # infinity
        '{"score": NaN}',
        '{"score": -Infinity}',
        '{"score": true}',
        '{"score": "1"}',
        "\x00\xff not json",
    ],
)
def test_json_score_never_raises_on_an_answer_python_cannot_hold(answer):
    case = {"grader": "json_score", "field": "score", "reference": 0.5}
    assert grade(case, answer, regex_max_mem=1 << 20) == (False, 0.0)


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt": "p", "grader": "json_score", "field": "s", "reference": NaN}',
        '{"prompt": "p", "grader": "json_score", "field": "s", "reference": Infinity}',
        '{"prompt": "p", "grader": "json_score", "field": "s", "reference": 1e999}',
        '{"prompt": "p", "grader": "contains", "reference": "r", "max_tokens": 1e400}',
        '{"prompt": "p", "grader": "contains", "reference": "r", "max_tokens": ' + "9" * 5000 + "}",
        '{"prompt": "p", "grader": "contains", "reference": "r", "max_tokens": 4096}',
        '{"prompt": "p", "grader": "regex", "reference": "(a+)+\\\\1"}',
        '{"prompt": "p", "grader": "regex", "reference": "(?=a)b"}',
        '{"prompt": "p", "grader": "regex", "reference": "\\\\p{L}{1000}"}',  # past MINT_EVALUATION_REGEX_MAX_MEM
        '{"prompt": "p", "grader": "regex", "reference": "((a{100}){100}){100}"}',
    ],
)
def test_a_suite_line_with_a_number_or_pattern_the_runner_cannot_use_is_a_400(tenant_a, adapter_a, line):
    response = tenant_a.client_as("developer").post(
        f"/api/v1/adapters/{adapter_a.name}/evaluation-suites/", data=line.encode(), content_type="application/jsonl"
    )
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["detail"]["line"] == 1 and error["message"].startswith("line 1:")
    assert not EvaluationSuite.objects.exists()


@pytest.mark.parametrize("value", ["NaN", "nan", "Infinity", "-Infinity", "1e999", 1.5, -0.1])
def test_the_policy_refuses_a_minimum_that_is_no_number_in_0_to_1(tenant_a, adapter_a, value):
    """A NaN minimum would pass every score (`score < NaN` is never true): the gate would be off in silence."""
    response = tenant_a.client_as("approver").put(
        f"/api/v1/adapters/{adapter_a.name}/evaluation-policy/", {"min_score": value}, format="json"
    )
    assert response.status_code == 400, response.content
    adapter_a.refresh_from_db()
    assert adapter_a.evaluation_min_score is None


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999"])
def test_the_dashboard_policy_form_refuses_a_minimum_that_is_no_number(tenant_a, adapter_a, value):
    client = Client()
    client.force_login(tenant_a.users["approver"])
    client.post(
        f"/adapters/{adapter_a.name}/evaluation-policy/",
        {"tenant": tenant_a.tenant.slug, "min_score": value, "no_regression": "on"},
    )
    adapter_a.refresh_from_db()
    assert adapter_a.evaluation_min_score is None and not adapter_a.evaluation_no_regression


HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def test_a_case_name_an_answer_and_a_reason_are_escaped_on_the_dashboard(tenant_a, adapter_a, node):
    catalog = fill(tenant_a, adapter_a, node)
    Adapter.objects.filter(id=adapter_a.id).update(evaluation_min_score=0.9)
    cases = [{"prompt": "p", "reference": "r", "grader": "contains", "name": HOSTILE}]
    suite = EvaluationSuite.objects.create(adapter=adapter_a, version=1, cases=cases, case_count=1)
    Evaluation.objects.create(
        revision=catalog.pending,
        suite=suite,
        state="failed",
        score=0.0,
        cases_passed=0,
        case_count=1,
        case_results=[{"case": 1, "passed": False, "score": 0.0, "answer": HOSTILE, "name": HOSTILE}],
        reason=f"score 0.000 is below the adapter's minimum 0.900 {HOSTILE}",
    )
    client = Client()
    client.force_login(tenant_a.users["approver"])
    for url in (f"/adapters/{adapter_a.name}/", f"/adapters/{adapter_a.name}/revisions/{catalog.pending.number}/"):
        response = client.get(url)
        assert response.status_code == 200
        content = response.content.decode()
        assert "<script>alert" not in content and "<img src=x" not in content, url
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in content  # the revision page lists the case


def test_a_suite_case_name_with_html_is_stored_as_text_and_served_as_json(tenant_a, adapter_a):
    body = json.dumps({"prompt": "p", "reference": "r", "grader": "contains", "name": HOSTILE}).encode()
    client = tenant_a.client_as("developer")
    response = client.post(
        f"/api/v1/adapters/{adapter_a.name}/evaluation-suites/", data=body, content_type="application/jsonl"
    )
    assert response.status_code == 201, response.content
    assert response["Content-Type"].startswith("application/json")
    assert response.json()["cases"][0]["name"] == HOSTILE


def test_another_tenant_reaches_no_evaluation_suite_or_policy(tenant_a, tenant_b, adapter_a, node):
    catalog = fill(tenant_a, adapter_a, node)
    suite = EvaluationSuite.objects.create(
        adapter=adapter_a,
        version=1,
        cases=[{"prompt": "p", "reference": "r", "grader": "contains"}],
        case_count=1,
    )
    Evaluation.objects.create(revision=catalog.pending, suite=suite, state="unavailable", reason="no node")
    base = f"/api/v1/adapters/{adapter_a.name}"
    for principal in ("owner", "key:pipeline,deploy,inference"):
        b = tenant_b.client_as(principal)
        assert b.get(f"{base}/revisions/1/evaluation/").status_code == 404
        assert b.post(f"{base}/revisions/1/evaluation/").status_code == 404
        assert b.get(f"{base}/evaluation-suites/").status_code == 404
        assert b.get(f"{base}/evaluation-suites/1/").status_code == 404
        assert b.get(f"{base}/evaluation-policy/").status_code == 404
        response = b.put(f"{base}/evaluation-policy/", {"min_score": 0.0}, format="json")
        assert response.status_code == 404
    adapter_a.refresh_from_db()
    assert adapter_a.evaluation_min_score is None
    assert Evaluation.objects.get(revision=catalog.pending).state == "unavailable"  # not asked again by B
    anonymous = Client()
    assert anonymous.get(f"{base}/revisions/1/evaluation/").status_code in (401, 403)
    assert anonymous.post(f"{base}/evaluation-suites/", data=b"{}", content_type="application/jsonl").status_code in (
        401,
        403,
    )
