"""Staff drain and undrain a node from the Nodes page; nobody else can."""

from __future__ import annotations

import pytest

from serving.models import NodeState, Placement, ServingNode
from tests.frontend.conftest import page_client
from tests.serving.conftest import approved_revision, make_live
from tests.serving.sent_tasks import NODE_TASKS, recorded

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_tasks():
    with recorded(*NODE_TASKS):
        yield


@pytest.fixture
def staff(tenant_a):
    user = tenant_a.users["owner"]
    user.is_staff = True
    user.save(update_fields=["is_staff"])
    return page_client(user)


def test_staff_see_the_control_and_drain_a_node(staff, node, adapter_a):
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    Placement.objects.create(node=node, revision=revision, state="ready")
    assert "Drain node-1" in staff.get("/nodes/").content.decode()

    answer = staff.post("/nodes/node-1/drain/", follow=True)

    assert ServingNode.objects.get(id=node.id).state == NodeState.DRAINING
    page = answer.content.decode()
    assert "node-1 is draining: 1 placements left" in page
    assert "support-bot@r1: not placed elsewhere yet" in page
    assert "Undrain node-1" in page

    staff.post("/nodes/node-1/undrain/")
    assert ServingNode.objects.get(id=node.id).state == NodeState.UP


def test_a_node_down_while_draining_says_so_and_staff_can_still_undrain_it(staff, node):
    ServingNode.objects.filter(id=node.id).update(state=NodeState.DOWN, drain_requested=True)
    page = staff.get("/nodes/").content.decode()
    assert "drains when back" in page and "Undrain node-1" in page

    answer = staff.post("/nodes/node-1/undrain/", follow=True)

    assert (
        "node-1 is down; it comes back into service, not draining, when its engine answers." in answer.content.decode()
    )
    assert ServingNode.objects.filter(id=node.id, state=NodeState.DOWN, drain_requested=False).exists()
    assert "drains when back" not in staff.get("/nodes/").content.decode()


def test_members_cannot_drain_and_do_not_see_the_control(as_role, node):
    owner = as_role("owner")
    assert "Drain node-1" not in owner.get("/nodes/").content.decode()
    assert owner.post("/nodes/node-1/drain/").status_code == 403
    assert ServingNode.objects.get(id=node.id).state == NodeState.UP


def test_an_unknown_node_is_404(staff, node):
    assert staff.post("/nodes/nope/drain/").status_code == 404
