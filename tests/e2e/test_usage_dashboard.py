"""The usage page and the adapter's usage panel in a real browser (Debian's Chromium) against the ASGI server.

No engine: usage rows are written as the gateway's flush writes them (`serving.services.usage_add`, known counts),
and the page must chart exactly those: the sums of what uPlot drew (`data-drawn`), the table's totals, a canvas
of non-zero size. The page follows new usage without a reload (its timer, and any `usage.*` live event, which
re-reads the data; a `usage.budget` event shows a banner), shows the current numbers after Back, fits a 390 px
screen, and passes the dashboard's axe-core rules with its numbers on screen.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from mint_site.events import live_event
from tests.e2e.test_dashboard import screenshot, sign_in
from tests.e2e.test_dashboard_trust import _axe
from tests.factories import PASSWORD, ServingNodeFactory
from tests.frontend.conftest import fill
from tests.frontend.test_usage_page import meter

pytestmark = [pytest.mark.e2e]

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
# The page re-reads its data every 10 s: a change shows within that, plus a little.
REFRESH_MS = 15_000


@pytest.fixture
def world(tenant_a, tenant_b, adapter_a, adapter_b, dense_base, settings):
    """support-bot with r1 pending, r2 live; 7 requests to r2 (11 prompt and 3 completion tokens each), 2 x 503
    and a 429 that named no adapter, 2 minutes ago; tenant B's 50 requests in the same minute. Returns `more`,
    which adds requests of support-bot r2 in the current minute."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    for role in ("owner", "viewer"):
        user = tenant_a.users[role]
        user.set_password(PASSWORD)
        user.save(update_fields=["password"])
    node = ServingNodeFactory(name="node-1", base_model=dense_base, cpu_slots=8, last_heartbeat_at=timezone.now())
    fill(tenant_a, adapter_a, node)
    at = timezone.now() - timedelta(minutes=2)
    a = tenant_a.tenant
    meter(a, adapter_a.name, at=at, requests=7, prompt=11, completion=3, latency_ms=120, adapter_id=adapter_a.id)
    meter(a, adapter_a.name, at=at, status=503, prompt=0, completion=0, requests=2, adapter_id=adapter_a.id)
    meter(a, "", at=at, status=429, revision=0, prompt=0, completion=0, adapter_id=0)
    meter(tenant_b.tenant, adapter_b.name, at=at, requests=50, prompt=99, adapter_id=adapter_b.id)

    def more(**counts) -> None:
        """More of support-bot r2's requests, in this minute (what the gateway's next flush would add)."""
        meter(a, adapter_a.name, at=timezone.now(), adapter_id=adapter_a.id, **counts)

    return more


def drawn(page, selector: str) -> dict:
    value = page.locator(selector).get_attribute("data-drawn")
    return json.loads(value) if value else {}


def wait_drawn(page, selector: str, field: str, value: int) -> None:
    page.wait_for_function(
        "([sel, field, value]) => { const el = document.querySelector(sel);"
        " return el && el.dataset.drawn && JSON.parse(el.dataset.drawn)[field] === value; }",
        arg=[selector, field, value],
        timeout=REFRESH_MS,
    )


def canvas_size(page, chart: str) -> dict:
    box = page.locator(f"{chart} canvas").first.bounding_box()
    assert box is not None, chart
    return box


def test_the_chart_shows_the_requests_made_and_follows_new_ones(world, start_web, launch_browser, tmp_path, tenant_a):
    web = start_web()
    browser = launch_browser()
    page = browser.new_context(viewport=DESKTOP).new_page()
    sign_in(page, web, "acme-owner")
    page.get_by_role("link", name="Usage", exact=True).click()
    page.wait_for_url(f"{web}/usage/")
    page.get_by_label("Range", exact=True).select_option("hour")
    page.get_by_role("button", name="Show").click()
    page.wait_for_url(f"{web}/usage/?range=hour&adapter=&kind=inference")
    requests_chart = "[data-chart='requests'][data-source='usage-data']"
    page.wait_for_selector(f"{requests_chart}[data-drawn]", timeout=10_000)

    # What the charts drew is what was made: tenant A's requests, tokens, errors, 503 and 429, none of B's.
    assert drawn(page, requests_chart) == {"requests": 10}
    assert drawn(page, "[data-chart='tokens']") == {"prompt_tokens": 77, "completion_tokens": 21}
    assert drawn(page, "[data-chart='errors']") == {"errors": 3, "unavailable": 2, "limited": 1}
    assert page.locator(requests_chart).get_attribute("data-points") == "12"  # 5-minute buckets over the hour
    for chart in ("requests", "tokens", "latency", "errors"):
        box = canvas_size(page, f"[data-chart='{chart}']")
        assert box["width"] > 100 and box["height"] > 50, (chart, box)
    # The text alternative says the same: the table's totals, and each chart's label.
    total = page.locator("[data-usage-line='total']")
    assert total.locator("[data-col='requests']").inner_text() == "10"
    assert total.locator("[data-col='prompt_tokens']").inner_text() == "77"
    assert total.locator("[data-col='status_503']").inner_text() == "2"
    assert page.locator("[data-usage-line='support-bot@r2'] [data-col='requests']").inner_text() == "9"  # 7 + 2 x 503
    assert "Requests 10" in page.locator(requests_chart).get_attribute("aria-label")
    assert "globex" not in page.content().lower()
    screenshot(page, tmp_path, "usage")

    # New usage shows without a reload: the timer re-reads it.
    navigations: list[str] = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))
    world(requests=5, prompt=2, completion=1)
    wait_drawn(page, requests_chart, "requests", 15)
    expect(total.locator("[data-col='requests']")).to_have_text("15")
    assert page.get_by_role("heading", name="By adapter and revision over the last hour").count() == 1

    # A usage.budget event re-reads the data at once and shows a banner.
    world(requests=1)
    live_event(
        tenant_id=tenant_a.tenant.id,
        type="usage.budget",
        id=tenant_a.tenant.id,
        state="warning",
        scope="tenant",
        key=None,
        threshold=80,
        used=8000,
        budget=10000,
        month="2026-12",
        resets_at=datetime(2027, 1, 1, tzinfo=UTC).isoformat(),
    )
    banner = page.locator("#flash [data-budget-alert='warning']")
    expect(banner).to_contain_text("monthly token budget for 2026-12 is 80 % used: 8,000 of 10,000 tokens")
    wait_drawn(page, requests_chart, "requests", 16)
    assert navigations == [], navigations

    # Back shows the current numbers, not the page as it was left.
    page.get_by_role("link", name="Nodes", exact=True).click()
    page.wait_for_url(f"{web}/nodes/")
    expect(page.locator("[data-load-times]").first).to_have_text("120 ms / 40 ms")
    world(requests=4)
    page.go_back()
    page.wait_for_url(f"{web}/usage/?range=hour&adapter=&kind=inference")
    wait_drawn(page, requests_chart, "requests", 20)
    expect(total.locator("[data-col='requests']")).to_have_text("20")

    # The adapter's panel: its requests and tokens over the day, per revision.
    page.goto(f"{web}/adapters/support-bot/")
    panel = "[data-chart='requests'][data-source='adapter-usage-data']"
    wait_drawn(page, panel, "requests", 19)  # 7 + 2 (503) + 10 since: the 429 named no adapter
    assert drawn(page, "[data-chart='tokens'][data-source='adapter-usage-data']")["prompt_tokens"] == 77 + 60
    assert page.locator("#usage [data-usage-line='r2'] [data-col='requests']").inner_text() == "19"
    assert page.locator("#usage [data-usage-line='r2'] [data-col='status_503']").inner_text() == "2"
    assert page.locator("#usage [data-usage-line='r1']").count() == 0  # r1 served nothing
    box = canvas_size(page, panel)
    assert box["width"] > 100 and box["height"] > 50


def test_the_usage_pages_fit_a_phone(world, start_web, launch_browser, tmp_path):
    web = start_web()
    page = launch_browser().new_context(viewport=PHONE).new_page()
    sign_in(page, web, "acme-viewer")
    for url, chart, field, made in (
        ("/usage/?range=day", "[data-chart='requests'][data-source='usage-data']", "requests", 10),
        (
            "/usage/?range=month&adapter=support-bot",
            "[data-chart='tokens'][data-source='usage-data']",
            "prompt_tokens",
            77,
        ),
        ("/adapters/support-bot/", "[data-chart='requests'][data-source='adapter-usage-data']", "requests", 9),
    ):
        page.goto(f"{web}{url}")
        page.wait_for_selector(f"{chart}[data-drawn]", timeout=10_000)
        page.locator("details.per-bucket").evaluate_all("(ds) => ds.forEach((d) => { d.open = true; })")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], (url, width)
        box = canvas_size(page, chart)
        assert 100 < box["width"] <= PHONE["width"] and box["height"] > 50, (url, box)
        assert drawn(page, chart)[field] == made, url
        assert _axe(page) == [], url  # labels, contrast and ARIA with charts, tables and the numbers shown
        screenshot(page, tmp_path, "phone-usage-" + url.strip("/").replace("/", "-").replace("?", "-"))
