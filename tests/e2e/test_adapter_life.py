"""An adapter's whole life in Chromium, without the API: a developer creates the adapter on the overview and uploads
a revision; an approver approves and activates it, tries it in the playground, deactivates the alias, archives
the revision and deletes the adapter. Real web server, Celery worker with beat, vLLM CPU node.

Between the steps, what a client sees through the gateway (the official `openai` client): the answer names its
revision (`X-Mint-Revision`), a chat without max_tokens answers on a node of max_model_len 512, and a deactivated
alias is 404 model_not_found. And at 1280 px, the keys table keeps "Expires" on one line and the audit log fits.
"""

from __future__ import annotations

import time

import openai
import pytest

from adapters.models import Adapter, AdapterRevision
from serving.models import Alias, NodeState, Placement, ServingNode, UsageKind, UsageRecord
from tenants.access import Actor
from tenants.services import audit_record
from tests.e2e.conftest import make_peft_adapter
from tests.e2e.test_dashboard import sign_in
from tests.e2e.world import session_node, wait
from tests.factories import PASSWORD

pytestmark = [pytest.mark.e2e, pytest.mark.engine]


def click_confirm(card, summary: str, button: str) -> None:
    card.get_by_text(summary, exact=False).first.click()
    card.get_by_role("button", name=button).click()


def test_the_whole_life_of_an_adapter_in_the_dashboard(
    tenant_a, engine, tiny_llama_dir, tmp_path, artifact_root, start_worker, start_web, settings, launch_browser
):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    for role in ("developer", "approver", "owner"):
        user = tenant_a.users[role]
        user.set_password(PASSWORD)
        user.save(update_fields=["password"])
    env = {"MINT_ARTIFACT_ROOT": str(artifact_root), "MINT_HEARTBEAT_S": "1"}
    _, node = session_node(engine, tiny_llama_dir, tmp_path)
    start_worker("control", "node.e2e", extra_env=env, beat=True)
    web = start_web(env)
    wait(lambda: ServingNode.objects.get(id=node.id).state == NodeState.UP, timeout=30, what="heartbeat")
    wait(lambda: ServingNode.objects.get(id=node.id).max_model_len == 512, timeout=30, what="the node's window")
    peft = make_peft_adapter(tiny_llama_dir, tmp_path / "peft-1", seed=1)

    browser = launch_browser()
    # ---------------------------------------------------------------- the developer: create, upload
    developer = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    sign_in(developer, web, "acme-developer")
    developer.evaluate("document.getElementById('create').open = true")  # open when the tenant has no adapter yet
    developer.locator("#create-name").fill("ux-bot")
    developer.locator("#create-description").fill("Replies in the UX study")
    developer.get_by_role("button", name="Create adapter").click()
    developer.wait_for_url(f"{web}/adapters/ux-bot/#register")
    assert "Adapter ux-bot created on tiny-llama" in developer.locator("#result-register").inner_text()
    developer.locator("#reg-files").set_input_files([str(p) for p in sorted(peft.iterdir()) if p.is_file()])
    developer.get_by_role("button", name="Upload and register").click()
    developer.wait_for_selector("#result-register .msg-success", timeout=30_000)
    adapter = Adapter.objects.get(tenant=tenant_a.tenant, name="ux-bot")
    wait(
        lambda: AdapterRevision.objects.filter(adapter=adapter, number=1, state="exported").exists(),
        timeout=120,
        what="r1 exported",
    )
    developer.goto(f"{web}/adapters/ux-bot/revisions/1/")
    developer.get_by_role("button", name="Request approval").click()
    developer.wait_for_selector("#result-r1 .msg-success", timeout=10_000)

    # ---------------------------------------------------------------- the approver: approve, activate, try it
    approver = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    sign_in(approver, web, "acme-approver")
    approver.goto(f"{web}/adapters/ux-bot/revisions/1/")
    card = approver.locator("[data-revision='r1']")
    click_confirm(card, "Approve…", "Confirm approval of r1")
    approver.wait_for_selector("#result-r1 .msg-success", timeout=10_000)
    approver.reload()
    card = approver.locator("[data-revision='r1']")
    click_confirm(card, "Activate…", "Confirm activation of r1")
    approver.wait_for_selector("#result-r1 .msg-success", timeout=10_000)
    wait(
        lambda: Alias.objects.filter(adapter=adapter, name="production", revision__number=1).exists(),
        timeout=120,
        what="production serves r1",
    )
    approver.reload()
    approver.get_by_label("Prompt").fill("Hello there")
    approver.get_by_role("button", name="Send to r1").click()
    approver.wait_for_selector("#result-playground .msg-success", timeout=60_000)
    assert "r1 answered (" in approver.locator("#result-playground").inner_text()
    wait(
        lambda: UsageRecord.objects.filter(
            tenant=tenant_a.tenant, kind=UsageKind.INFERENCE, adapter_name="ux-bot", revision=1, status=200
        ).exists(),
        timeout=10,
        what="the playground metered",
    )

    # What a client sees meanwhile, with the official client.
    _, token = tenant_a.key("inference")
    client = openai.OpenAI(base_url=f"{web}/v1", api_key=token, max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model="ux-bot", messages=[{"role": "user", "content": "Hi"}]
    )  # no max_tokens: bounded by the node's window (512), not refused for the plan's 4096
    assert raw.http_response.status_code == 200 and raw.headers["x-mint-revision"] == "r1"
    assert raw.parse().choices[0].message.content is not None
    streamed = client.completions.with_raw_response.create(model="ux-bot", prompt="Hi", max_tokens=4, stream=True)
    assert streamed.headers["x-mint-revision"] == "r1"
    assert list(streamed.parse())

    # ---------------------------------------------------------------- retire: deactivate, archive, delete
    approver.goto(f"{web}/adapters/ux-bot/")
    click_confirm(approver.locator("#alias-production"), "Deactivate production…", "Confirm deactivating production")
    approver.wait_for_selector("#result-aliases .msg-success", timeout=10_000)
    assert "requests for ux-bot now answer 404 model_not_found" in approver.locator("#result-aliases").inner_text()
    # The gateway drops its routes on the deactivation's event, not when they expire (MINT_GATEWAY_FOLLOWED_CACHE_S,
    # 30 s): the alias is 404 within moments of the page saying so.
    deadline, missing = time.monotonic() + 5, None
    while missing is None and time.monotonic() < deadline:
        try:
            client.completions.create(model="ux-bot", prompt="Hi", max_tokens=2)
        except openai.NotFoundError as exc:
            missing = exc
        else:
            time.sleep(0.2)
    assert missing is not None and missing.code == "model_not_found"
    r1 = AdapterRevision.objects.get(adapter=adapter, number=1)
    wait(lambda: not Placement.objects.filter(revision=r1).exists(), timeout=60, what="r1 off the node")

    approver.goto(f"{web}/adapters/ux-bot/revisions/1/")
    click_confirm(approver.locator("[data-revision='r1']"), "Archive r1…", "Confirm archiving r1")
    approver.wait_for_selector("#result-r1 .msg-success", timeout=10_000)
    wait(lambda: AdapterRevision.objects.get(id=r1.id).state == "archived", timeout=5, what="r1 archived")
    assert not (artifact_root / r1.export_uri).exists()

    approver.goto(f"{web}/adapters/ux-bot/")
    approver.get_by_text("Settings: description, tags, retention, deletion").click()
    approver.get_by_text("Delete ux-bot…").click()
    approver.locator("#delete-confirm").fill("ux-bot")
    approver.get_by_role("button", name="Delete ux-bot for good").click()
    approver.wait_for_url(f"{web}/#result-create")
    assert "Adapter ux-bot deleted; its revisions were archived" in approver.locator("#result-create").inner_text()
    assert not Adapter.objects.filter(id=adapter.id).exists()
    assert Adapter.all_objects.get(id=adapter.id).deleted_at is not None


@pytest.mark.e2e
def test_keys_and_audit_pages_fit_1280_px(tenant_a, start_web, settings, launch_browser, adapter_a):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    owner = tenant_a.users["owner"]
    owner.set_password(PASSWORD)
    owner.save(update_fields=["password"])
    tenant_a.key("inference")
    for n in range(5):  # long before/after values, as real events have
        audit_record(
            tenant=tenant_a.tenant,
            actor=Actor(user=owner),
            action="revision.request_approval",
            target=f"revision:support-bot@r{n}",
            before={"state": "exported", "policy": "x" * 120},
            after={"state": "pending_approval", "comment": "a long comment " * 12, "source": "t/1/a/2/" + "b" * 80},
        )
    web = start_web({})
    page = launch_browser().new_context(viewport={"width": 1280, "height": 900}).new_page()
    sign_in(page, web, "acme-owner")
    page.goto(f"{web}/keys/")
    lines = page.evaluate(
        """() => Array.from(document.querySelectorAll('table.keys thead th'))
             .filter(th => !th.querySelector('.visually-hidden')).map(th => {
             const range = document.createRange(); range.selectNodeContents(th);
             const tops = Array.from(range.getClientRects()).map(r => Math.round(r.top));
             return [th.textContent.trim(), new Set(tops).size];
           })"""
    )
    assert ["Expires", 1] in lines and all(count <= 1 for _, count in lines), lines
    page.goto(f"{web}/audit/")
    fits = page.evaluate(
        """() => { const box = document.querySelector('table.audit').closest('.scroll');
                   const after = document.querySelector('table.audit thead th:last-child').getBoundingClientRect();
                   return [box.scrollWidth <= box.clientWidth + 1, after.right <= window.innerWidth]; }"""
    )
    assert fits == [True, True]
