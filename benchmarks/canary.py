"""Canary rollout: what a running canary costs the gateway, and how fast a failing candidate is aborted.

On the serving stack (benchmarks/stack.py: vLLM CPU on the tiny Llama, the web server with the gateway, the
control worker, the node agent), with the default settings (MINT_CANARY_MIN_REQUESTS 100, MINT_CANARY_ERROR_MARGIN
0.05, MINT_CANARY_FLUSH_S 0.25):

- p50 ratio: requests alternate between `canary-bot` (r1 live, a canary of r2 at 20 %) and `plain-bot` (r1, no
  canary) on the same engine, every request with a random `user`, one at a time. Target: p50 (canary) ÷ p50
  (none) ≤ 1.05.
- breach to abort: per repeat a canary of r2 is started and answers a few requests; then its LoRA is unloaded
  from the engine behind MinT's back (what a restarted engine looks like: vLLM answers 404 for it), and requests
  from users whose hash sends them to the candidate follow one after another (each is served by the live
  revision and counts as the candidate's error). The breach is when the client got the answer to the request
  that takes the candidate past the rule (a lower bound of the gateway's own moment: a request counts when it
  ends); the abort is the first 10 ms poll of the alias with no canary. Target: p95 ≤ 5 s.

    python -m benchmarks.canary [--quick] [--out DIR] [--requests N] [--repeats K]
"""

from __future__ import annotations

import os
import random
import sys
import time

import httpx

from benchmarks.common import parser, percentile, summary_ms, write_result
from benchmarks.stack import Stack

BODY = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0}
PERCENT = 20


def timed(http: httpx.Client, url: str, model: str, headers: dict, user: str) -> float:
    started = time.perf_counter()
    response = http.post(url, json=BODY | {"model": model, "user": user}, headers=headers)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{model}: {response.status_code} {response.text[:200]}")
    return elapsed


def start_canary(stack: Stack, adapter, revision) -> None:
    from serving import services
    from serving.models import Alias
    from tenants.access import Actor

    with stack.as_control_plane():
        services.revision_activate(adapter=adapter, revision=revision, by=Actor.system(), canary_percent=PERCENT)
        stack.wait(
            lambda: Alias.objects.filter(
                adapter=adapter, canary_revision=revision, canary_ready_at__isnull=False
            ).exists(),
            what="canary routing",
            timeout=180,
        )


def loaded(stack: Stack, name: str) -> bool:
    models = httpx.get(f"{stack.vllm_url}/v1/models", timeout=10).json()["data"]
    return any(m["id"] == name for m in models)


def candidate_users(alias_id: int, count: int, *, seed: int) -> list[str]:
    """`count` users the gateway sends to the candidate (the same hash it uses)."""
    from serving.gateway.canary import user_share

    rng, found = random.Random(seed), []
    while len(found) < count:
        user = f"user-{rng.getrandbits(48):x}"
        if user_share(alias_id, user) < PERCENT * 100:
            found.append(user)
    return found


def breach_index(before_ok: int, minimum: int, margin: float) -> int:
    """How many failing candidate requests, after `before_ok` answered ones, take it past the rule."""
    k = 1
    while not (before_ok + k >= minimum and k / (before_ok + k) > margin):
        k += 1
    return k


def abort_once(stack: Stack, http: httpx.Client, url: str, auth: dict, adapter, r2, *, seed: int) -> dict:
    from django.conf import settings

    from serving.models import Alias, Placement, PlacementState, lora_name

    name = lora_name(r2)
    # The candidate's placement must say what the engine holds before a canary starts on it.
    stack.wait(
        lambda: all(
            p.state != PlacementState.READY or loaded(stack, name) for p in Placement.objects.filter(revision=r2)
        ),
        what="candidate's placement in step with the engine",
        timeout=120,
    )
    start_canary(stack, adapter, r2)
    stack.wait(lambda: loaded(stack, name), what="candidate loaded", timeout=120)
    alias = Alias.objects.get(adapter=adapter, name="production")
    minimum, margin = settings.MINT_CANARY_MIN_REQUESTS, settings.MINT_CANARY_ERROR_MARGIN
    warm = 5
    users = candidate_users(alias.id, warm + minimum * 3, seed=seed)
    for user in users[:warm]:  # the candidate answers
        timed(http, url, adapter.name, auth, user)
    response = httpx.post(f"{stack.vllm_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=10)
    if response.status_code != 200:
        raise RuntimeError(f"unload {name}: {response.status_code} {response.text[:200]}")
    needed = breach_index(warm, minimum, margin)
    breach = aborted = None
    for sent, user in enumerate(users[warm:], start=1):
        timed(http, url, adapter.name, auth, user)
        if sent == needed:
            breach = time.monotonic()
            break
    if breach is None:
        raise RuntimeError("ran out of users before the breach")
    deadline = breach + 60
    while time.monotonic() < deadline:
        if not Alias.objects.filter(id=alias.id, canary_revision__isnull=False).exists():
            aborted = time.monotonic()
            break
        time.sleep(0.01)
    if aborted is None:
        from serving.services.canary import canary_counts

        counts = canary_counts(alias=Alias.objects.get(id=alias.id))
        raise RuntimeError(f"the canary was not aborted within 60 s of the breach; its counters: {counts}")
    from tenants.models import AuditEvent

    reason = AuditEvent.objects.filter(action="canary.abort").order_by("-id").values_list("after", flat=True)[0]
    return {
        "failing_requests_to_breach": needed,
        "breach_to_abort_s": round(aborted - breach, 3),
        "reason": reason.get("reason"),
    }


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=None, help="requests per path for the p50 ratio (500; quick: 60)")
    p.add_argument("--repeats", type=int, default=None, help="failing canaries aborted (10; quick: 2)")
    args = p.parse_args()
    n = args.requests or (60 if args.quick else 500)
    repeats = args.repeats or (2 if args.quick else 10)
    with Stack("canary") as stack:
        tenant, token = stack.tenant()
        adapter, r1 = stack.approved_revision(tenant, "canary-bot", seed=1)
        _, r2 = stack.approved_revision(tenant, "canary-bot", seed=2)
        plain, plain_r1 = stack.approved_revision(tenant, "plain-bot", seed=3)
        with stack.as_control_plane():
            stack.activate(adapter, r1)
            stack.activate(plain, plain_r1)
            stack.wait_live(adapter, r1)
            stack.wait_live(plain, plain_r1)
        start_canary(stack, adapter, r2)
        auth = {"Authorization": f"Bearer {token}"}
        url = f"{stack.web_url}/v1/completions"
        rng = random.Random(7)
        with_canary, without = [], []
        with httpx.Client(timeout=60) as http:
            for _ in range(20):  # warm: connections, caches, the engine, both revisions
                timed(http, url, "canary-bot", auth, f"warm-{rng.random()}")
                timed(http, url, "plain-bot", auth, f"warm-{rng.random()}")
            for i in range(n):
                pair = [("canary-bot", with_canary), ("plain-bot", without)]
                for model, into in pair if i % 2 == 0 else reversed(pair):
                    into.append(timed(http, url, model, auth, f"user-{rng.getrandbits(32)}"))
            from serving.services.canary import canary_counts
            from serving.services.rollout import canary_abort
            from tenants.access import Actor

            counts = canary_counts(alias=adapter.aliases.get(name="production"))
            with stack.as_control_plane():
                canary_abort(adapter=adapter, by=Actor.system(), reason="benchmark: next phase")
            aborts = [abort_once(stack, http, url, auth, adapter, r2, seed=100 + i) for i in range(repeats)]
    times = [a["breach_to_abort_s"] for a in aborts]
    figures = {
        "requests_per_path": n,
        "canary_percent": PERCENT,
        "with_canary": summary_ms(with_canary),
        "without_canary": summary_ms(without),
        "p50_ratio": round(percentile(with_canary, 50) / percentile(without, 50), 4),
        "split_counts": counts,
        "aborts": aborts,
        "breach_to_abort_s": {
            "n": len(times),
            "p50": round(percentile(times, 50), 3),
            "p95": round(percentile(times, 95), 3),
            "max": round(max(times), 3),
        },
        "breach_to_abort_p95_s": round(percentile(times, 95), 3),
        "target": {"p50_ratio": 1.05, "breach_to_abort_p95_s": 5.0},
        "settings": "defaults: MINT_CANARY_MIN_REQUESTS 100, MINT_CANARY_ERROR_MARGIN 0.05, MINT_CANARY_FLUSH_S 0.25",
        "engine": "vLLM CPU, generated tiny Llama (2 layers, hidden 256), LoRA rank 8",
        "placement": stack.placement,
        "benchmark_nice": os.getpriority(os.PRIO_PROCESS, 0),
    }
    path = write_result("canary", figures, quick=args.quick, out_dir=args.out)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
