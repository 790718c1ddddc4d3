"""The overview at catalog scale: a page of adapters at a time, newest first, with Next and Previous links that keep
the search; the state filters answered in SQL across pages; a 400 that says why for a search no name could match or
an edited page link; and no search or page link that shows another tenant's adapters."""

from __future__ import annotations

import html
import re

import pytest
from django.db.models import F

from adapters.models import Adapter, AdapterRevision
from frontend.selectors import PAGE_SIZE
from serving.models import Alias
from tests.frontend.conftest import page_client

pytestmark = pytest.mark.django_db

ROW = re.compile(r'data-adapter="([^"]+)"')
LINK = re.compile(r'<a href="\?([^"]*)" rel="(next|prev)">')


def make(tenant, base, *names: str) -> list[Adapter]:
    return [Adapter.objects.create(tenant=tenant, name=name, base_model=base) for name in names]


def shown(response) -> tuple[list[str], dict[str, str]]:
    """The adapters a page lists, and its page links (`next`, `prev`) as query strings."""
    assert response.status_code == 200, response.content[:500]
    text = response.content.decode()
    return ROW.findall(text), {rel: html.unescape(query) for query, rel in LINK.findall(text)}


def test_pages_newest_first_with_next_and_previous(tenant_a, dense_base):
    made = make(tenant_a.tenant, dense_base, *[f"bot-{i:03d}" for i in range(PAGE_SIZE * 2 + 7)])
    every = [a.name for a in reversed(made)]
    client = page_client(tenant_a.users["viewer"])
    first, links = shown(client.get("/"))
    assert first == every[:PAGE_SIZE] and set(links) == {"next"}
    assert links["next"] == f"after={made[-PAGE_SIZE].id}"
    second, links = shown(client.get(f"/?{links['next']}"))
    assert second == every[PAGE_SIZE : 2 * PAGE_SIZE] and set(links) == {"next", "prev"}
    third, third_links = shown(client.get(f"/?{links['next']}"))
    assert third == every[2 * PAGE_SIZE :] and set(third_links) == {"prev"}
    back, back_links = shown(client.get(f"/?{third_links['prev']}"))
    assert back == second and set(back_links) == {"next", "prev"}
    start, start_links = shown(client.get(f"/?{back_links['prev']}"))
    assert start == first and set(start_links) == {"next"}


def test_a_page_stays_put_when_adapters_are_added(tenant_a, dense_base):
    make(tenant_a.tenant, dense_base, *[f"bot-{i:03d}" for i in range(PAGE_SIZE + 5)])
    client = page_client(tenant_a.users["viewer"])
    _, links = shown(client.get("/"))
    make(tenant_a.tenant, dense_base, "newer-bot")
    assert shown(client.get(f"/?{links['next']}"))[0] == [f"bot-{i:03d}" for i in range(4, -1, -1)]


def test_search_pages_keep_the_search(tenant_a, dense_base):
    made = make(tenant_a.tenant, dense_base, *[f"support-{i:03d}" for i in range(PAGE_SIZE + 3)], "triage-bot")
    client = page_client(tenant_a.users["viewer"])
    first, links = shown(client.get("/?q=Support"))
    assert len(first) == PAGE_SIZE and "triage-bot" not in first
    assert links["next"] == f"q=support&after={made[3].id}"
    rest, links = shown(client.get(f"/?{links['next']}"))
    assert rest == ["support-002", "support-001", "support-000"]
    assert links == {"prev": f"q=support&before={made[2].id}"}


def test_one_or_two_characters_match_the_start_of_the_name(tenant_a, dense_base):
    make(tenant_a.tenant, dense_base, "sql-bot", "bot-sq", "triage-s", "sqlite")
    client = page_client(tenant_a.users["viewer"])
    assert shown(client.get("/?q=SQ"))[0] == ["sqlite", "sql-bot"]
    assert shown(client.get("/?q=s"))[0] == ["sqlite", "sql-bot"]
    assert shown(client.get("/?q=-sq"))[0] == ["bot-sq"]


def test_a_page_past_the_end_says_so(tenant_a, dense_base):
    (oldest, _) = make(tenant_a.tenant, dense_base, "alpha", "beta")
    text = page_client(tenant_a.users["viewer"]).get(f"/?after={oldest.id}").content.decode()
    assert "No adapters on this page." in text and not ROW.findall(text)


def _with_production(adapter: Adapter, *, live: bool, wanted: bool) -> None:
    r1, r2 = (
        AdapterRevision.objects.create(adapter=adapter, number=n, state="approved", source_uri="x") for n in (1, 2)
    )
    Alias.objects.create(
        adapter=adapter, name="production", revision=r1 if live else None, desired_revision=r2 if wanted else None
    )


def test_state_filters_page_through_every_match(tenant_a, dense_base):
    """The states are read in SQL, so a page of flipping adapters is full even when most adapters are not."""
    (waiting,) = make(tenant_a.tenant, dense_base, "waiting")
    _with_production(waiting, live=False, wanted=True)
    flipping = make(tenant_a.tenant, dense_base, *[f"f-{i:03d}" for i in range(PAGE_SIZE + 2)])
    for adapter in flipping:
        _with_production(adapter, live=True, wanted=True)
    make(tenant_a.tenant, dense_base, "idle")
    (pending,) = make(tenant_a.tenant, dense_base, "pending")
    AdapterRevision.objects.create(adapter=pending, number=1, state="pending_approval", source_uri="x")
    steady = make(tenant_a.tenant, dense_base, *[f"s-{i:03d}" for i in range(PAGE_SIZE)])
    for adapter in steady:
        _with_production(adapter, live=True, wanted=False)
        Alias.objects.filter(adapter=adapter).update(desired_revision=F("revision"))
    client = page_client(tenant_a.users["viewer"])

    newest_flipping = [a.name for a in reversed(flipping)]
    page, links = shown(client.get("/?state=flipping"))
    assert page == newest_flipping[:PAGE_SIZE]
    assert links["next"].startswith("state=flipping&after=")
    rest, _ = shown(client.get(f"/?{links['next']}"))
    assert rest == [*newest_flipping[PAGE_SIZE:], "waiting"]

    serving, links = shown(client.get("/?state=serving"))
    assert serving == [a.name for a in reversed(steady)] and "next" in links  # then the flipping ones
    assert shown(client.get("/?state=inactive"))[0] == ["pending", "idle"]
    assert shown(client.get("/?state=awaiting"))[0] == ["pending"]


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("q=" + "a" * 65, "Name contains: Ensure this value has at most 64 characters"),
        ("q=bot%25", "Name contains: adapter names hold only letters, digits"),
        ("after=support-bot", "Page after: not a page of this list"),
        ("before=0", "Page before: not a page of this list"),
        ("before=%00", "Page before: not a page of this list"),
        ("after=1&before=9", "not both"),
    ],
)
def test_a_search_or_page_link_no_list_could_take_is_a_400_that_says_why(tenant_a, dense_base, query, says):
    make(tenant_a.tenant, dense_base, "support-bot")
    response = page_client(tenant_a.users["viewer"]).get(f"/?{query}")
    assert response.status_code == 400
    text = html.unescape(response.content.decode())
    assert says in text
    assert 'role="alert"' in text and not ROW.findall(text)


def test_the_search_is_a_plain_get_form(tenant_a):
    """Without script, the box submits `q` (and the state) by GET, and the links are plain links."""
    text = page_client(tenant_a.users["viewer"]).get("/").content.decode()
    form = re.search(r'<form method="get"[^>]*role="search".*?</form>', text, re.S).group(0)
    assert 'name="q"' in form and 'maxlength="64"' in form and 'name="state"' in form
    assert 'type="submit"' in form


# ---------------------------------------------------------------- tenants walled off


def test_a_search_or_page_link_never_shows_another_tenants_adapters(tenant_a, tenant_b, dense_base):
    make(tenant_a.tenant, dense_base, "support-bot", "zeta")
    (oldest_b, *_, newest_b) = make(tenant_b.tenant, dense_base, "support-globex", "globex-only", "aaa-globex")
    client = page_client(tenant_a.users["owner"])
    assert shown(client.get("/?q=support"))[0] == ["support-bot"]
    assert shown(client.get("/?q=globex"))[0] == []
    assert shown(client.get("/?q=aa"))[0] == []
    # A page link naming B's adapters pages A's, from that point on.
    assert shown(client.get(f"/?after={newest_b.id}"))[0] == ["zeta", "support-bot"]
    assert shown(client.get(f"/?before={oldest_b.id - 3}"))[0] == ["zeta", "support-bot"]
    assert shown(page_client(tenant_b.users["owner"]).get("/?q=support"))[0] == ["support-globex"]
