"""A training run's reward curve on the adapter page, in a real browser (Debian's Chromium) against the ASGI server.

No engine: the run's revisions are rows as a trainer's pushes leave them. The panel loads on its own, uPlot draws
one chart per metric (the reward first) from the run's steps in step order, the parent chain of the newest step
links back through the run, and a step pushed meanwhile (its `revision.state` event) is drawn without a reload.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from adapters.models import AdapterRevision
from mint_site.events import live_event
from tests.e2e.test_dashboard import sign_in
from tests.factories import PASSWORD

pytestmark = [pytest.mark.e2e]


def step(adapter, number, parent=None, **metrics):
    return AdapterRevision.objects.create(
        adapter=adapter,
        number=number,
        state="exported",
        source_uri="x",
        run="grpo-7",
        training_step=number * 100,
        parent=parent,
        metrics=metrics,
    )


def test_the_adapter_page_draws_the_runs_reward_curve_and_follows_new_steps(
    tenant_a, adapter_a, start_web, launch_browser, settings
):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    viewer = tenant_a.users["viewer"]
    viewer.set_password(PASSWORD)
    viewer.save(update_fields=["password"])
    parent = None
    for number, reward in ((1, 0.1), (2, 0.25), (3, 0.4)):
        parent = step(adapter_a, number, parent=parent, reward=reward, loss=2.0 - reward)

    web = start_web()
    page = launch_browser().new_context(viewport={"width": 1280, "height": 900}).new_page()
    sign_in(page, web, viewer.get_username())
    page.goto(f"{web}/adapters/support-bot/")
    reward = "[data-run-chart='reward']"
    page.wait_for_selector(f"{reward}[data-points='3']", timeout=15_000)

    assert page.locator(reward).get_attribute("data-last") == "0.4"
    box = page.locator(f"{reward} canvas").first.bounding_box()
    assert box is not None and box["width"] > 100 and box["height"] > 50
    assert page.locator("[data-run-chart='loss']").count() == 1
    assert "reward of run grpo-7 over 3 steps, from 0.1 to 0.4" in page.locator(reward).get_attribute("aria-label")
    chain = page.locator("[data-parent-chain] a")
    expect(chain).to_have_text(["r3", "r2", "r1"])

    # The trainer pushes step 4: its export's event re-reads the panel, and the curve grows.
    r4 = step(adapter_a, 4, parent=parent, reward=0.55)
    live_event(
        tenant_id=tenant_a.tenant.id,
        type="revision.state",
        id=r4.id,
        state="exported",
        updated_us=0,
        adapter="support-bot",
        revision="r4",
    )
    page.wait_for_selector(f"{reward}[data-points='4']", timeout=15_000)
    assert page.locator(reward).get_attribute("data-last") == "0.55"
    expect(chain).to_have_text(["r4", "r3", "r2", "r1"])
