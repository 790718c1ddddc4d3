"""The site served by two processes on one port (`make run`'s MINT_WEB_PROCESSES=2): what must hold across a
fleet's processes holds across them.

One uvicorn (`--workers 2`, devtools.launcher.web_argv) serves the test database. Each process counts what it
answers in its own files of the multiprocess metrics directory (`counter_<pid>.db`), so the test tells which
process answered each request by which file's count grew, and every claim below is checked against answers
from both processes (a test that only one process answered fails). Each request opens its own connection:
the kernel hands new connections to whichever process accepts first.

- the tenant's rate limit counts both processes' requests (Redis): at most one request per other process
  past the limit (a process learns the window's total when it adds its own requests to it,
  serving/gateway/ratelimit.py), where two processes counting alone would admit twice the limit;
- a revoked key is refused by both within the key cache (MINT_GATEWAY_KEY_CACHE_S), and never accepted
  again by a process that refused it;
- an alias flip reaches both processes' route caches (MINT_GATEWAY_FOLLOWED_CACHE_S, far longer than the
  test), through the live event each follows: both stop naming the old revision;
- /metrics, whichever process serves it, counts every process's requests: its per-tenant sums equal the
  requests sent, and the database-backed series (nodes) appear once, not once per process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from django.conf import settings
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from adapters.models import Adapter, AdapterRevision, BaseModel
from devtools.supervisor import wait_for
from serving import services as serving_services
from serving.gateway import ratelimit
from serving.models import Alias
from tenants import services
from tenants.access import Actor
from tenants.models import Role
from tests.e2e.conftest import platform_followers
from tests.factories import ServingNodeFactory

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PROCESSES = 2
METRICS_TOKEN = "e2e-web-processes-metrics-token-0123456789"
# Each process keeps a key, and a followed route, this long; the test waits for a change to reach both processes
# at most half of it, before even the background refresh at half the TTL could explain it.
KEY_CACHE_S = 120.0
ROUTE_CACHE_S = 300.0
RATE_LIMIT = 10
MAX_REQUESTS = 400  # the most requests one step sends before giving up on seeing both processes
HANG_S = 10.0

Send = Callable[[], tuple[int, httpx.Response]]


def _answered_per_process(metrics_dir: Path) -> dict[int, float]:
    """Requests each process has answered so far (gateway and Django), from its own counter file."""
    answered = {}
    for path in metrics_dir.glob("counter_*.db"):
        pid = int(path.stem.removeprefix("counter_"))
        answered[pid] = sum(
            sample.value
            for metric in MultiProcessCollector.merge([str(path)])
            if metric.name in ("mint_gateway_requests", "mint_http_requests")
            for sample in metric.samples
            if sample.name.endswith("_total")
        )
    return answered


def _samples(response: httpx.Response) -> dict[str, list]:
    return {family.name: family.samples for family in text_string_to_metric_families(response.text)}


def _total(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples.get(name, [])
        if s.name == f"{name}_total" and all(s.labels.get(k) == v for k, v in labels.items())
    )


@dataclass
class Fleet:
    """The two-process site, and who answered what."""

    base: str
    metrics_dir: Path
    workers: set[int]
    gateway_requests: int = 0  # requests sent to /v1/

    def call(self, method: str, path: str, *, token: str, **kwargs) -> tuple[int, httpx.Response]:
        """One request on a connection of its own: (the pid of the process that answered it, its response)."""
        before = _answered_per_process(self.metrics_dir)
        response = httpx.request(
            method, f"{self.base}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=HANG_S, **kwargs
        )
        after = _answered_per_process(self.metrics_dir)
        grew = [pid for pid, count in after.items() if count > before.get(pid, 0)]
        assert len(grew) == 1 and after[grew[0]] == before.get(grew[0], 0) + 1, (before, after)
        assert grew[0] in self.workers, (grew, self.workers)
        if path.startswith("/v1/"):
            self.gateway_requests += 1
        return grew[0], response

    def until_each(self, send: Send, done: Callable[[int, httpx.Response], bool]) -> list[tuple[int, httpx.Response]]:
        """`send()` until every process has given an answer that `done` accepts: every answer, in order."""
        answers: list[tuple[int, httpx.Response]] = []
        finished: set[int] = set()
        while finished != self.workers:
            assert len(answers) < MAX_REQUESTS, f"only {sorted(finished)} of {sorted(self.workers)} got there"
            pid, response = send()
            answers.append((pid, response))
            if done(pid, response):
                finished.add(pid)
        return answers


@pytest.fixture
def fleet(start_web, supervisor) -> Fleet:
    before = platform_followers()
    env = {
        "MINT_METRICS_TOKEN": METRICS_TOKEN,
        "MINT_GATEWAY_KEY_CACHE_S": str(KEY_CACHE_S),
        "MINT_GATEWAY_FOLLOWED_CACHE_S": str(ROUTE_CACHE_S),
    }
    base = start_web(env, processes=PROCESSES)
    manager = psutil.Process(supervisor.children[-1][1].pid)
    metrics_dir = Path(manager.environ()["PROMETHEUS_MULTIPROC_DIR"])
    # A process serves once its lifespan has run, and its gateway then follows the platform's events.
    wait_for(lambda: platform_followers() >= before + PROCESSES, timeout=60, what="every process's event feed")
    workers = {child.pid for child in manager.children() if "spawn_main" in " ".join(child.cmdline())}
    assert len(workers) == PROCESSES, manager.children()
    return Fleet(base=base, metrics_dir=metrics_dir, workers=workers)


class RateWindow:
    """The tenant's count in Redis for the current rate-limit window, started with time to spare and empty."""

    def __init__(self, tenant_id: int) -> None:
        if time.time() % ratelimit.WINDOW_S > ratelimit.WINDOW_S - 15:
            time.sleep(ratelimit.WINDOW_S - time.time() % ratelimit.WINDOW_S + 0.1)
        self.window = int(time.time() // ratelimit.WINDOW_S)
        self.key = ratelimit.key_for(tenant_id, self.window)
        self.client = redis.Redis.from_url(settings.REDIS_URL)
        self.client.delete(self.key)

    def count(self) -> int:
        return int(self.client.get(self.key) or 0)

    def current(self) -> bool:
        return int(time.time() // ratelimit.WINDOW_S) == self.window


def test_two_web_processes_share_limits_revocations_routes_and_metrics(fleet, tenant_a, tenant_b):
    # -- the rate limit: tenant B's requests, spread over both processes, share one count.
    limited = tenant_b.tenant
    limited.rate_limit_rpm = RATE_LIMIT
    limited.save(update_fields=["rate_limit_rpm"])
    _, limited_token = tenant_b.key("inference")
    rate = RateWindow(limited.id)
    admitted = 0

    def limited_models() -> tuple[int, httpx.Response]:
        nonlocal admitted
        pid, response = fleet.call("GET", "/v1/models", token=limited_token)
        if response.status_code == 200:
            # The process adds it to Redis beside the answer; the next request waits for that, so each process
            # learns the total whenever it admits one (without this wait a burst may go further past the limit).
            admitted += 1
            wait_for(lambda: rate.count() == admitted, timeout=HANG_S, what="the admitted request in Redis")
        return pid, response

    answers = fleet.until_each(limited_models, lambda _, r: r.status_code == 429)
    assert rate.current(), "the rate-limit step ran into the next minute"
    rate.client.close()
    statuses = [response.status_code for _, response in answers]
    assert set(statuses) == {200, 429} and statuses.count(200) == admitted
    # Each process may admit one request past the limit (its first after another process reached it); counting
    # alone, each would admit RATE_LIMIT.
    assert RATE_LIMIT <= admitted <= RATE_LIMIT + PROCESSES - 1, statuses
    assert {pid for pid, r in answers if r.status_code == 200} == fleet.workers
    assert {r.json()["error"]["code"] for _, r in answers if r.status_code == 429} == {"rate_limit_exceeded"}

    # -- revocation: tenant A's key, cached by both processes, is refused by both once it is revoked.
    tenant_a.tenant.rate_limit_rpm = 100_000  # no step below waits on tenant A's rate limit
    tenant_a.tenant.save(update_fields=["rate_limit_rpm"])
    key, token = tenant_a.key("inference")

    def models() -> tuple[int, httpx.Response]:
        return fleet.call("GET", "/v1/models", token=token)

    fleet.until_each(models, lambda _, r: r.status_code == 200)
    started = time.monotonic()
    services.api_key_revoke(key=key, by=Actor(user=tenant_a.users[Role.OWNER]))
    refused_by: set[int] = set()

    def refused(pid: int, response: httpx.Response) -> bool:
        assert time.monotonic() - started < KEY_CACHE_S / 2, f"{fleet.workers - refused_by} still accept the key"
        if response.status_code == 401:
            refused_by.add(pid)
        else:  # accepted still, by a process that has not refused it yet
            assert response.status_code == 200 and pid not in refused_by, (pid, response.text)
        return response.status_code == 401

    answers = fleet.until_each(models, refused)
    assert {r.json()["error"]["code"] for _, r in answers if r.status_code == 401} == {"api_key_revoked"}
    later = fleet.until_each(models, lambda _, r: True)  # and it stays refused, whichever process answers
    assert {r.status_code for _, r in later} == {401}

    # -- routes: both processes cache bot's route to r1; a flip to r2 reaches both through the live event.
    _, route_token = tenant_a.key("inference", "pipeline")
    base_model = BaseModel.objects.create(name="e2e-web-processes", architecture="dense", config={}, max_lora_rank=16)
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="bot", base_model=base_model)
    r1, r2 = (
        AdapterRevision.objects.create(adapter=adapter, number=n, state="approved", source_uri="x") for n in (1, 2)
    )
    alias = Alias.objects.create(adapter=adapter, name=Alias.PRODUCTION, revision=r1, desired_revision=r1)
    body = {"model": "bot", "prompt": "Hi", "max_tokens": 1}

    def complete() -> tuple[int, httpx.Response]:
        return fleet.call("POST", "/v1/completions", token=route_token, json=body)

    def names(revision: str, response: httpx.Response) -> bool:
        """Whether a 503 adapter_not_ready (no node has it: no vLLM here) names `revision`."""
        assert response.status_code == 503 and response.json()["error"]["code"] == "adapter_not_ready", response.text
        return f"Revision {revision} " in response.json()["error"]["message"]

    answers = fleet.until_each(complete, lambda _, r: names("r1", r))
    assert all(names("r1", r) for _, r in answers)
    Alias.objects.filter(id=alias.id).update(desired_revision=r2)
    started = time.monotonic()
    serving_services.alias_flip(adapter=adapter, revision=r2)
    flipped_on: set[int] = set()

    def flipped(pid: int, response: httpx.Response) -> bool:
        assert time.monotonic() - started < ROUTE_CACHE_S / 2, f"{fleet.workers - flipped_on} still route to r1"
        if names("r2", response):
            flipped_on.add(pid)
            return True
        assert names("r1", response) and pid not in flipped_on, (pid, response.text)  # not back to r1
        return False

    fleet.until_each(complete, flipped)

    # -- /metrics: whichever process serves it, it counts both processes' requests, and a node once.
    ServingNodeFactory(name="e2e-node", base_model=base_model, url="http://127.0.0.1:9")
    scrapes = fleet.until_each(lambda: fleet.call("GET", "/metrics", token=METRICS_TOKEN), lambda _, r: True)
    for number, (pid, response) in enumerate(scrapes):
        assert response.status_code == 200, response.text
        samples = _samples(response)
        assert _total(samples, "mint_gateway_requests") == fleet.gateway_requests, (pid, samples)
        assert _total(samples, "mint_gateway_requests", tenant=limited.slug) == len(statuses)
        assert _total(samples, "mint_gateway_rate_limited", tenant=limited.slug) == statuses.count(429)
        # Django's count of /metrics: every scrape before this one (a scrape is counted once it is answered).
        assert _total(samples, "mint_http_requests", route="metrics", status="200") == number
        nodes = [s for s in samples["mint_node_up"] if s.labels["node"] == "e2e-node"]
        assert [s.value for s in nodes] == [1.0], nodes  # read from the database once, not summed per process
        assert not [name for name in samples if name.startswith("process_")]  # one process's series: left out
