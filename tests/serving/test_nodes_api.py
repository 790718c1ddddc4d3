from __future__ import annotations

import pytest

from serving.models import ServingNode
from tests.conftest import ALL_SCOPES, error_of

pytestmark = pytest.mark.django_db

BODY = {
    "name": "gpu-7",
    "base_model": "test-dense",
    "url": "http://10.0.0.7:8000",
    "gpu_slots": 8,
    "cpu_slots": 256,
    "cache_dir": "/srv/mint/cache",
}


def test_staff_register_and_list_nodes(tenant_a, dense_base):
    staff = tenant_a.users["owner"]
    staff.is_staff = True
    staff.save()
    client = tenant_a.client_as("owner")
    created = client.post("/api/v1/nodes/", BODY, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["state"] == "down" and created.json()["served_model_name"] == "test-dense"
    listed = client.get("/api/v1/nodes/").json()["results"]
    assert [(n["name"], n["loaded"], n["queued"]) for n in listed] == [("gpu-7", 0, 0)]


@pytest.mark.parametrize("principal", ["owner", "approver", "viewer", f"key:{ALL_SCOPES}"])
def test_nodes_are_for_staff_only(tenant_a, dense_base, principal):
    client = tenant_a.client_as(principal)
    for response in (client.get("/api/v1/nodes/"), client.post("/api/v1/nodes/", BODY, format="json")):
        assert response.status_code in (401, 403)
        error_of(response)
    assert not ServingNode.objects.exists()


def test_bad_slots_are_refused_naming_the_problem(tenant_a, dense_base):
    staff = tenant_a.users["owner"]
    staff.is_staff = True
    staff.save()
    response = tenant_a.client_as("owner").post("/api/v1/nodes/", BODY | {"cpu_slots": 2}, format="json")
    assert response.status_code == 400
    assert "cpu_slots" in error_of(response)["message"]
