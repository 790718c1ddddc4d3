"""The dashboard alone runs an adapter's whole life: create it from the overview, edit its words, set retention (and
see its dry run), deactivate an alias, archive and restore revisions, download their files, compare two, draw the
lineage, try one in the playground, delete the adapter. Promote and Abort ask first. Real PostgreSQL and Redis."""

from __future__ import annotations

import re
from unittest import mock

import pytest
from django.core import signing
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision, Evaluation, EvaluationSuite
from serving.models import Alias, Placement, PlacementState, UsageKind, UsageRecord
from tenants.models import AuditEvent, Tenant
from tests.adapters.corpus import TINY_DENSE, write_lora_adapter
from tests.adapters.fixtures import uploads_of
from tests.serving.sent_tasks import NODE_TASKS, recorded

pytestmark = pytest.mark.django_db

PAGE = "/adapters/support-bot/"


def push(tenant, directory, capture, **fields) -> AdapterRevision:
    with capture(execute=True):
        response = tenant.client_as("key:pipeline").post(
            "/api/v1/adapters/support-bot/revisions/",
            {"files": uploads_of(directory), "allow_duplicate": "true", **fields},
            format="multipart",
        )
    assert response.status_code == 201, response.content
    return AdapterRevision.objects.get(adapter__name="support-bot", number=response.json()["number"])


def text_of(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def message_of(client, url: str) -> str:
    """The page at `url` as the next request shows it, with the messages an action left there."""
    return text_of(client.get(url))


@pytest.fixture(autouse=True)
def _fast_writes(tenant_a):
    Tenant.objects.filter(id=tenant_a.tenant.id).update(api_write_rpm=100_000)


def test_an_adapter_is_created_from_the_overview(as_role, tenant_a, dense_base):
    developer = as_role("developer")
    overview = text_of(developer.get("/"))
    assert "Create an adapter" in overview and 'value="test-dense"' in overview

    response = developer.post(
        "/create-adapter/", {"name": "ux-bot", "base_model": "test-dense", "description": "Replies", "tenant": "acme"}
    )

    assert response.status_code == 302 and response["Location"] == "/adapters/ux-bot/#register"
    adapter = Adapter.objects.get(tenant=tenant_a.tenant, name="ux-bot")
    assert adapter.description == "Replies" and adapter.created_by == tenant_a.users["developer"]
    assert "Adapter ux-bot created on test-dense" in message_of(developer, "/adapters/ux-bot/")
    again = developer.post("/create-adapter/", {"name": "ux-bot", "base_model": "test-dense"})
    assert again["Location"] == "/#result-create"
    assert "already exists" in message_of(developer, "/")
    bad = developer.post("/create-adapter/", {"name": "Bad Name", "base_model": "test-dense"})
    assert bad.status_code == 302 and "Name: Use 1-64 lowercase letters" in message_of(developer, "/")
    assert as_role("viewer").post("/create-adapter/", {"name": "v", "base_model": "test-dense"}).status_code == 403
    assert "Create an adapter" not in text_of(as_role("viewer").get("/"))


def test_description_tags_and_retention_are_set_from_the_adapter_page(as_role, catalog_a):
    developer = as_role("developer")
    edited = developer.post(f"{PAGE}edit/", {"description": "Tier 1", "tags": "support, EN"})
    assert edited.status_code == 302
    adapter = Adapter.objects.get(id=catalog_a.adapter.id)
    assert adapter.description == "Tier 1" and adapter.tags == ["en", "support"]
    assert developer.post(f"{PAGE}retention/", {"keep_last": "1"}).status_code == 403  # a decider's setting

    approver = as_role("approver")
    approver.post(f"{PAGE}retention/", {"keep_last": "1", "grace_days": "0"})
    assert "Retention saved: keeps the newest 1" in message_of(approver, PAGE)
    preview = text_of(approver.get(f"{PAGE}?fragment=retention"))
    # r2 is live (named); r1 pending; r3 failed: nothing to archive, and why each is kept.
    assert "this adapter's own" in preview and "nothing to archive now" in preview
    assert "r2: one of the 1 newest" in preview and "r1: awaiting approval" in preview
    assert AuditEvent.objects.filter(action="adapter.retention").count() == 1


def test_an_alias_is_deactivated_from_its_confirmation(as_role, catalog_a):
    approver = as_role("approver")
    page = text_of(approver.get(PAGE))
    assert re.search(r'<details class="confirm"> <summary class="button danger">Deactivate production…', page)
    assert "Deactivate production" not in text_of(as_role("developer").get(PAGE))
    assert as_role("developer").post(f"{PAGE}deactivate/", {"alias": "production"}).status_code == 403

    response = approver.post(f"{PAGE}deactivate/", {"alias": "production", "next": PAGE})

    assert response.status_code == 302
    assert not Alias.objects.filter(adapter=catalog_a.adapter).exists()
    shown = message_of(approver, PAGE)
    assert "production deactivated: requests for support-bot now answer 404 model_not_found" in shown


def test_promote_and_abort_ask_for_confirmation(as_role, catalog_a):
    r4 = AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    Alias.objects.filter(adapter=catalog_a.adapter).update(
        canary_revision=r4, canary_percent=10, canary_started_at=timezone.now()
    )
    page = text_of(as_role("approver").get(PAGE))
    assert re.search(r'<details class="confirm"> <summary class="button primary">Promote r4 on production…', page)
    assert re.search(r'<details class="confirm"> <summary class="button danger">Abort the canary…', page)
    # The buttons that act are inside the confirmations, not on the page itself.
    for action in ("promote", "abort"):
        button = page.index(f'data-action="{action}"')
        assert page.rfind("<details", 0, button) > page.rfind("</details>", 0, button)


def test_archive_and_restore_from_the_revision_page(as_role, catalog_a, artifact_root):
    approver = as_role("approver")
    live = text_of(approver.get(f"{PAGE}revisions/2/"))
    assert "Archive r2…" in live and "An alias names r2" in live
    refused = approver.post(f"{PAGE}revisions/2/archive/", {})
    assert refused.status_code == 302
    assert "named by alias production (live)" in message_of(approver, f"{PAGE}revisions/2/")
    assert as_role("developer").post(f"{PAGE}revisions/1/archive/", {}).status_code == 403

    approver.post(f"{PAGE}revisions/1/archive/", {})

    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "archived"
    page = message_of(approver, f"{PAGE}revisions/1/")
    assert "r1 archived: its files are removed" in page and "Restore r1" in page
    approver.post(f"{PAGE}revisions/1/restore/", {})
    assert "its source was removed when it was archived" in message_of(approver, f"{PAGE}revisions/1/")


def test_keep_is_marked_from_the_revision_page(as_role, catalog_a):
    developer = as_role("developer")
    developer.post(f"{PAGE}revisions/1/keep/", {"keep": "on"})
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).keep is True
    assert "Unmark keep" in text_of(developer.get(f"{PAGE}revisions/1/"))
    developer.post(f"{PAGE}revisions/1/keep/", {"keep": "off"})
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).keep is False


def test_exported_files_download_by_a_fresh_expiring_link(
    as_role, tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks, settings
):
    revision = push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    viewer = as_role("viewer")
    page = text_of(viewer.get(f"{PAGE}revisions/{revision.number}/"))
    name = revision.policy_record["files"][0]["name"]
    assert f'data-download="{name}"' in page

    link = viewer.get(f"{PAGE}revisions/{revision.number}/files/{name}")

    assert link.status_code == 302 and link["Location"].startswith("http://testserver/api/v1/downloads/")
    anonymous = page_client_anonymous()
    served = anonymous.get(link["Location"])  # the link is the capability: no session needed
    assert served.status_code == 200
    assert b"".join(served.streaming_content) == (artifact_root / revision.export_uri / name).read_bytes()
    assert f"support-bot-r{revision.number}-{name}" in served["Content-Disposition"]
    token = link["Location"].rstrip("/").rsplit("/", 1)[-1]
    forged = signing.dumps({"r": revision.id + 1, "f": name}, salt="another.salt")
    assert anonymous.get(f"/api/v1/downloads/{forged}/").status_code == 404
    assert anonymous.get(f"/api/v1/downloads/{token[:-2]}xx/").status_code == 404
    settings.MINT_DOWNLOAD_LINK_S = 10
    with mock.patch("django.core.signing.time.time", return_value=timezone.now().timestamp() + 60):
        expired = anonymous.get(link["Location"])
    assert expired.status_code == 410 and expired.json()["error"]["code"] == "link_expired"
    assert viewer.get(f"{PAGE}revisions/{revision.number}/files/not-a-file").status_code == 404


def page_client_anonymous():
    from django.test import Client

    return Client()


def test_two_revisions_are_compared_side_by_side(
    as_role, tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks, tmp_path
):
    r1 = push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    wider = write_lora_adapter(tmp_path / "wider", TINY_DENSE, rank=8, alpha=16.0, targets=("q_proj", "k_proj"))
    r2 = push(tenant_a, wider, django_capture_on_commit_callbacks, parent=str(r1.number))
    suite = EvaluationSuite.objects.create(adapter=adapter_a, version=1, cases=[], case_count=0)
    Evaluation.objects.create(revision=r1, suite=suite, state="passed", score=0.5)
    Evaluation.objects.create(revision=r2, suite=suite, state="passed", score=0.75)

    page = text_of(as_role("viewer").get(f"{PAGE}diff/?a=r{r1.number}&b={r2.number}"))

    assert re.search(
        r'data-field="rank" class="changed"><th scope="row">rank <span[^>]*>differs</span></th><td>4</td><td>8</td>',
        page,
    )
    assert re.search(r'data-field="alpha" class="changed">.*?<td>8.0</td><td>16.0</td>', page)
    assert "only in r2" in page and "k_proj" in page  # k_proj is new in r2
    assert re.search(r"q_proj.*?4\xd7\d+ / \d+\xd74.*?8\xd7\d+ / \d+\xd78", page)  # its shapes at rank 4 and rank 8
    assert re.search(r"<td>0.500</td><td>0.750</td>", page)
    norms = re.findall(r"<td>(\d+\.\d{4})</td>", page)
    assert norms and all(float(n) > 0 for n in norms)  # the update each module makes
    lineage = text_of(as_role("viewer").get(f"{PAGE}revisions/{r2.number}/?fragment=lineage"))
    assert f'aria-label="r{r1.number} to r{r2.number}"' in lineage and "Compare r2 with" in lineage
    assert as_role("viewer").get(f"{PAGE}diff/?a=r1&b=r99").status_code == 404


def test_the_playground_answers_from_the_revision_and_meters_it(as_role, tenant_a, catalog_a):
    viewer = as_role("viewer")
    assert "Try r2" in text_of(viewer.get(f"{PAGE}revisions/2/"))
    with mock.patch("serving.services.playground.VllmClient") as client:
        client.return_value.__enter__.return_value.generate.return_value = (
            " a tiny answer",
            {"prompt_tokens": 3, "completion_tokens": 4},
        )
        response = viewer.post(f"{PAGE}revisions/2/playground/", {"prompt": "Hello", "max_tokens": "8"})
        sent = client.return_value.__enter__.return_value.generate.call_args
    assert response.status_code == 302 and response["Location"].endswith("/revisions/2/#playground#result-playground")
    assert sent.kwargs["prompt"] == "Hello" and sent.kwargs["max_tokens"] == 8
    shown = message_of(viewer, f"{PAGE}revisions/2/")
    assert "r2 answered (3 prompt + 4 completion tokens" in shown and "a tiny answer" in shown
    row = UsageRecord.objects.get(period="day", tenant=tenant_a.tenant, revision=2)
    assert (row.kind, row.status, row.requests, row.prompt_tokens, row.completion_tokens) == (
        UsageKind.INFERENCE,
        200,
        1,
        3,
        4,
    )


def test_the_playground_asks_for_a_load_when_the_revision_is_nowhere(as_role, catalog_a):
    r4 = AdapterRevision.objects.create(
        adapter=catalog_a.adapter, number=4, state="approved", source_uri="x", export_uri="e/4"
    )
    viewer = as_role("viewer")
    with recorded(*NODE_TASKS):
        viewer.post(f"{PAGE}revisions/4/playground/", {"prompt": "Hi"})
    assert "r4 is being loaded onto a node; try again in a few seconds" in message_of(viewer, f"{PAGE}revisions/4/")
    assert Placement.objects.filter(revision=r4).exclude(state=PlacementState.FAILED).exists()


def test_failing_cases_show_prompt_reference_and_answer(as_role, catalog_a):
    suite = EvaluationSuite.objects.create(
        adapter=catalog_a.adapter,
        version=1,
        cases=[
            {"prompt": "2+2=", "reference": "4", "grader": "exact"},
            {"messages": [{"role": "user", "content": "Say hi"}], "reference": "hi", "grader": "contains"},
        ],
        case_count=2,
    )
    Evaluation.objects.create(
        revision=catalog_a.approved,
        suite=suite,
        state="failed",
        score=0.0,
        case_count=2,
        case_results=[
            {"case": 1, "passed": False, "score": 0.0, "answer": "5"},
            {"case": 2, "passed": False, "score": 0.0, "answer": "bye"},
        ],
    )
    page = text_of(as_role("viewer").get(f"{PAGE}revisions/2/"))
    assert '<th scope="col">Prompt</th><th scope="col">Reference</th><th scope="col">Answer</th>' in page
    assert re.search(r'data-case-prompt>2\+2=</td><td class="case-text" data-case-reference><code>4</code>', page)
    assert "user: Say hi" in page and "<code>bye</code>" in page


def test_deleting_from_the_page_needs_the_name_typed(as_role, catalog_a):
    approver = as_role("approver")
    assert "Delete support-bot…" in text_of(approver.get(PAGE))
    approver.post(f"{PAGE}delete/", {"confirm_name": "support"})
    assert "Type the adapter&#x27;s name, support-bot, to delete it" in message_of(approver, PAGE)
    approver.post(f"{PAGE}delete/", {"confirm_name": "support-bot"})
    assert "still serves alias production: deactivate it first" in message_of(approver, PAGE)
    approver.post(f"{PAGE}deactivate/", {"alias": "production"})
    done = approver.post(f"{PAGE}delete/", {"confirm_name": "support-bot"})
    assert done["Location"] == "/#result-create"
    assert "Adapter support-bot deleted; 3 revisions archived with it" in message_of(approver, "/")
    assert approver.get(PAGE).status_code == 404
