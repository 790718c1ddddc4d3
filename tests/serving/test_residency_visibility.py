"""Residency made visible and kept honest: where a revision lives in the adapter API, the tiers in /metrics and on
the Nodes page, the disk tier's budget, stray names the heartbeat unloads, the engine's busy adapters, spreading
a hot revision."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from unittest import mock

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from serving import tasks
from serving.gateway.residency import ColdStarts, spread_sync
from serving.gateway.routes import Resolution, Target
from serving.models import Alias, ColdStart, NodeCopy, Placement, lora_name
from serving.residency import stats
from serving.selectors import residency as residency_selectors
from serving.services.admission import placement_warmed
from serving.services.placement import evict
from serving.services.residency import node_copies_over_budget, node_copy_used, stray_loras
from serving.vllm import busy_loras_of
from tenants.models import Tenant
from tests.factories import ServingNodeFactory
from tests.frontend.conftest import page_client
from tests.metrics_scrape import scrape_metrics
from tests.serving.conftest import approved_revision, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]


@pytest.fixture
def clean_stats():
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter(f"{stats.PREFIX}:*"):
        client.delete(key)
    yield client
    for key in client.scan_iter(f"{stats.PREFIX}:*"):
        client.delete(key)


def test_the_adapter_api_says_where_the_live_revision_is_resident_and_its_last_cold_start(tenant_a, adapter_a, node):
    from tests.factories import ServingNodeFactory

    r1 = approved_revision(adapter_a, 1)
    Alias.objects.create(adapter=adapter_a, name="production", revision=r1, desired_revision=r1)
    place(node, r1, "ready", segment="protected")
    other = ServingNodeFactory(name="node-2", base_model=node.base_model)
    NodeCopy.objects.create(node=other, revision=r1, size_bytes=1234)
    ColdStart.objects.create(revision=r1, node="node-1", asked_at=timezone.now(), seconds=0.42, source="disk")

    body = tenant_a.client_as("viewer").get("/api/v1/adapters/support-bot/").json()

    (alias,) = body["aliases"]
    assert alias["reserved"] is False
    assert alias["residency"]["nodes"] == [
        {"node": "node-1", "tier": "cpu", "segment": "protected"},
        {"node": "node-2", "tier": "disk", "segment": None},
    ]
    assert alias["residency"]["cold_start"]["seconds"] == 0.42 and alias["residency"]["cold_start"]["source"] == "disk"
    listed = tenant_a.client_as("viewer").get("/api/v1/adapters/").json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    assert "residency" not in rows[0]["aliases"][0]  # the list stays cheap


def test_metrics_show_each_nodes_tiers_loads_evictions_and_cold_starts(node, adapter_a, client, clean_stats):
    r1 = approved_revision(adapter_a, 1)
    warming = place(node, r1, "warming", load_ms=10.0, priority=20, queued_at=timezone.now() - timedelta(seconds=1.5))
    warming.load_source = "disk"
    placement_warmed(placement=warming, warm_ms=5.0)  # a load on demand, 1.5 s after it was asked
    node_copy_used(placement=warming, size_bytes=4096)
    victim = place(node, approved_revision(adapter_a, 2), "ready")
    evict(Placement.objects.select_related("node", "revision__adapter__tenant").get(id=victim.id), reason=None)

    text = scrape_metrics(client)
    assert 'mint_residency_capacity{node="node-1",tier="cpu"} 3.0' in text
    assert 'mint_residency_capacity{node="node-1",tier="gpu"} 2.0' in text
    assert 'mint_residency_used{node="node-1",tier="cpu"} 1.0' in text
    assert 'mint_residency_used{node="node-1",tier="disk"} 4096.0' in text
    assert 'mint_residency_events_total{event="cold",node="node-1"} 1.0' in text
    assert 'mint_residency_events_total{event="from_disk",node="node-1"} 1.0' in text
    assert 'mint_residency_events_total{event="evictions",node="node-1"} 1.0' in text
    assert 'mint_residency_cold_start_seconds_bucket{le="2.0",node="node-1"} 1.0' in text
    assert 'mint_residency_cold_start_seconds_bucket{le="1.0",node="node-1"} 0.0' in text
    assert ColdStart.objects.get(revision=r1).source == "disk"


def test_the_nodes_page_charts_the_tiers(tenant_a, node, adapter_a, clean_stats):
    pipe = clean_stats.pipeline()
    stats.add(pipe, "node-1", {"loads": 3, "cold": 2, "evictions": 1, "gpu": 8, "cpu": 2})
    stats.add(pipe, stats.FLEET, {"miss": 2})
    pipe.execute()
    NodeCopy.objects.create(node=node, revision=approved_revision(adapter_a, 1), size_bytes=2048)

    page = page_client(tenant_a.users["viewer"]).get("/nodes/").content.decode()

    assert 'id="residency-node-1"' in page and 'data-chart="moves"' in page and 'data-chart="tiers"' in page
    assert 'id="residency-fleet"' in page
    assert "2.0\xa0KB" in page or "2.0 KB" in page  # the disk tier's use
    chart = residency_selectors.node_series(["node-1"])["node-1"]
    assert chart["loads"][-1] == 3 and chart["gpu_share"][-1] == 0.8 and chart["cpu_share"][-1] == 0.2


def test_the_disk_tier_keeps_its_budget_least_recently_used_first_never_what_a_placement_holds(
    node, adapter_a, settings
):
    settings.MINT_NODE_DISK_BYTES = 250
    old, held, recent = (approved_revision(adapter_a, n) for n in (1, 2, 3))
    now = timezone.now()
    for revision, age in ((old, 30), (held, 20), (recent, 1)):
        NodeCopy.objects.create(node=node, revision=revision, size_bytes=100, last_used_at=now - timedelta(minutes=age))
    place(node, held, "ready")

    victims = node_copies_over_budget(node=node)

    assert [c.revision_id for c in victims] == [old.id]  # 300 → 200 bytes; `held` is older but loaded


def test_the_heartbeat_unloads_names_the_engine_holds_that_no_placement_accounts_for(node, adapter_a):
    r1, stray = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    place(node, r1, "ready")
    loaded = {"test-dense", lora_name(r1), lora_name(stray), "some-other-model"}
    assert stray_loras(node=node, loaded=loaded) == [lora_name(stray)]

    with (
        mock.patch("serving.tasks.VllmClient") as engine,
        mock.patch.object(tasks.node_lora_unload, "apply_async") as sent,
    ):
        client = engine.return_value.__enter__.return_value
        client.health.return_value = True
        client.model_entries.return_value = [{"id": name} for name in loaded]
        client.version.return_value = "0.32.0"
        tasks.nodes_heartbeat()
    assert [c.kwargs["kwargs"]["name"] for c in sent.call_args_list] == [lora_name(stray)]


METRICS = """\
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,c",waiting_lora_adapters="d"} 1.8e9
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} %s
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
"""


def test_the_engines_busy_adapters_are_read_from_its_newest_lora_series():
    assert busy_loras_of(METRICS % "2.0") == {"b", "c", "d"}
    assert busy_loras_of(METRICS % "0.0") == set()  # idle: whatever the last series said


def test_a_revision_busy_on_every_replica_asks_for_one_more_placement_once(settings):
    settings.MINT_RESIDENCY_SPREAD_INFLIGHT = 3
    background, db = mock.Mock(), mock.Mock()
    cold = ColdStarts(background, db, asked=mock.Mock())
    target = Target(placement_id=7, node_name="node-1", node_url="http://n", lora_name="t1-a1-r1")
    resolution = Resolution(
        adapter_id=1, adapter_name="a", revision_id=11, revision_number=1, lora_name="t1-a1-r1", targets=(target,)
    )
    assert not cold.maybe_spread(resolution, Counter({7: 2}))
    assert cold.maybe_spread(resolution, Counter({7: 3}))
    assert not cold.maybe_spread(resolution, Counter({7: 9}))  # asked already: once per 30 s
    (call,) = db.run.call_args_list
    assert call.args[1:] == (11, 2)  # spread_sync(revision 11, 2 replicas)


def test_a_spread_places_an_on_demand_revision_again_within_the_plan_never_a_pinned_one(
    node, adapter_a, dense_base, tmp_path
):
    ServingNodeFactory(name="node-2", base_model=dense_base, cpu_slots=3, cache_dir=str(tmp_path / "node-2"))
    hot, reserved = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    place(node, hot, "ready")
    place(node, reserved, "ready")
    Alias.objects.create(adapter=adapter_a, name="production", revision=reserved, reserved=True)
    Tenant.objects.filter(id=adapter_a.tenant_id).update(max_replicas=1)

    spread_sync(reserved.id, 2)  # its alias's replicas say how many it has: a spread one would stay pinned
    spread_sync(hot.id, 2)  # above the plan's max_replicas
    assert Placement.objects.filter(revision__in=(hot, reserved)).count() == 2

    Tenant.objects.filter(id=adapter_a.tenant_id).update(max_replicas=2)
    spread_sync(hot.id, 3)
    assert sorted(Placement.objects.filter(revision=hot).values_list("node__name", flat=True)) == ["node-1", "node-2"]
