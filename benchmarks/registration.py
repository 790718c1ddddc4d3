"""Registration latency over HTTP against PostgreSQL, with 1 and 16 concurrent clients.

(a) `source_uri`: the artifact is already in the store; registration only records it.
(b) a 10 MB multipart upload, streamed into the store.
The MinT paper reports 1.66 s to register a revision; the target for (a) is p95 < 50 ms.

    python -m benchmarks.registration [--quick]
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.common import (
    bench_database_url,
    bench_env,
    manage,
    parser,
    recreate_database,
    scratch,
    start_web,
    summary_ms,
    supervised,
    write_result,
)

SETUP = """
import json, os
from adapters.models import Adapter, BaseModel
from tenants import services
from tenants.access import Actor
from tenants.management.lookups import get_or_create_user
owner, _ = get_or_create_user("bench-owner")
tenant = services.tenant_create(slug="bench", owner=owner, by=Actor.system())
# A plan that measures registration itself, not the throttles and quotas around it.
type(tenant).objects.filter(id=tenant.id).update(api_write_rpm=1_000_000, api_read_rpm=1_000_000,
                                                 max_revisions=1_000_000)
base = BaseModel.objects.create(name="bench-base", architecture="dense", max_lora_rank=16, config={
    "architecture": "dense", "num_layers": 2, "num_experts": 0,
    "module_shapes": {"q_proj": [64, 64], "v_proj": [64, 32]}, "expert_module_shapes": {}})
for i in range(32):
    Adapter.objects.create(tenant=tenant, name=f"bot-{i}", base_model=base)
_, token = services.api_key_create(tenant=tenant, name="bench", scopes=["pipeline"], created_by=owner,
                                   by=Actor.system())
print(json.dumps({"token": token, "tenant_id": tenant.id}))
"""


def run(clients: int, requests_per_client: int, send) -> list[float]:
    timings: list[float] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        with httpx.Client(timeout=60) as http:
            for i in range(requests_per_client):
                started = time.perf_counter()
                response = send(http, index, i)
                elapsed = time.perf_counter() - started
                if response.status_code != 201:
                    raise RuntimeError(f"registration failed: {response.status_code} {response.text[:300]}")
                with lock:
                    timings.append(elapsed)

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return timings


def main() -> int:
    args = parser(__doc__).parse_args()
    with scratch("registration") as work, supervised(work, "web", limit=6000) as supervisor:
        db_url = bench_database_url("mint_bench_registration")
        recreate_database(db_url)
        env = bench_env(work, db_url=db_url, redis_db=14, log_level="ERROR")
        manage("migrate", "--noinput", env=env)
        setup = json.loads(manage("shell", "-c", SETUP, env=env).splitlines()[-1])
        token, tenant_id = setup["token"], setup["tenant_id"]
        incoming = work / "artifacts" / f"t/{tenant_id}/incoming/run"
        incoming.mkdir(parents=True)
        (incoming / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
        (incoming / "adapter_model.safetensors").write_bytes(os.urandom(1024))
        upload = os.urandom(10 * 1024 * 1024)
        base = start_web(supervisor, env)
        headers = {"Authorization": f"Bearer {token}"}

        def by_uri(http, index, i):
            return http.post(
                f"{base}/api/v1/adapters/bot-{index}/revisions/",
                headers=headers,
                json={"source_uri": f"t/{tenant_id}/incoming/run/", "training_step": i},
            )

        def by_upload(http, index, i):
            files = [("files", ("adapter_model.safetensors", upload)), ("files", ("adapter_config.json", b"{}"))]
            return http.post(f"{base}/api/v1/adapters/bot-{index}/revisions/", headers=headers, files=files)

        per_client = 5 if args.quick else 100
        uploads_per_client = 2 if args.quick else 10
        run(1, 3, by_uri)  # warm up connections and caches
        figures = {
            "source_uri": {
                "clients_1": summary_ms(run(1, per_client * 4, by_uri)),
                "clients_16": summary_ms(run(16, per_client, by_uri)),
            },
            "upload_10mb": {
                "clients_1": summary_ms(run(1, uploads_per_client * 2, by_upload)),
                "clients_16": summary_ms(run(16, uploads_per_client, by_upload)),
            },
        }
    figures["paper"] = {"register_s": 1.66}
    figures["target"] = {"source_uri_clients_1_p95_ms": 50}
    figures["server"] = "uvicorn, one process"
    path = write_result("registration", figures, quick=args.quick, out_dir=args.out)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
