"""Resumable uploads against one multipart POST, over HTTP against PostgreSQL (uvicorn, one process).

- Throughput: a 200 MB archive (`.tar` of `adapter_config.json` and a random `adapter_model.safetensors`)
  registered with one multipart POST, and over the resumable path (open a session, PUT its parts one after
  another with their SHA-256, complete), alternating, `--repeats` times each; bytes ÷ seconds from the first
  byte sent to the 201 of the revision. Target: resumable ÷ one POST ≥ 0.9 (medians).
- Resume: a resumable upload whose connection is cut in the middle of the part after half of them (a raw socket
  sends half of that part and closes); a new client reads the session, sends only the parts not `received` and
  completes. Target: only the unfinished parts are sent again (parts resent = parts - parts received before the
  cut), and the archive registered is byte-identical (its sha256).

The tenant's plan is raised so that the throttles and quotas are not what is measured.

    python -m benchmarks.upload [--quick] [--out DIR] [--megabytes N] [--repeats K]
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import statistics
import sys
import tarfile
import time
from urllib.parse import urlsplit

import httpx

from benchmarks.common import (
    bench_database_url,
    bench_env,
    manage,
    parser,
    recreate_database,
    scratch,
    start_web,
    supervised,
    write_result,
)
from benchmarks.report.plots import plot_result

SETUP = """
import json
from adapters.models import Adapter, BaseModel
from tenants import services
from tenants.access import Actor
from tenants.management.lookups import get_or_create_user
owner, _ = get_or_create_user("bench-owner")
tenant = services.tenant_create(slug="bench", owner=owner, by=Actor.system())
big = 1 << 40
type(tenant).objects.filter(id=tenant.id).update(api_write_rpm=1_000_000, api_read_rpm=1_000_000,
    max_revisions=1_000_000, max_upload_bytes=big, max_storage_bytes=big)
base = BaseModel.objects.create(name="bench-base", architecture="dense", max_lora_rank=16, config={
    "architecture": "dense", "num_layers": 2, "num_experts": 0,
    "module_shapes": {"q_proj": [64, 64], "v_proj": [64, 32]}, "expert_module_shapes": {}})
Adapter.objects.create(tenant=tenant, name="big-bot", base_model=base)
_, token = services.api_key_create(tenant=tenant, name="bench", scopes=["pipeline"], created_by=owner,
                                   by=Actor.system())
print(json.dumps({"token": token}))
"""

URL = "/api/v1/adapters/big-bot"


def archive(megabytes: int) -> bytes:
    """A tar of a PEFT-shaped adapter whose weights file is `megabytes` of random bytes (tar adds no compression)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (
            ("adapter_config.json", json.dumps({"peft_type": "LORA", "r": 4}).encode()),
            ("adapter_model.safetensors", os.urandom(megabytes * 1024 * 1024)),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def one_post(http: httpx.Client, data: bytes, step: int) -> tuple[float, str]:
    started = time.perf_counter()
    response = http.post(
        f"{URL}/revisions/",
        files=[("archive", ("adapter.tar", data, "application/x-tar"))],
        data={"training_step": str(step), "allow_duplicate": "true"},
    )
    elapsed = time.perf_counter() - started
    if response.status_code != 201:
        raise RuntimeError(f"one POST: {response.status_code} {response.text[:300]}")
    return elapsed, response.json()["sha256"]


def open_session(http: httpx.Client, data: bytes) -> dict:
    declared = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "filename": "adapter.tar"}
    response = http.post(f"{URL}/uploads/", json=declared)
    if response.status_code != 201:
        raise RuntimeError(f"open: {response.status_code} {response.text[:300]}")
    return response.json()


def part_of(data: bytes, session: dict, number: int) -> bytes:
    size = session["part_size"]
    return data[(number - 1) * size : number * size]


def put_part(http: httpx.Client, session: dict, number: int, body: bytes) -> None:
    response = http.put(
        f"{URL}/uploads/{session['id']}/parts/{number}/",
        content=body,
        headers={"X-Mint-Part-Sha256": hashlib.sha256(body).hexdigest(), "Content-Type": "application/octet-stream"},
    )
    if response.status_code != 200:
        raise RuntimeError(f"part {number}: {response.status_code} {response.text[:300]}")


def complete(http: httpx.Client, session: dict, step: int) -> dict:
    response = http.post(
        f"{URL}/uploads/{session['id']}/complete/", json={"training_step": step, "allow_duplicate": True}
    )
    if response.status_code != 201:
        raise RuntimeError(f"complete: {response.status_code} {response.text[:300]}")
    return response.json()


def resumable(http: httpx.Client, data: bytes, step: int) -> float:
    started = time.perf_counter()
    session = open_session(http, data)
    for number in range(1, session["parts"] + 1):
        put_part(http, session, number, part_of(data, session, number))
    complete(http, session, step)
    return time.perf_counter() - started


def cut_mid_part(base: str, token: str, session: dict, number: int, body: bytes) -> None:
    """Send half of part `number` on a raw socket and close it: the connection a pipeline loses midway."""
    target = urlsplit(base)
    head = (
        f"PUT {URL}/uploads/{session['id']}/parts/{number}/ HTTP/1.1\r\nHost: {target.netloc}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/octet-stream\r\n"
        f"X-Mint-Part-Sha256: {hashlib.sha256(body).hexdigest()}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((target.hostname, target.port), timeout=30) as sock:
        sock.sendall(head.encode() + body[: len(body) // 2])


def resume_after_cut(http: httpx.Client, base: str, token: str, data: bytes, step: int, *, expected: str) -> dict:
    session = open_session(http, data)
    half = session["parts"] // 2
    for number in range(1, half + 1):
        put_part(http, session, number, part_of(data, session, number))
    cut_mid_part(base, token, session, half + 1, part_of(data, session, half + 1))
    cut_at = time.perf_counter()
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=300) as fresh:
        state = fresh.get(f"{URL}/uploads/{session['id']}/").json()
        missing = [n for n in range(1, session["parts"] + 1) if n not in state["received"]]
        for number in missing:
            put_part(fresh, session, number, part_of(data, session, number))
        revision = complete(fresh, session, step)
    return {
        "parts": session["parts"],
        "part_bytes": session["part_size"],
        "received_before_cut": len(state["received"]),
        "parts_resent": len(missing),
        "only_unfinished_resent": len(missing) == session["parts"] - half,
        "resume_to_revision_s": round(time.perf_counter() - cut_at, 3),
        # The revision's digest is over its files: equal to the one-shot upload's of the same archive.
        "sha256_identical": revision["sha256"] == expected,
        "revision": revision.get("number"),
    }


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--megabytes", type=int, default=None, help="size of the weights file (200; quick: 24)")
    p.add_argument("--repeats", type=int, default=None, help="uploads per path (5; quick: 1)")
    p.add_argument("--database", default="mint_bench_upload", help="the benchmark's database name")
    args = p.parse_args()
    megabytes = args.megabytes or (24 if args.quick else 200)
    repeats = args.repeats or (1 if args.quick else 5)
    with scratch("upload") as work, supervised(work, "web", limit=6000) as supervisor:
        db_url = bench_database_url(args.database)
        recreate_database(db_url)
        env = bench_env(work, db_url=db_url, redis_db=13, log_level="ERROR")
        manage("migrate", "--noinput", env=env)
        token = json.loads(manage("shell", "-c", SETUP, env=env).splitlines()[-1])["token"]
        data = archive(megabytes)
        base = start_web(supervisor, env)
        headers = {"Authorization": f"Bearer {token}"}
        posts, sessions = [], []
        with httpx.Client(base_url=base, headers=headers, timeout=600) as http:
            step = 0
            for _ in range(repeats):  # alternating, so drift hits both paths alike
                step += 1
                elapsed, digest = one_post(http, data, step)
                posts.append(elapsed)
                step += 1
                sessions.append(resumable(http, data, step))
            resume = resume_after_cut(http, base, token, data, step + 1, expected=digest)
    mb = len(data) / 1e6
    post_mbps = [mb / s for s in posts]
    session_mbps = [mb / s for s in sessions]
    figures = {
        "archive_mb": round(mb, 1),
        "repeats": repeats,
        "one_post_mb_per_s": {
            "median": round(statistics.median(post_mbps), 1),
            "all": [round(x, 1) for x in post_mbps],
        },
        "resumable_mb_per_s": {
            "median": round(statistics.median(session_mbps), 1),
            "all": [round(x, 1) for x in session_mbps],
        },
        "throughput_ratio": round(statistics.median(session_mbps) / statistics.median(post_mbps), 3),
        "resume": resume,
        "target": {"throughput_ratio": 0.9, "only_unfinished_resent": True},
        "server": "uvicorn, one process; filesystem store",
    }
    path = write_result("upload", figures, quick=args.quick, out_dir=args.out)
    plot_result(path)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
