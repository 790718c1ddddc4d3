"""Lineage of training runs: a revision registered with a `run`, `metrics` and `prewarm`; the runs API lists a
run's revisions in step order with their metrics and parents; metrics are bounded; other tenants see nothing."""

from __future__ import annotations

import json

import pytest

from adapters import runs
from adapters.models import AdapterRevision
from tests.adapters.fixtures import uploads_of
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot"


def push(client, directory, **fields):
    return client.post(f"{URL}/revisions/", {"files": uploads_of(directory), **fields}, format="multipart")


def step(adapter, number: int, *, run: str = "grpo-1", training_step: int | None = None, parent=None, **metrics):
    return AdapterRevision.objects.create(
        adapter=adapter,
        number=number,
        state="exported",
        source_uri=f"src/{number}",
        run=run,
        training_step=training_step if training_step is not None else number * 10,
        parent=parent,
        metrics=metrics,
    )


def test_a_pipeline_registers_a_step_with_its_run_metrics_and_prewarm(
    tenant_a, adapter_a, good_adapter_dir, artifact_root
):
    client = tenant_a.client_as("key:pipeline")
    answer = push(
        client,
        good_adapter_dir,
        training_step=100,
        run="grpo-7",
        metrics=json.dumps({"reward": 0.42, "loss": 1.5, "kl": 0.01, "note": "warm start", "ok": True}),
        prewarm="true",
    )

    assert answer.status_code == 201, answer.content
    body = answer.json()
    assert (body["run"], body["prewarm"], body["training_step"]) == ("grpo-7", True, 100)
    assert body["metrics"] == {"reward": 0.42, "loss": 1.5, "kl": 0.01, "note": "warm start", "ok": True}
    revision = AdapterRevision.objects.get(adapter=adapter_a, number=1)
    assert (revision.run, revision.prewarm, revision.metrics["reward"]) == ("grpo-7", True, 0.42)
    # A registration without them: no run, no metrics, not prewarmed.
    plain = push(client, good_adapter_dir, allow_duplicate="true").json()
    assert (plain["run"], plain["metrics"], plain["prewarm"]) == ("", {}, False)


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"run": "has space"}, "invalid_run"),
        ({"run": "-leading"}, "invalid_run"),
        ({"metrics": "not json"}, "invalid_metrics"),
        ({"metrics": "[1, 2]"}, "invalid_metrics"),
        ({"metrics": json.dumps({"reward": "x" * 201})}, "invalid_metrics"),
        ({"metrics": json.dumps({"bad name!": 1})}, "invalid_metrics"),
        ({"metrics": json.dumps({"nested": {"a": 1}})}, "invalid_metrics"),
        ({"metrics": json.dumps({f"m{i}": i for i in range(33)})}, "metrics_too_large"),
        ({"metrics": json.dumps({f"m{i}": "y" * 190 for i in range(30)})}, "metrics_too_large"),
    ],
)
def test_bad_lineage_is_refused_before_anything_is_stored(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, fields, code
):
    refused = push(tenant_a.client_as("key:pipeline"), good_adapter_dir, **fields)
    assert refused.status_code == 400, refused.content
    assert error_of(refused)["code"] == code
    assert not AdapterRevision.objects.filter(adapter=adapter_a).exists()
    assert not [p for p in artifact_root.rglob("*") if p.is_file()]


def test_nan_and_infinity_are_not_metrics():
    for text in ('{"reward": NaN}', '{"loss": Infinity}'):
        with pytest.raises(Exception) as refused:
            runs.clean_metrics(text)
        assert refused.value.code == "invalid_metrics"


def test_a_runs_revisions_are_listed_in_step_order_with_metrics_and_parents(tenant_a, adapter_a):
    # Registered out of step order (a retry of step 20 came last); another run and a run-less revision beside it.
    r1 = step(adapter_a, 1, training_step=10, reward=0.1)
    r2 = step(adapter_a, 2, training_step=30, parent=r1, reward=0.3)
    step(adapter_a, 3, training_step=20, parent=r1, reward=0.2)
    step(adapter_a, 4, run="other", training_step=5, reward=9.0)
    step(adapter_a, 5, run="", training_step=1)
    step(adapter_a, 6, training_step=40, parent=r2, reward=0.4, loss=0.9)

    client = tenant_a.client_as("key:pipeline")
    body = client.get(f"{URL}/runs/grpo-1/").json()
    assert [
        (s["revision"], s["training_step"], s["parent"], s["metrics"].get("reward")) for s in body["revisions"]
    ] == [
        ("r1", 10, None, 0.1),
        ("r3", 20, "r1", 0.2),
        ("r2", 30, "r1", 0.3),
        ("r6", 40, "r2", 0.4),
    ]
    assert body["next_offset"] is None and body["run"] == "grpo-1"

    listed = client.get(f"{URL}/runs/").json()["runs"]
    assert [(r["run"], r["revisions"], r["first_step"], r["last_step"], r["latest"]) for r in listed] == [
        ("grpo-1", 4, 10, 40, "r6"),
        ("other", 1, 5, 5, "r4"),
    ]
    # Members read them too; an unknown run is 404.
    assert tenant_a.client_as("viewer").get(f"{URL}/runs/grpo-1/").status_code == 200
    assert client.get(f"{URL}/runs/nope/").status_code == 404


def test_a_long_run_is_listed_a_page_at_a_time(tenant_a, adapter_a, settings):
    settings.MINT_RUN_PAGE = 10
    for n in range(1, 26):
        step(adapter_a, n)
    client = tenant_a.client_as("key:pipeline")
    first = client.get(f"{URL}/runs/grpo-1/").json()
    second = client.get(f"{URL}/runs/grpo-1/?offset={first['next_offset']}").json()
    third = client.get(f"{URL}/runs/grpo-1/?offset={second['next_offset']}").json()
    numbers = [s["number"] for page in (first, second, third) for s in page["revisions"]]
    assert numbers == list(range(1, 26)) and third["next_offset"] is None
    assert client.get(f"{URL}/runs/grpo-1/?offset=-1").status_code == 400


def test_the_parent_chain_follows_parents_across_runs(adapter_a):
    r1 = step(adapter_a, 1, run="warmup")
    r2 = step(adapter_a, 2, parent=r1)
    r3 = step(adapter_a, 3, parent=r2)
    step(adapter_a, 4, parent=r2)  # a sibling: not on r3's chain

    chain = runs.parent_chain(revision=r3)
    assert [(c["revision"], c["run"]) for c in chain] == [("r3", "grpo-1"), ("r2", "grpo-1"), ("r1", "warmup")]
    assert [c["revision"] for c in runs.parent_chain(revision=r3, limit=2)] == ["r3", "r2"]


def test_another_tenants_runs_are_404_as_if_absent(tenant_a, tenant_b, adapter_a, adapter_b):
    step(adapter_a, 1)
    step(adapter_b, 1)
    foreign = tenant_b.client_as("key:pipeline")
    assert foreign.get(f"{URL}/runs/").status_code == 404
    assert foreign.get(f"{URL}/runs/grpo-1/").status_code == 404
    own = foreign.get("/api/v1/adapters/globex-secret-bot/runs/grpo-1/")
    assert own.status_code == 200 and [s["revision"] for s in own.json()["revisions"]] == ["r1"]
