"""The dashboard in a real browser (Chromium via Playwright) against the web server, a Celery worker and vLLM.

An approver signs in, approves a pending revision, activates it, and watches its placement go
queued → loading → warming → ready and the alias flip without reloading the page; then rolls
back. A viewer sees no action buttons. Screenshots go to the test's tmp dir, and to
MINT_SCREENSHOT_DIR when set: `dashboard.png` (mid-prewarm) is the README's docs/dashboard.png.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from adapters.models import AdapterRevision
from serving.models import Alias, Placement, PrewarmTurn
from serving.services import outbox
from tests.e2e.world import register_peft_revisions, wait
from tests.factories import PASSWORD

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

PHASE_DELAY_MS = 1500  # each prewarm phase is held this long, so every state is on screen for a while
QUEUED_HOLD_S = 3
LIVE_LATENCY_S = 1.0  # a change must show on the page within this long after its commit

# Records each distinct state the badge of r<n>'s first placement shows, with the browser's clock.
WATCH = """(label) => {
  window.__states = [];
  const read = () => {
    const article = document.querySelector(`[data-revision="${label}"]`);
    const badge = article && article.querySelector("[data-placement-state]");
    const state = badge ? badge.textContent.trim() : null;
    const last = window.__states[window.__states.length - 1];
    if (state && (!last || last.state !== state)) window.__states.push({state, at: Date.now()});
  };
  new MutationObserver(read).observe(document.body, {subtree: true, childList: true, characterData: true});
  read();
}"""


def screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    target = os.environ.get("MINT_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)
    return path


def sign_in(page, web: str, username: str) -> None:
    page.goto(f"{web}/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{web}/")


def test_approver_approves_activates_watches_prewarm_and_rolls_back(
    tenant_a,
    tiny_llama_dir,
    artifact_root,
    tmp_path,
    make_serving_world,
    settings,
    launch_browser,
):
    # The server checks passwords with the real hasher, not the suite's fast one.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    for role in ("approver", "viewer"):
        user = tenant_a.users[role]
        user.set_password(PASSWORD)
        user.save(update_fields=["password"])

    env = {
        "MINT_ARTIFACT_ROOT": str(artifact_root),
        "MINT_HEARTBEAT_S": "1",
        "MINT_TEST_PREWARM_DELAY_MS": str(PHASE_DELAY_MS),
        # The pacing pause after a prewarm (held phases make it the longest) keeps r2 queued for a while.
        "MINT_NODE_PREWARM_DUTY": "0.02",
        "MINT_NODE_PREWARM_MAX_GAP_S": str(QUEUED_HOLD_S),
    }
    world = make_serving_world(tenant_a.tenant, env)
    adapter = world.adapter
    pipeline, approver_api = tenant_a.client_as("key:pipeline"), tenant_a.client_as("approver")
    register_peft_revisions(world, pipeline, tiny_llama_dir, tmp_path)
    # r1 goes live through the API first, so that there is something to roll back to.
    for number in (1, 2):
        assert pipeline.post(f"/api/v1/adapters/support-bot/revisions/{number}/request-approval/").status_code == 200
    assert approver_api.post("/api/v1/adapters/support-bot/revisions/1/approve/", {}, format="json").status_code == 200
    assert (
        approver_api.post("/api/v1/adapters/support-bot/activate/", {"revision": "r1"}, format="json").status_code
        == 200
    )
    r1, r2 = (AdapterRevision.objects.get(adapter=adapter, number=n) for n in (1, 2))
    wait(lambda: Alias.objects.get(adapter=adapter).revision_id == r1.id, timeout=60, what="r1 live", logs=world.logs)

    browser = launch_browser()
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    sign_in(page, world.web, "acme-approver")
    assert page.locator("[data-adapter='support-bot']").count() >= 1
    page.get_by_role("link", name="support-bot").click()
    page.wait_for_selector("#live[data-state='on']", timeout=10_000)

    # Approve r2 (pending) with the two-step confirmation.
    r2_card = page.locator("[data-revision='r2']")
    r2_card.get_by_text("Approve…").click()
    r2_card.get_by_role("button", name="Confirm approval of r2").click()
    # The result shows next to the control that was used (its live region), and focus moves there.
    page.wait_for_selector("#result-r2 .msg-success", timeout=10_000)
    assert "r2 of support-bot approved." in page.locator("#result-r2").inner_text()
    assert page.evaluate("document.activeElement.id") == "result-r2"
    page.wait_for_function(
        "document.querySelector(\"[data-revision='r2'] [data-revision-state]\").textContent.trim() === 'Approved'",
        timeout=5_000,
    )

    # Activate r2 and watch its placement move, without reloading the page.
    navigations = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))
    page.evaluate(WATCH, "r2")
    # r1's prewarm has just ended, as far as pacing knows: r2 stays queued for QUEUED_HOLD_S, so the
    # page shows "queued" however the activation's own re-fetch and its events race to the browser.
    # (Pacing reads the tenant's PrewarmTurn on the node, which r1's prewarm wrote: its pause restarts now.)
    r1_ended = timezone.now()
    PrewarmTurn.objects.filter(node=world.node, tenant=tenant_a.tenant).update(
        resting_until=r1_ended + timedelta(seconds=QUEUED_HOLD_S)
    )
    r2_card = page.locator("[data-revision='r2']")
    r2_card.get_by_text("Activate…").click()
    r2_card.get_by_role("button", name="Confirm activation of r2").click()
    # Mid-way: the placement's phase and how long it has been in it.
    page.wait_for_function("() => (window.__states || []).some(s => s.state === 'warming')", timeout=60_000)
    screenshot(page, tmp_path, "dashboard")  # the README's docs/dashboard.png
    wait(
        lambda: Alias.objects.get(adapter=adapter).revision_id == r2.id, timeout=60, what="flip to r2", logs=world.logs
    )
    page.wait_for_function(
        "() => (window.__states || []).some(s => s.state === 'ready')", timeout=int(LIVE_LATENCY_S * 1000) + 2_000
    )
    page.wait_for_selector("[data-revision='r2'] .live-tag", timeout=5_000)
    states = page.evaluate("() => window.__states")
    seen = [s["state"] for s in states]
    assert seen == ["queued", "loading", "warming", "ready"], f"{seen}\n{console}"
    assert navigations == [], navigations
    assert not [m for m in console if m.startswith("error")], console

    # Each state showed within LIVE_LATENCY_S of its commit (timestamps from the same machine's clock).
    placement = Placement.objects.get(revision=r2)
    # Pacing held r2 until the gap after r1's prewarm had passed, however long the click itself took.
    held = (placement.started_at - r1_ended).total_seconds()
    assert held >= QUEUED_HOLD_S - 0.25, f"r2 was admitted {held:.2f}s after r1's prewarm: pacing did not hold it"
    shown = {s["state"]: s["at"] / 1000 for s in states}
    for state, committed in (("warming", placement.loaded_at), ("ready", placement.ready_at)):
        lag = shown[state] - committed.timestamp()
        assert lag < LIVE_LATENCY_S, f"{state} showed {lag:.2f}s after it happened"
    lags = {
        s: round(shown[s] - t.timestamp(), 3)
        for s, t in (("warming", placement.loaded_at), ("ready", placement.ready_at))
    }
    print(f"dashboard: placement states {seen}, lag after commit {lags}")

    # An event older than what the page shows (sent by another process, or overtaken by a fragment
    # rendered since) leaves the badge alone; the refresh it triggers shows the same state.
    page.evaluate(WATCH, "r2")
    r2 = AdapterRevision.objects.select_related("adapter").get(id=r2.id)
    stale = dict(state="loading", updated_at=placement.started_at, revision=r2, node=placement.node)
    outbox.placement_event(placement.id, **stale)
    page.wait_for_timeout(LIVE_LATENCY_S * 1000)
    assert [s["state"] for s in page.evaluate("() => window.__states")] == ["ready"]
    page.locator("[data-revision='r2']").scroll_into_view_if_needed()
    screenshot(page, tmp_path, "ready")

    # Roll back: r1 is still loaded, so production flips back at once; the page shows it live.
    page.get_by_text("Roll back production to r1…").click()
    page.get_by_role("button", name="Confirm rollback of production to r1").click()
    wait(lambda: Alias.objects.get(adapter=adapter).revision_id == r1.id, timeout=15, what="rollback", logs=world.logs)
    page.wait_for_selector("[data-revision='r1'] .live-tag", timeout=5_000)
    # The alias card is a fragment of its own, refreshed by the same event as the revision's row, not with it.
    page.wait_for_function(
        "() => document.querySelector('[data-alias-live]')?.innerText.trim() === 'r1'", timeout=5_000
    )
    assert page.locator("[data-alias-live]").inner_text().strip() == "r1"
    assert navigations == [], navigations

    # The overview and nodes pages show the tiers.
    page.goto(f"{world.web}/")
    assert page.locator("[data-adapter='support-bot'] [data-readiness]").inner_text() == "ready"
    screenshot(page, tmp_path, "overview")
    page.goto(f"{world.web}/nodes/")
    assert "2 / 8" in page.locator("[data-node='e2e']").first.inner_text()
    screenshot(page, tmp_path, "nodes")
    context.close()

    # A viewer sees the same adapter, live, with no action buttons at all.
    viewer = browser.new_context(viewport={"width": 820, "height": 1100})  # tablet width
    vpage = viewer.new_page()
    sign_in(vpage, world.web, "acme-viewer")
    vpage.goto(f"{world.web}/adapters/support-bot/")
    vpage.wait_for_selector("#live[data-state='on']", timeout=10_000)
    assert vpage.locator("[data-revision]").count() == 2
    assert vpage.locator("[data-action]").count() == 0
    assert vpage.locator("form[data-enhance]").count() == 0
    assert vpage.get_by_text("Approve…").count() == 0 and vpage.get_by_text("Roll back").count() == 0
    screenshot(vpage, tmp_path, "viewer")
    viewer.close()
