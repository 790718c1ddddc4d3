"""The adapter list of the REST API at catalog scale: search by name (`?q=`), cursor pages that keep the search,
a clear 400 for a search or a cursor no list could take, a query count that no number of adapters changes, and
no search or cursor that reaches another tenant's adapters."""

from __future__ import annotations

import base64
from urllib.parse import parse_qs, urlsplit

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from adapters import selectors as adapter_selectors
from adapters.models import Adapter, AdapterRevision
from serving.models import Alias
from tenants.models import Tenant
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

ADAPTERS = "/api/v1/adapters/"


@pytest.fixture(autouse=True)
def generous_plans(tenant_a, tenant_b):
    """Reads far past a plan's burst: the throttle (tests/tenants/test_throttles.py) is not what these test."""
    Tenant.objects.filter(id__in=[tenant_a.tenant.id, tenant_b.tenant.id]).update(api_read_rpm=100_000)


def make(tenant, base, *names: str) -> list[Adapter]:
    return [Adapter.objects.create(tenant=tenant, name=name, base_model=base) for name in names]


def names(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [a["name"] for a in response.json()["results"]]


def walk(client, url: str, **params) -> list[list[str]]:
    """Every page of a list, following `next` links as they are given."""
    pages = []
    response = client.get(url, params)
    while True:
        pages.append(names(response))
        following = response.json()["next"]
        if not following:
            return pages
        response = client.get(following)


def test_search_keeps_names_containing_q_in_any_case(tenant_a, dense_base):
    make(tenant_a.tenant, dense_base, "support-bot", "billing-support", "triage", "sup.port_v2")
    client = tenant_a.client_as("key:pipeline")
    assert names(client.get(ADAPTERS, {"q": "SUPPORT"})) == ["billing-support", "support-bot"]  # newest first
    assert names(client.get(ADAPTERS, {"q": "port-b"})) == ["support-bot"]
    assert names(client.get(ADAPTERS, {"q": "  triage "})) == ["triage"]
    # `_` and `.` are characters of the name, not patterns.
    assert names(client.get(ADAPTERS, {"q": "p.port_"})) == ["sup.port_v2"]
    assert names(client.get(ADAPTERS, {"q": "p_port"})) == []
    assert names(client.get(ADAPTERS, {"q": ""})) == ["sup.port_v2", "triage", "billing-support", "support-bot"]


def test_cursor_pages_keep_the_search_and_go_back(tenant_a, dense_base):
    make(tenant_a.tenant, dense_base, *[f"bot-{i:02d}" for i in range(7)], "other-0", "other-1")
    client = tenant_a.client_as("key:pipeline")
    pages = walk(client, ADAPTERS, q="bot", limit=3)
    assert pages == [["bot-06", "bot-05", "bot-04"], ["bot-03", "bot-02", "bot-01"], ["bot-00"]]
    second = client.get(client.get(ADAPTERS, {"q": "bot", "limit": 3}).json()["next"])
    assert parse_qs(urlsplit(second.json()["next"]).query)["q"] == ["bot"]
    assert names(client.get(second.json()["previous"])) == ["bot-06", "bot-05", "bot-04"]


def test_a_cursor_page_stays_put_when_adapters_are_added(tenant_a, dense_base):
    make(tenant_a.tenant, dense_base, *[f"bot-{i}" for i in range(5)])
    client = tenant_a.client_as("key:pipeline")
    following = client.get(ADAPTERS, {"limit": 2}).json()["next"]
    make(tenant_a.tenant, dense_base, "bot-new")
    assert names(client.get(following)) == ["bot-2", "bot-1"]


@pytest.mark.parametrize(
    "cursor",
    [
        "not-base64!",
        base64.b64encode(b"p=abc").decode(),  # a position that is no id
        base64.b64encode(b"o=-1").decode(),
        base64.b64encode(b"r=x").decode(),
    ],
)
def test_a_cursor_no_page_gave_out_is_a_400(tenant_a, cursor):
    response = tenant_a.client_as("key:pipeline").get(ADAPTERS, {"cursor": cursor})
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "invalid_cursor"
    assert "cursor" in error["message"]


def test_other_lists_refuse_a_bad_cursor_alike(tenant_a, adapter_a):
    response = tenant_a.client_as("key:pipeline").get(f"{ADAPTERS}{adapter_a.name}/revisions/", {"cursor": "x!"})
    assert (response.status_code, error_of(response)["code"]) == (400, "invalid_cursor")


@pytest.mark.parametrize(
    ("q", "says"),
    [
        ("a" * 65, "at most 64 characters"),
        ("bot%", "letters, digits"),
        ("bot\x00", "letters, digits"),
        ("two words", "letters, digits"),
    ],
)
def test_a_search_no_name_could_match_is_a_400_naming_q(tenant_a, q, says):
    response = tenant_a.client_as("key:pipeline").get(ADAPTERS, {"q": q})
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "invalid_search"
    assert error["message"].startswith("q: ") and says in error["message"]


def test_a_search_as_long_as_a_name_is_taken(tenant_a, dense_base):
    long_name = "a" * 64
    make(tenant_a.tenant, dense_base, long_name)
    assert names(tenant_a.client_as("key:pipeline").get(ADAPTERS, {"q": long_name})) == [long_name]


@pytest.mark.parametrize(
    ("probe", "dense", "rare_max"),
    [(1000, 10, 5000), (4, 1, 5000), (4, 10, 5000), (4, 10, 3)],
    ids=["defaults", "common", "rare", "rare-but-many"],
)
def test_every_plan_of_a_search_pages_the_same_matches(tenant_a, dense_base, monkeypatch, probe, dense, rare_max):
    """A term common among the newest adapters is read newest first; a rare one through its matches' ids, unless
    they are many after all: the pages are the same."""
    monkeypatch.setattr(adapter_selectors, "SEARCH_PROBE", probe)
    monkeypatch.setattr(adapter_selectors, "SEARCH_DENSE", dense)
    monkeypatch.setattr(adapter_selectors, "SEARCH_RARE_MAX", rare_max)
    make(tenant_a.tenant, dense_base, *[f"old-match-{i}" for i in range(7)], *[f"new-{i}" for i in range(6)])
    make(tenant_a.tenant, dense_base, "newest-match")
    pages = walk(tenant_a.client_as("key:pipeline"), ADAPTERS, q="MATCH", limit=3)
    expected = ["newest-match", *[f"old-match-{i}" for i in range(6, -1, -1)]]
    assert pages == [expected[:3], expected[3:6], expected[6:]]


def _adapters_with_aliases(tenant, base, names: list[str]) -> None:
    for name in names:
        adapter = Adapter.objects.create(tenant=tenant, name=name, base_model=base)
        live, wanted = (
            AdapterRevision.objects.create(adapter=adapter, number=n, state="approved", source_uri="x") for n in (1, 2)
        )
        Alias.objects.create(adapter=adapter, name="production", revision=live, desired_revision=wanted)
        Alias.objects.create(adapter=adapter, name="candidate", revision=wanted, desired_revision=wanted)


def _count(client, params: dict) -> int:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(ADAPTERS, params).status_code == 200
    return len(ctx.captured_queries)


# The key with its tenant; then the page of adapters, their aliases, the desired revisions' placements with nodes.
LIST_QUERIES = 1 + 3
# A search of three characters or more reads the newest names first (is the term common?); a rare term's matches'
# ids come next. A short term is a prefix: no probe.
SEARCH_QUERIES = {
    "list": ({}, LIST_QUERIES),
    "prefix": ({"q": "bo"}, LIST_QUERIES),
    "common": ({"q": "bot"}, LIST_QUERIES + 1),
    "rare": ({"q": "lonely"}, LIST_QUERIES + 2),
    "none": ({"q": "nothing"}, 1 + 2),  # no ids: no page to read
}


@pytest.mark.parametrize("case", list(SEARCH_QUERIES))
def test_list_and_search_query_counts_are_pinned(tenant_a, dense_base, django_assert_num_queries, case):
    _adapters_with_aliases(tenant_a.tenant, dense_base, ["lonely-bot-x", *[f"bot-{i:03d}" for i in range(12)]])
    params, expected = SEARCH_QUERIES[case]
    client = tenant_a.client_as("key:pipeline")
    client.get(ADAPTERS)  # the key's first use is written down once
    with django_assert_num_queries(expected):
        assert client.get(ADAPTERS, params).status_code == 200
    following = client.get(ADAPTERS, params | {"limit": 5}).json()["next"]
    if following:  # a page further on costs the same
        with django_assert_num_queries(expected):
            assert client.get(following).status_code == 200


def test_query_count_does_not_grow_with_adapters(tenant_a, dense_base):
    client = tenant_a.client_as("key:pipeline")
    _adapters_with_aliases(tenant_a.tenant, dense_base, ["lonely-bot-x", *[f"bot-{i:03d}" for i in range(12)]])
    client.get(ADAPTERS)
    cases = [params for params, _ in SEARCH_QUERIES.values()]
    few = [_count(client, p) for p in cases]
    _adapters_with_aliases(tenant_a.tenant, dense_base, [f"bot-{i:03d}" for i in range(12, 72)])
    assert [_count(client, p) for p in cases] == few


# ---------------------------------------------------------------- tenants walled off


def test_a_search_never_shows_another_tenants_adapters(tenant_a, tenant_b, dense_base):
    make(tenant_a.tenant, dense_base, "support-bot")
    make(tenant_b.tenant, dense_base, "support-globex", "globex-only")
    for principal in ("viewer", "key:pipeline"):
        client = tenant_a.client_as(principal)
        assert names(client.get(ADAPTERS, {"q": "support"})) == ["support-bot"]
        assert names(client.get(ADAPTERS, {"q": "globex"})) == []
    assert names(tenant_b.client_as("key:pipeline").get(ADAPTERS, {"q": "support"})) == ["support-globex"]


def test_another_tenants_cursor_pages_only_your_own_adapters(tenant_a, tenant_b, dense_base):
    """A cursor is a position in the list, not a key to it: tenant B's cursor, sent by A, pages A's adapters."""
    mine = make(tenant_a.tenant, dense_base, "acme-0", "acme-1")
    make(tenant_b.tenant, dense_base, *[f"globex-{i}" for i in range(4)])
    theirs = tenant_b.client_as("key:pipeline").get(ADAPTERS, {"limit": 1}).json()["next"]
    shown = names(tenant_a.client_as("key:pipeline").get(theirs))
    assert set(shown) <= {a.name for a in mine}
    assert not [n for n in shown if n.startswith("globex")]
