"""The overview's search and pages in a real browser (Chromium via Playwright) against the ASGI server, with
JavaScript off: the search box is a plain GET form and the page links are plain links. Then, with JavaScript on, the
axe-core rules pass on a searched page and on a page further on, and the live refresh keeps the page shown."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from adapters.models import Adapter
from frontend.selectors import PAGE_SIZE
from tests.e2e.test_dashboard import sign_in
from tests.e2e.test_dashboard_trust import DESKTOP, _axe
from tests.factories import PASSWORD

pytestmark = [pytest.mark.e2e]


@pytest.fixture
def many_adapters(tenant_a, dense_base, settings):
    """PAGE_SIZE + 12 `support-*` adapters and 5 others in tenant A, one in tenant B; the viewer can sign in."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    viewer = tenant_a.users["viewer"]
    viewer.set_password(PASSWORD)
    viewer.save(update_fields=["password"])
    support = [
        Adapter.objects.create(tenant=tenant_a.tenant, name=f"support-{i:03d}", base_model=dense_base)
        for i in range(PAGE_SIZE + 12)
    ]
    for i in range(5):
        Adapter.objects.create(tenant=tenant_a.tenant, name=f"triage-{i}", base_model=dense_base)
    return [a.name for a in reversed(support)]  # newest first, as the pages list them


def rows(page) -> list[str]:
    return page.locator("tr[data-adapter]").evaluate_all("(rows) => rows.map((r) => r.dataset.adapter)")


def test_search_and_pages_work_without_javascript(many_adapters, start_web, launch_browser, tenant_b, dense_base):
    Adapter.objects.create(tenant=tenant_b.tenant, name="support-globex", base_model=dense_base)
    web = start_web()
    browser = launch_browser()
    page = browser.new_context(viewport=DESKTOP, java_script_enabled=False).new_page()
    sign_in(page, web, "acme-viewer")

    page.get_by_label("Name contains").fill("SUPPORT")
    page.get_by_role("button", name="Find").click()
    page.wait_for_url(f"{web}/?q=SUPPORT&state=")
    assert rows(page) == many_adapters[:PAGE_SIZE]
    expect(page.get_by_role("link", name="Previous")).to_have_count(0)

    page.get_by_role("link", name="Next").click()
    assert "q=support" in page.url and "after=" in page.url
    assert rows(page) == many_adapters[PAGE_SIZE:]
    expect(page.get_by_role("link", name="Next")).to_have_count(0)
    expect(page.get_by_label("Name contains")).to_have_value("support")  # the box keeps the search

    page.get_by_role("link", name="Previous").click()
    assert rows(page) == many_adapters[:PAGE_SIZE]

    # A search no name could match says why, next to the box.
    page.get_by_label("Name contains").fill("no such %")
    page.get_by_role("button", name="Find").click()
    expect(page.get_by_role("alert")).to_contain_text("Name contains: adapter names hold only letters, digits")
    assert rows(page) == []


def test_searched_and_paged_overview_passes_axe_and_keeps_its_page_live(many_adapters, start_web, launch_browser):
    web = start_web()
    browser = launch_browser()
    page = browser.new_context(viewport=DESKTOP).new_page()
    sign_in(page, web, "acme-viewer")
    page.goto(f"{web}/?q=support")
    page.wait_for_selector("#live[data-state='on']", timeout=10_000)
    assert _axe(page) == []
    page.get_by_role("link", name="Next").click()
    page.wait_for_selector("#live[data-state='on']", timeout=10_000)
    assert _axe(page) == []
    # The live refresh re-reads the section with the page's own query: the rows stay those of this page.
    with page.expect_response(lambda r: "fragment=adapters" in r.url and "after=" in r.url, timeout=15_000):
        pass
    assert rows(page) == many_adapters[PAGE_SIZE:]
