"""A dashboard an operator can trust, in a real browser (Chromium via Playwright) against the ASGI server.

No engine and no worker: the catalog is written by the test, changes come from the services called here,
and their live events reach the page through the real channel layer. Checks: Back/Forward show the
current state; the overview follows an activation without a reload and keeps its headings across
refreshes; no page scrolls sideways at phone width (390 px); axe-core's rules for labels, contrast and
ARIA pass on every page (tests/e2e/vendor/axe.min.js, injected into the page, never served); the focus
ring stands out (≥ 3:1) against what surrounds it; a stalled activation says why and can be cancelled; a
duplicate upload is refused naming the revision it repeats.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from adapters.models import AdapterRevision
from serving import services as serving_services
from serving.models import Alias, Placement, PlacementState
from tenants.access import Actor
from tenants.services import api_key_create, audit_record
from tests.e2e.test_dashboard import screenshot, sign_in
from tests.factories import PASSWORD, ServingNodeFactory
from tests.frontend.conftest import fill

pytestmark = [pytest.mark.e2e]

AXE = Path(__file__).parent / "vendor" / "axe.min.js"
# The axe-core rules run on every page: form labels and names, text contrast, and ARIA.
AXE_RULES = [
    # labels and accessible names
    "label",
    "label-title-only",
    "form-field-multiple-labels",
    "select-name",
    "input-button-name",
    "button-name",
    "link-name",
    "aria-input-field-name",
    "aria-command-name",
    "aria-toggle-field-name",
    "aria-meter-name",
    # contrast
    "color-contrast",
    # ARIA
    "aria-allowed-attr",
    "aria-allowed-role",
    "aria-conditional-attr",
    "aria-deprecated-role",
    "aria-hidden-focus",
    "aria-prohibited-attr",
    "aria-required-attr",
    "aria-required-children",
    "aria-required-parent",
    "aria-roles",
    "aria-valid-attr",
    "aria-valid-attr-value",
    "duplicate-id-aria",
    "presentation-role-conflict",
    "nested-interactive",
    "scrollable-region-focusable",
]
LONG_TENSOR = "base_model.model.layers.31.mlp.experts.127.gate_proj.lora_A.weight_" + "x" * 120
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}


@pytest.fixture
def catalog(tenant_a, adapter_a, dense_base, settings):
    """support-bot: r1 pending, r2 approved and live, r3 failed on a long tensor name, r4 approved, r5 exported;
    18 more aliases, keys, audit events; a node serving the base model. Owner and approver can sign in."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    for role in ("owner", "approver", "viewer"):
        user = tenant_a.users[role]
        user.set_password(PASSWORD)
        user.save(update_fields=["password"])
    node = ServingNodeFactory(
        name="node-with-a-rather-long-name-01",
        base_model=dense_base,
        cpu_slots=8,
        gpu_slots=4,
        last_heartbeat_at=timezone.now(),
    )
    cat = fill(tenant_a, adapter_a, node)
    AdapterRevision.objects.filter(id=cat.failed.id).update(
        failure_reason=f"{LONG_TENSOR} has shape [4096, 99]; the base model wants [4096, 16]."
    )
    newer = AdapterRevision.objects.create(adapter=adapter_a, number=4, state="approved", source_uri="x")
    AdapterRevision.objects.create(adapter=adapter_a, number=5, state="exported", source_uri="x")
    adapter_a.revision_counter = 5
    adapter_a.save(update_fields=["revision_counter"])
    for i in range(18):
        Alias.objects.create(adapter=adapter_a, name=f"a{i}", revision=cat.approved, previous_revision=cat.approved)
    for name in ("training-pipeline-for-the-nightly-run", "inference"):
        api_key_create(
            tenant=tenant_a.tenant,
            name=name,
            scopes=["inference", "pipeline", "deploy"],
            created_by=tenant_a.users["owner"],
            by=Actor.system(),
        )
    audit_record(
        tenant=tenant_a.tenant,
        actor=Actor(user=tenant_a.users["owner"]),
        action="alias.activate",
        target="alias:support-bot:production",
        before={"revision": None},
        after={"revision": "r2"},
    )
    cat.newer = newer
    yield cat
    from mint_site.celery import app

    app.control.purge()  # activations queued a convergence task for a worker this test never starts


@pytest.fixture
def chromium(launch_browser):
    """Starts Debian's Chromium when called (after the set-up's ORM calls: see conftest.launch_browser)."""
    return launch_browser


def pages_of(web: str) -> list[str]:
    return [
        f"{web}/",
        f"{web}/adapters/support-bot/",
        f"{web}/adapters/support-bot/revisions/3/",
        f"{web}/nodes/",
        f"{web}/audit/",
        f"{web}/keys/",
        f"{web}/usage/",
    ]


def open_page(chromium, web: str, username: str, viewport: dict):
    browser = chromium()
    context = browser.new_context(viewport=viewport)
    page = context.new_page()
    sign_in(page, web, username)
    return page


def test_back_and_forward_show_the_current_state(catalog, start_web, chromium, tenant_a):
    web = start_web()
    page = open_page(chromium, web, "acme-owner", DESKTOP)
    page.goto(f"{web}/adapters/support-bot/")
    page.wait_for_selector("#live[data-state='on']", timeout=10_000)
    r5 = page.locator("[data-revision='r5']")
    assert r5.locator("[data-revision-state]").inner_text() == "Exported"
    r5.get_by_role("button", name="Request approval").click()
    # The result shows next to the control, in its live region, and focus is there.
    page.wait_for_selector("#result-r5 .msg-success", timeout=10_000)
    assert page.locator("#result-r5").inner_text() == "Approval requested for r5."
    assert page.evaluate("document.activeElement.id") == "result-r5"
    r5_state = "document.querySelector(\"[data-revision='r5'] [data-revision-state]\").textContent.trim()"
    page.wait_for_function(f"{r5_state} === 'Pending approval'")
    page.get_by_role("link", name="Nodes", exact=True).click()
    page.wait_for_url(f"{web}/nodes/")

    # Meanwhile someone else decides: Back must show that, not the page as it was left.
    from adapters import services as adapter_services

    r5_row = AdapterRevision.objects.get(adapter=catalog.adapter, number=5)
    adapter_services.revision_approve(revision=r5_row, by=Actor(user=tenant_a.users["approver"]))
    page.go_back()
    page.wait_for_url(f"{web}/adapters/support-bot/")
    # Auto-waiting assertions: a page restored from the back/forward cache reloads itself (live.js, pageshow).
    expect(page.locator("[data-revision='r5'] [data-revision-state]")).to_have_text("Approved")
    expect(page.locator("[data-revision='r5']").get_by_role("button", name="Request approval")).to_have_count(0)
    expect(page.locator("[data-revision='r5']").get_by_text("Activate…")).to_have_count(1)

    page.go_forward()
    page.wait_for_url(f"{web}/nodes/")
    expect(page.locator("h1")).to_have_text("Serving nodes")
    Placement.objects.filter(revision=catalog.approved).update(state=PlacementState.FAILED)
    page.go_back()
    page.wait_for_url(f"{web}/adapters/support-bot/")
    expect(page.locator("[data-revision='r2'] [data-placement-state]").first).to_have_text("failed")
    navigation = page.evaluate("performance.getEntriesByType('navigation')[0].type")
    assert navigation in ("back_forward", "reload"), navigation


def test_a_form_posted_without_script_lands_next_to_the_control(catalog, start_web, chromium):
    """Post/redirect/get: the result is next to the control, focused; Back never asks to resubmit."""
    web = start_web()
    browser = chromium()
    context = browser.new_context(viewport=DESKTOP, java_script_enabled=True)
    page = context.new_page()
    sign_in(page, web, "acme-owner")
    page.goto(f"{web}/keys/")
    page.get_by_text("Create a key").click()
    page.get_by_label("Name").fill("nightly")
    page.get_by_label("Inference (OpenAI-compatible gateway)").check()
    page.get_by_label("Expires (UTC, optional)").fill("2001-01-01T00:00")
    page.get_by_role("button", name="Create key").click()
    page.wait_for_url(f"{web}/keys/#result-create-key")
    assert "Expires: Choose a moment in the future" in page.locator("#result-create-key").inner_text()
    assert "Choose a moment in the future" in page.locator("#create-key").inner_text()  # and next to the field
    assert page.evaluate("document.activeElement.id") == "result-create-key"
    assert page.get_by_label("Name").input_value() == "nightly"
    page.go_back()  # the page before the POST, fetched again: no "Confirm Form Resubmission"
    page.wait_for_url(f"{web}/keys/")
    assert page.locator("h1").inner_text() == "API keys"


def test_overview_follows_an_activation_without_reload(catalog, start_web, chromium, tenant_a):
    web = start_web()
    page = open_page(chromium, web, "acme-viewer", DESKTOP)
    page.wait_for_selector("#live[data-state='on']", timeout=10_000)
    navigations: list[str] = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))
    row = page.locator("tr[data-adapter='support-bot']")
    assert row.locator("[data-desired]").inner_text().strip() == "= live"

    serving_services.revision_activate(
        adapter=catalog.adapter, revision=catalog.newer, by=Actor(user=tenant_a.users["approver"])
    )
    page.wait_for_function(
        "document.querySelector(\"tr[data-adapter='support-bot'] [data-desired]\").textContent.includes('r4')",
        timeout=8_000,
    )
    assert "pending flip" in row.locator("[data-desired]").inner_text()

    serving_services.alias_flip(adapter=catalog.adapter, revision=catalog.newer)  # an alias.flip event
    page.wait_for_function(
        "document.querySelector(\"tr[data-adapter='support-bot'] [data-live]\").textContent.trim() === 'r4'",
        timeout=3_000,
    )
    # The nodes section re-reads itself every 10 s: its heading stays.
    page.wait_for_timeout(10_500)
    assert page.get_by_role("heading", name="Nodes serving your base models").count() == 1
    assert page.locator("[data-fragment='nodes'] [data-node]").count() == 1
    assert navigations == [], navigations


def test_no_page_scrolls_sideways_at_phone_width(catalog, start_web, chromium, tmp_path):
    web = start_web()
    page = open_page(chromium, web, "acme-owner", PHONE)
    wide = {}
    for url in pages_of(web):
        page.goto(url)
        page.wait_for_load_state("load")
        width = page.evaluate("document.documentElement.scrollWidth")
        if width > PHONE["width"]:
            wide[url] = width
        name = url.removeprefix(web).strip("/").replace("/", "-") or "overview"
        screenshot(page, tmp_path, f"phone-{name}")
    assert wide == {}, f"pages wider than {PHONE['width']} px: {wide}"
    # A table wider than the screen scrolls in its own box, which says so.
    page.goto(f"{web}/nodes/")
    box = page.locator(".scroll").first
    assert page.evaluate("(b) => b.scrollWidth > b.clientWidth", box.element_handle())
    assert box.get_attribute("data-overflowing") == ""
    # The keys page shows Revoke within the screen.
    page.goto(f"{web}/keys/")
    revoke = page.get_by_text("Revoke…").first.bounding_box()
    assert revoke["x"] + revoke["width"] <= PHONE["width"]


def _axe(page) -> list[dict]:
    page.add_script_tag(path=str(AXE))
    result = page.evaluate(
        "(rules) => axe.run(document, {runOnly: {type: 'rule', values: rules}, resultTypes: ['violations']})",
        AXE_RULES,
    )
    ran = {r["id"] for kind in ("passes", "violations", "incomplete", "inapplicable") for r in result[kind]}
    assert ran == set(AXE_RULES), set(AXE_RULES) ^ ran  # every rule ran (a misspelt one would not)
    assert any(r["id"] == "color-contrast" for r in result["passes"]), "no text was checked for contrast"
    return [
        {"rule": v["id"], "nodes": [n["target"] for n in v["nodes"]][:5], "help": v["help"]}
        for v in result["violations"]
    ]


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_axe_rules_for_labels_contrast_and_aria_pass_on_every_page(catalog, start_web, chromium, viewport):
    web = start_web()
    page = open_page(chromium, web, "acme-owner", viewport)
    # The check itself finds what it looks for: an unlabelled field, grey on grey, a broken reference.
    page.set_content(
        '<main><input id="q"><p style="color:#aaa;background:#bbb">faint</p><p aria-describedby="gone">x</p>'
        '<div role="button" aria-pressed="maybe">b</div></main>'
    )
    assert {v["rule"] for v in _axe(page)} >= {"label", "color-contrast", "aria-valid-attr-value"}
    found = {}
    for url in [*pages_of(web), f"{web}/login/"]:
        if url.endswith("/login/"):
            page.context.clear_cookies()
        page.goto(url)
        page.wait_for_load_state("load")
        for details in page.locator("details.confirm").all()[:3]:  # the confirmations' forms, too
            details.evaluate("(d) => { d.open = true; }")
        violations = _axe(page)
        if violations:
            found[url] = violations
    assert found == {}, found


# The contrast of the focus ring against the colour around it (WCAG 1.4.11: at least 3:1).
FOCUS_CONTRAST = """() => {
  const rgb = (c) => (c.match(/[\\d.]+/g) || []).slice(0, 3).map(Number);
  const lum = (c) => {
    const [r, g, b] = rgb(c).map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const background = (el) => {
    for (let e = el.parentElement; e; e = e.parentElement) {
      const bg = getComputedStyle(e).backgroundColor;
      if (bg && !bg.startsWith("rgba(0, 0, 0, 0)") && bg !== "transparent") return bg;
    }
    return "rgb(255, 255, 255)";
  };
  const el = document.activeElement;
  const style = getComputedStyle(el);
  const ring = style.outlineColor, around = background(el);
  const [a, b] = [lum(ring), lum(around)].sort((x, y) => y - x);
  return {tag: el.tagName, width: parseFloat(style.outlineWidth), style: style.outlineStyle, ring, around,
          ratio: (a + 0.05) / (b + 0.05)};
}"""


def test_focus_ring_stands_out_against_its_background(catalog, start_web, chromium):
    web = start_web()
    page = open_page(chromium, web, "acme-owner", DESKTOP)
    page.goto(f"{web}/adapters/support-bot/")
    seen = []
    for _ in range(40):  # through the header (dark) and into the page (light)
        page.keyboard.press("Tab")
        ring = page.evaluate(FOCUS_CONTRAST)
        seen.append(ring)
        assert ring["style"] != "none" and ring["width"] >= 2, ring
        assert ring["ratio"] >= 3, ring
    assert {r["tag"] for r in seen} >= {"A", "BUTTON"}


def test_a_stalled_activation_says_why_and_can_be_cancelled(catalog, start_web, chromium, tenant_a, tmp_path):
    """No node of the base model is up: the alias row, the revision and the overview say so; Cancel withdraws it."""
    from serving.models import NodeState, ServingNode

    ServingNode.objects.filter(id=catalog.node.id).update(state=NodeState.DOWN)
    serving_services.revision_activate(
        adapter=catalog.adapter, revision=catalog.newer, by=Actor(user=tenant_a.users["approver"])
    )
    web = start_web()
    page = open_page(chromium, web, "acme-approver", DESKTOP)
    overview = page.locator("tr[data-adapter='support-bot'] [data-activation]")
    assert overview.get_attribute("data-phase") == "no_node"
    assert "no node" in overview.inner_text().lower()

    page.goto(f"{web}/adapters/support-bot/")
    page.wait_for_selector("#live[data-state='on']", timeout=10_000)
    row = page.locator("#alias-production")
    status = row.locator("[data-activation]")
    assert status.get_attribute("data-phase") == "no_node"
    reason = status.locator("[data-activation-reason]").inner_text()
    assert "test-dense" in reason or "node" in reason.lower(), reason
    assert page.locator("[data-revision='r4'] [data-activation]").count() == 1  # on the revision too
    row.scroll_into_view_if_needed()
    screenshot(page, tmp_path, "stalled-activation")

    row.get_by_text("Cancel activation of r4…").click()
    row.get_by_role("button", name="Confirm cancelling the activation of r4 on production").click()
    page.wait_for_selector("#result-alias-production .msg-success", timeout=10_000)
    assert "production stays on r2" in page.locator("#result-alias-production").inner_text()
    page.wait_for_function("document.querySelectorAll('#alias-production [data-activation]').length === 0")
    alias = Alias.objects.get(adapter=catalog.adapter, name="production")
    assert alias.desired_revision_id == alias.revision_id == catalog.approved.id

    # Activating it again: the confirmation, once opened, warns that it would wait (still no node up).
    r4 = page.locator("[data-revision='r4']")
    r4.get_by_text("Activate…").click()
    expect(r4.locator("[data-room] .warning")).to_contain_text("Before you activate:")
    assert "is up" in r4.locator("[data-room]").inner_text()


def test_a_duplicate_upload_is_refused_naming_the_revision(catalog, start_web, chromium, good_adapter_dir, tmp_path):
    """Pressing Upload again with the same files makes no second revision: the page names the first."""
    web = start_web({"MINT_ARTIFACT_ROOT": str(tmp_path / "artifacts")})
    page = open_page(chromium, web, "acme-owner", DESKTOP)
    page.goto(f"{web}/adapters/support-bot/")
    files = sorted(str(p) for p in good_adapter_dir.iterdir())
    result = page.locator("#result-register")

    def upload() -> None:
        if page.locator("#register[open]").count() == 0:
            page.locator("#register summary").click()
        page.set_input_files("#reg-files", files)
        page.get_by_role("button", name="Upload and register").click()

    upload()
    expect(result.locator(".msg-success")).to_contain_text("r6 registered", timeout=15_000)
    upload()
    expect(result.locator(".msg-error")).to_contain_text("identical to r6 of support-bot", timeout=15_000)
    assert AdapterRevision.objects.filter(adapter=catalog.adapter).count() == 6
