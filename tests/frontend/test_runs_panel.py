"""The adapter page's training-runs panel (`?fragment=runs`): a run's reward curve data in step order, its steps'
table, the parent chain of its newest step; another run by `?run=`; another tenant's adapter is not found."""

from __future__ import annotations

import json

import pytest

from adapters.models import AdapterRevision
from tests.frontend.conftest import page_client

pytestmark = pytest.mark.django_db


def step(adapter, number, *, run="grpo-1", training_step=None, parent=None, **metrics):
    return AdapterRevision.objects.create(
        adapter=adapter,
        number=number,
        state="exported",
        source_uri="x",
        run=run,
        training_step=training_step if training_step is not None else number * 10,
        parent=parent,
        metrics=metrics,
    )


def run_data(html: str) -> dict:
    marker = '<script id="run-data" type="application/json">'
    start = html.index(marker) + len(marker)
    return json.loads(html[start : html.index("</script>", start)])


@pytest.fixture
def run(adapter_a):
    r1 = step(adapter_a, 1, run="warmup", loss=2.0)
    r2 = step(adapter_a, 2, parent=r1, reward=0.1, loss=1.5, note="first")
    r3 = step(adapter_a, 3, training_step=40, parent=r2, reward=0.35)
    step(adapter_a, 4, training_step=30, parent=r2, reward=0.2, loss=1.1)
    step(adapter_a, 5, training_step=50, parent=r3, reward=0.5, loss=0.9)


def test_the_panel_charts_the_newest_run_by_step_with_its_parent_chain(run, tenant_a):
    response = page_client(tenant_a.users["viewer"]).get("/adapters/support-bot/?fragment=runs")
    assert response.status_code == 200
    html = response.content.decode()
    data = run_data(html)
    assert data["run"] == "grpo-1"
    assert data["x"] == [20, 30, 40, 50] and data["revisions"] == ["r2", "r4", "r3", "r5"]
    assert data["metrics"] == {"reward": [0.1, 0.2, 0.35, 0.5], "loss": [1.5, 1.1, None, 0.9]}
    assert 'data-run-chart="reward"' in html and 'data-run-chart="loss"' in html
    # The newest step's lineage, across into the run it started from.
    chain = html[html.index("data-parent-chain") : html.index("</p>", html.index("data-parent-chain"))]
    assert [part.split(">")[-1] for part in chain.split("</a>")[:-1]] == ["r5", "r3", "r2", "r1"]
    assert "(warmup)" in chain
    assert 'data-step="4"' in html and "first" not in html  # a text metric is not charted or tabled


def test_another_run_is_chosen_by_name(run, tenant_a):
    html = page_client(tenant_a.users["viewer"]).get("/adapters/support-bot/?fragment=runs&run=warmup").content
    data = run_data(html.decode())
    assert data["run"] == "warmup" and data["metrics"] == {"loss": [2.0]}


def test_an_adapter_without_runs_says_how_to_make_one(adapter_a, tenant_a):
    html = page_client(tenant_a.users["viewer"]).get("/adapters/support-bot/?fragment=runs").content.decode()
    assert "No training runs yet" in html and "run-data" not in html


def test_the_page_loads_the_panel_and_its_script(run, tenant_a):
    html = page_client(tenant_a.users["viewer"]).get("/adapters/support-bot/").content.decode()
    assert 'data-fragment="runs"' in html and "frontend/runs.js" in html


def test_another_tenants_runs_are_not_found(run, tenant_b):
    refused = page_client(tenant_b.users["owner"]).get("/adapters/support-bot/?fragment=runs")
    assert refused.status_code == 404
    assert "run-data" not in refused.content.decode()


def test_the_panel_costs_a_fixed_number_of_queries(run, tenant_a, django_assert_max_num_queries):
    client = page_client(tenant_a.users["viewer"])
    client.get("/adapters/support-bot/?fragment=runs")  # the session and membership are read once warm
    with django_assert_max_num_queries(10):
        assert client.get("/adapters/support-bot/?fragment=runs").status_code == 200
