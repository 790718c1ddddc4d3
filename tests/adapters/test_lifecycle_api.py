"""Register → validate → export → request approval → approve → activate → flip → roll back, through the API."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from adapters.models import Adapter, AdapterRevision, Approval
from mint_site.errors import InvalidTransition
from serving import services as serving_services
from serving.models import Alias
from tenants.access import Actor
from tenants.models import AuditEvent
from tests.adapters.corpus import TINY_DENSE, TINY_MOE, make_archive, write_lora_adapter
from tests.adapters.fixtures import uploads_of
from tests.conftest import error_of

pytestmark = pytest.mark.django_db(transaction=False)

URL = "/api/v1/adapters/support-bot"


def register(client, directory: Path, django_capture_on_commit_callbacks, **fields):
    with django_capture_on_commit_callbacks(execute=True):
        return client.post(f"{URL}/revisions/", {"files": uploads_of(directory), **fields}, format="multipart")


def stored_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_create_adapter_and_read_it_back(tenant_a, dense_base):
    client = tenant_a.client_as("developer")
    created = client.post("/api/v1/adapters/", {"name": "support-bot", "base_model": "test-dense"}, format="json")
    assert created.status_code == 201, created.content
    detail = client.get(URL + "/").json()
    assert detail["name"] == "support-bot" and detail["base_model"] == "test-dense"
    assert detail["aliases"] == [] and detail["latest_revisions"] == []
    assert [a["name"] for a in client.get("/api/v1/adapters/").json()["results"]] == ["support-bot"]


def test_adapter_name_is_unique_per_tenant_only(tenant_a, tenant_b, dense_base):
    body = {"name": "support-bot", "base_model": "test-dense"}
    assert tenant_a.client_as("developer").post("/api/v1/adapters/", body, format="json").status_code == 201
    again = tenant_a.client_as("developer").post("/api/v1/adapters/", body, format="json")
    assert again.status_code == 409 and error_of(again)["code"] == "adapter_exists"
    assert tenant_b.client_as("developer").post("/api/v1/adapters/", body, format="json").status_code == 201


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "Bad Name!", "base_model": "test-dense"}, "name"),
        ({"name": "a:b", "base_model": "test-dense"}, "name"),
        ({"name": "ok", "base_model": "no-such-model"}, "base_model"),
        ({"base_model": "test-dense"}, "name"),
    ],
)
def test_bad_adapter_input_names_the_field(tenant_a, dense_base, body, field):
    response = tenant_a.client_as("developer").post("/api/v1/adapters/", body, format="json")
    assert response.status_code == 400
    assert error_of(response)["message"].startswith(f"{field}:")
    assert not Adapter.objects.exists()


def test_adapter_quota_is_a_429(tenant_a, dense_base):
    tenant_a.tenant.max_adapters = 1
    tenant_a.tenant.save()
    client = tenant_a.client_as("developer")
    assert (
        client.post("/api/v1/adapters/", {"name": "one", "base_model": "test-dense"}, format="json").status_code == 201
    )
    over = client.post("/api/v1/adapters/", {"name": "two", "base_model": "test-dense"}, format="json")
    assert over.status_code == 429
    assert error_of(over)["code"] == "adapter_quota_exceeded"
    assert Adapter.objects.count() == 1


def test_registration_answers_registered_and_tasks_export_it(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    response = register(
        tenant_a.client_as("developer"), good_adapter_dir, django_capture_on_commit_callbacks, training_step=1200
    )
    assert response.status_code == 201, response.content
    assert (response.json()["revision"], response.json()["state"]) == ("r1", "registered")

    revision = AdapterRevision.objects.get(adapter=adapter_a, number=1)
    assert revision.state == "exported", revision.failure_reason
    assert (revision.rank, revision.alpha, revision.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    prefix = f"t/{tenant_a.tenant.id}/a/{adapter_a.id}/r1/export"
    assert revision.export_uri == prefix
    record = json.loads((artifact_root / prefix / "policy_record.json").read_text())
    assert record == revision.policy_record
    assert (record["tenant"], record["adapter"], record["revision"], record["base_model"]) == (
        "acme",
        "support-bot",
        1,
        "test-dense",
    )
    assert record["training_step"] == 1200 and record["rank"] == 4
    for file in record["files"]:
        data = (artifact_root / prefix / file["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == file["sha256"] and len(data) == file["size_bytes"]
    assert {f["name"] for f in record["files"]} == {"adapter_config.json", "adapter_model.safetensors"}
    assert not [p for p in stored_files(artifact_root) if "/.export-" in p]

    detail = tenant_a.client_as("viewer").get(f"{URL}/revisions/1/").json()
    assert detail["state"] == "exported" and detail["policy_record"]["files"] == record["files"]


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "zip"])
def test_archives_register_like_files(
    tenant_a, adapter_a, good_adapter_dir, tmp_path, artifact_root, kind, django_capture_on_commit_callbacks
):
    archive = make_archive(good_adapter_dir, tmp_path / f"adapter.{kind}", kind)
    with django_capture_on_commit_callbacks(execute=True):
        response = tenant_a.client_as("key:pipeline").post(
            f"{URL}/revisions/", {"archive": SimpleUploadedFile(archive.name, archive.read_bytes())}, format="multipart"
        )
    assert response.status_code == 201, response.content
    revision = AdapterRevision.objects.get(adapter=adapter_a, number=1)
    assert revision.state == "exported", revision.failure_reason


def test_many_file_layout_is_exported_as_one_peft_file(
    tenant_a, adapter_a, tmp_path, artifact_root, django_capture_on_commit_callbacks
):
    many = write_lora_adapter(tmp_path / "many", TINY_DENSE, layout="many_file", targets=("q_proj", "o_proj"))
    assert len(list(many.glob("*.safetensors"))) > 1
    assert register(tenant_a.client_as("developer"), many, django_capture_on_commit_callbacks).status_code == 201
    revision = AdapterRevision.objects.get(adapter=adapter_a, number=1)
    assert revision.state == "exported", revision.failure_reason
    assert revision.policy_record["source_layout"] == "many_file"
    assert [f["name"] for f in revision.policy_record["files"]] == ["adapter_config.json", "adapter_model.safetensors"]


def test_moe_adapter_exports_per_expert(
    tenant_a, moe_base, tmp_path, artifact_root, django_capture_on_commit_callbacks
):
    Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=moe_base)
    moe = write_lora_adapter(tmp_path / "moe", TINY_MOE, targets=("q_proj",), expert_targets=("gate_proj", "down_proj"))
    assert register(tenant_a.client_as("developer"), moe, django_capture_on_commit_callbacks).status_code == 201
    revision = AdapterRevision.objects.get(number=1)
    assert revision.state == "exported", revision.failure_reason
    assert revision.policy_record["tensor_count"] == 2 * TINY_MOE.num_layers * (1 + 2 * TINY_MOE.num_experts)


def test_source_uri_in_the_tenants_incoming_area(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    incoming = artifact_root / f"t/{tenant_a.tenant.id}/incoming/run-42"
    incoming.mkdir(parents=True)
    for file in good_adapter_dir.iterdir():
        (incoming / file.name).write_bytes(file.read_bytes())
    with django_capture_on_commit_callbacks(execute=True):
        response = tenant_a.client_as("key:pipeline").post(
            f"{URL}/revisions/", {"source_uri": f"t/{tenant_a.tenant.id}/incoming/run-42/"}, format="json"
        )
    assert response.status_code == 201, response.content
    assert AdapterRevision.objects.get(number=1).state == "exported"


@pytest.mark.parametrize("where", ["other-tenant", "traversal", "missing", "outside-incoming"])
def test_source_uri_outside_your_area_or_missing_is_refused(
    tenant_a, tenant_b, adapter_a, good_adapter_dir, artifact_root, where
):
    other = artifact_root / f"t/{tenant_b.tenant.id}/incoming/run"
    other.mkdir(parents=True)
    (other / "adapter_config.json").write_text("{}")
    uri = {
        "other-tenant": f"t/{tenant_b.tenant.id}/incoming/run/",
        "traversal": f"t/{tenant_a.tenant.id}/incoming/../../{tenant_b.tenant.id}/incoming/run/",
        "missing": f"t/{tenant_a.tenant.id}/incoming/nothing-here/",
        "outside-incoming": f"t/{tenant_a.tenant.id}/a/1/r1/export/",
    }[where]
    response = tenant_a.client_as("key:pipeline").post(f"{URL}/revisions/", {"source_uri": uri}, format="json")
    assert response.status_code == 400
    assert error_of(response)["code"] in {"bad_source_uri", "source_not_found"}
    assert not AdapterRevision.objects.exists()


def test_upload_over_the_tenant_limit_is_413_and_stores_nothing(tenant_a, adapter_a, good_adapter_dir, artifact_root):
    tenant_a.tenant.max_upload_bytes = 1000
    tenant_a.tenant.save()
    response = tenant_a.client_as("developer").post(
        f"{URL}/revisions/", {"files": uploads_of(good_adapter_dir)}, format="multipart"
    )
    assert response.status_code == 413
    assert error_of(response)["code"] == "payload_too_large"
    assert stored_files(artifact_root) == []
    assert not AdapterRevision.objects.exists()


def test_registration_without_an_artifact_is_a_400(tenant_a, adapter_a, artifact_root):
    response = tenant_a.client_as("developer").post(f"{URL}/revisions/", {"training_step": 3}, format="json")
    assert response.status_code == 400
    assert error_of(response)["code"] == "no_artifact"


def test_unknown_parent_is_refused_before_anything_is_stored(tenant_a, adapter_a, good_adapter_dir, artifact_root):
    response = tenant_a.client_as("developer").post(
        f"{URL}/revisions/", {"files": uploads_of(good_adapter_dir), "parent": 7}, format="multipart"
    )
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("parent:")
    assert stored_files(artifact_root) == []
    assert not AdapterRevision.objects.exists()


def test_revision_list_filters_by_state_and_paginates(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("developer")
    for _ in range(3):
        register(client, good_adapter_dir, django_capture_on_commit_callbacks, allow_duplicate="true")
    AdapterRevision.objects.filter(number=2).update(state="failed")
    listed = client.get(f"{URL}/revisions/?limit=2").json()
    assert [r["revision"] for r in listed["results"]] == ["r3", "r2"]
    assert listed["next"]
    rest = client.get(listed["next"]).json()
    assert [r["revision"] for r in rest["results"]] == ["r1"]
    failed = client.get(f"{URL}/revisions/?state=failed").json()["results"]
    assert [r["revision"] for r in failed] == ["r2"]
    bad = client.get(f"{URL}/revisions/?state=done")
    assert bad.status_code == 400 and error_of(bad)["message"].startswith("state:")


def test_revision_list_pins_its_query_count(
    tenant_a,
    adapter_a,
    good_adapter_dir,
    artifact_root,
    django_capture_on_commit_callbacks,
    django_assert_max_num_queries,
):
    client = tenant_a.client_as("key:pipeline")
    for _ in range(4):
        register(client, good_adapter_dir, django_capture_on_commit_callbacks, allow_duplicate="true")
    # key lookup + adapter + one page of revisions with their joins
    with django_assert_max_num_queries(3):
        assert len(client.get(f"{URL}/revisions/").json()["results"]) == 4


def test_the_whole_governed_life(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    developer, approver = tenant_a.client_as("developer"), tenant_a.client_as("approver")
    for _ in range(2):
        register(developer, good_adapter_dir, django_capture_on_commit_callbacks, allow_duplicate="true")
    for number in (1, 2):
        assert developer.post(f"{URL}/revisions/{number}/request-approval/").json()["state"] == "pending_approval"
        approved = approver.post(f"{URL}/revisions/{number}/approve/", {"comment": "lgtm"}, format="json")
        assert approved.status_code == 200, approved.content
        assert approved.json()["approvals"][0]["decided_by"] == "acme-approver"
    assert Approval.objects.filter(decision="approved").count() == 2

    activated = approver.post(f"{URL}/activate/", {"revision": "r1"}, format="json")
    assert activated.status_code == 200, activated.content
    assert (activated.json()["revision"], activated.json()["desired_revision"]) == (None, "r1")

    r1, r2 = AdapterRevision.objects.get(number=1), AdapterRevision.objects.get(number=2)
    serving_services.alias_flip(adapter=adapter_a, revision=r1)  # what the serving plane does once r1 is ready
    approver.post(f"{URL}/activate/", {"revision": 2}, format="json")
    serving_services.alias_flip(adapter=adapter_a, revision=r2)
    alias = Alias.objects.get(adapter=adapter_a, name="production")
    assert (alias.revision, alias.previous_revision) == (r2, r1)

    rolled = approver.post(f"{URL}/rollback/", {}, format="json")
    assert rolled.status_code == 200, rolled.content
    assert rolled.json()["desired_revision"] == "r1"
    assert rolled.json()["rollback_pending"] is True
    serving_services.alias_flip(adapter=adapter_a, revision=r1)
    assert Alias.objects.get(adapter=adapter_a).revision == r1

    actions = list(AuditEvent.objects.filter(tenant=tenant_a.tenant).order_by("id").values_list("action", flat=True))
    r1_actions = list(
        AuditEvent.objects.filter(target="revision:support-bot@r1").order_by("id").values_list("action", flat=True)
    )
    assert r1_actions == [
        "revision.register",
        "revision.validate",
        "revision.export",
        "revision.request_approval",
        "revision.approve",
    ]
    assert actions[-5:] == [
        "alias.activate",
        "alias.flip",
        "alias.activate",
        "alias.flip",
        "alias.rollback",
    ] or actions[-6:] == [
        "alias.activate",
        "alias.flip",
        "alias.activate",
        "alias.flip",
        "alias.rollback",
        "alias.flip",
    ]


def test_flip_to_anything_but_the_desired_revision_is_refused(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    register(tenant_a.client_as("developer"), good_adapter_dir, django_capture_on_commit_callbacks)
    revision = AdapterRevision.objects.get(number=1)
    AdapterRevision.objects.filter(id=revision.id).update(state="approved")
    revision.refresh_from_db()
    serving_services.revision_activate(adapter=adapter_a, revision=revision, by=Actor.system())
    other = AdapterRevision.objects.create(adapter=adapter_a, number=2, state="approved", source_uri="x")
    with pytest.raises(InvalidTransition):
        serving_services.alias_flip(adapter=adapter_a, revision=other)
    assert Alias.objects.get(adapter=adapter_a).revision is None


def test_rollback_reexports_a_removed_export_bit_identically(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    import shutil

    developer, approver = tenant_a.client_as("developer"), tenant_a.client_as("approver")
    for number in (1, 2):
        register(developer, good_adapter_dir, django_capture_on_commit_callbacks, allow_duplicate="true")
        developer.post(f"{URL}/revisions/{number}/request-approval/")
        approver.post(f"{URL}/revisions/{number}/approve/", {}, format="json")
        approver.post(f"{URL}/activate/", {"revision": number}, format="json")
        serving_services.alias_flip(adapter=adapter_a, revision=AdapterRevision.objects.get(number=number))
    r1 = AdapterRevision.objects.get(number=1)
    export_dir = artifact_root / r1.export_uri
    before = {p.name: p.read_bytes() for p in export_dir.iterdir()}
    shutil.rmtree(export_dir)

    with django_capture_on_commit_callbacks(execute=True):
        assert approver.post(f"{URL}/rollback/", {"revision": "r1"}, format="json").status_code == 200
    assert {p.name: p.read_bytes() for p in export_dir.iterdir()} == before
    assert AuditEvent.objects.filter(action="revision.reexport", target="revision:support-bot@r1").count() == 1


def test_rollback_with_nothing_live_is_a_409(tenant_a, adapter_a):
    response = tenant_a.client_as("approver").post(f"{URL}/rollback/", {}, format="json")
    assert response.status_code == 409
    assert error_of(response)["code"] == "nothing_to_roll_back"
