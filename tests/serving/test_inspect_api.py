"""Looking inside revisions through the API: download links (signed, expiring), a diff whose norms are the update
each module makes (checked against numpy on the exported tensors), and the lineage. Real files, real store."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from adapters.models import AdapterRevision
from tests.adapters.corpus import TINY_DENSE, write_lora_adapter
from tests.adapters.fixtures import uploads_of
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

API = "/api/v1/adapters/support-bot"


def push(tenant, directory, capture, **fields) -> AdapterRevision:
    with capture(execute=True):
        response = tenant.client_as("key:pipeline").post(
            f"{API}/revisions/",
            {"files": uploads_of(directory), "allow_duplicate": "true", **fields},
            format="multipart",
        )
    assert response.status_code == 201, response.content
    return AdapterRevision.objects.get(adapter__name="support-bot", number=response.json()["number"])


def test_the_diff_names_config_changes_and_the_norm_of_each_modules_update(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks, tmp_path
):
    r1 = push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    wider = write_lora_adapter(tmp_path / "wider", TINY_DENSE, rank=8, alpha=16.0, targets=("q_proj", "k_proj"))
    r2 = push(tenant_a, wider, django_capture_on_commit_callbacks, parent=str(r1.number))

    response = tenant_a.client_as("viewer").get(f"{API}/diff/", {"a": "r1", "b": "2"})

    assert response.status_code == 200, response.content
    diff = response.json()
    assert diff["config"]["rank"] == {"a": 4, "b": 8, "changed": True}
    assert diff["config"]["target_modules"]["changed"] is True
    assert diff["config"]["parent"] == {"a": None, "b": "r1", "changed": True}
    modules = {m["module"]: m for m in diff["modules"]}
    assert {m["only_in"] for m in modules.values() if "v_proj" in m["module"]} == {"a"}
    assert {m["only_in"] for m in modules.values() if "k_proj" in m["module"]} == {"b"}
    # ‖ΔW‖ = alpha/r · ‖B·A‖, from the exported tensors themselves.
    tensors = load_file(str(artifact_root / r2.export_uri / "adapter_model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    a = tensors[f"base_model.model.{name}.lora_A.weight"].astype(np.float64)
    b = tensors[f"base_model.model.{name}.lora_B.weight"].astype(np.float64)
    expected = 16.0 / 8 * np.linalg.norm(b @ a)
    shown = modules[name]["b"]
    assert shown["delta_norm"] == pytest.approx(expected, rel=1e-9)
    assert shown["a"]["shape"] == list(a.shape) and shown["a"]["norm"] == pytest.approx(np.linalg.norm(a))
    assert modules[name]["shape_changed"] is True
    bad = tenant_a.client_as("viewer").get(f"{API}/diff/", {"a": "r1", "b": "r9"})
    assert bad.status_code == 400 and "b:" in error_of(bad)["message"]


def test_download_links_serve_the_exported_files_until_they_expire(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks, client
):
    r1 = push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    response = tenant_a.client_as("key:pipeline").get(f"{API}/revisions/1/download/")
    assert response.status_code == 200
    files = {f["name"]: f for f in response.json()["files"]}
    assert set(files) == {f["name"] for f in r1.policy_record["files"]} | {"policy_record.json"}
    weights = files["adapter_model.safetensors"]
    fetched = client.get(weights["url"])
    assert fetched.status_code == 200
    assert (
        b"".join(fetched.streaming_content)
        == (artifact_root / r1.export_uri / "adapter_model.safetensors").read_bytes()
    )
    # Archived: the link made before no longer serves, and no new one is made.
    with django_capture_on_commit_callbacks(execute=True):
        assert tenant_a.client_as("approver").post(f"{API}/revisions/1/archive/", {}, format="json").status_code == 200
    assert client.get(weights["url"]).status_code == 404
    gone = tenant_a.client_as("key:pipeline").get(f"{API}/revisions/1/download/")
    assert gone.status_code == 409 and error_of(gone)["code"] == "no_export"


def test_the_lineage_is_the_parent_chain_and_the_children(tenant_a, adapter_a):
    r1 = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="approved", source_uri="x")
    r2 = AdapterRevision.objects.create(adapter=adapter_a, number=2, state="exported", source_uri="x", parent=r1)
    AdapterRevision.objects.create(adapter=adapter_a, number=3, state="failed", source_uri="x", parent=r2)
    AdapterRevision.objects.create(adapter=adapter_a, number=4, state="exported", source_uri="x", parent=r2)
    lineage = tenant_a.client_as("viewer").get(f"{API}/revisions/2/lineage/").json()
    assert lineage["ancestors"] == [{"revision": "r1", "number": 1, "state": "approved"}]
    assert [c["revision"] for c in lineage["children"]] == ["r3", "r4"]
    assert lineage["more_ancestors"] is False
