"""`make run`'s launcher on its embedded default: SQLite, a private Redis, web and worker; Ctrl-C stops it all.

Even when it was started in the background, where SIGINT arrives ignored (tests/devtools/test_stop_signals.py
checks the same with children that ignore SIGTERM).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from devtools.supervisor import BASE_DIR, STOP_GRACE_S, free_port

pytestmark = pytest.mark.e2e


def get(url: str, token: str | None = None) -> tuple[int, dict | str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def test_launcher_serves_the_demo_and_stops_everything_on_ctrl_c(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    # The vLLM node is exercised by test_serving.py; here the launcher's own services are checked.
    env |= {"MINT_VAR_DIR": str(tmp_path / "var"), "MINT_PORT": str(port), "MINT_LOCAL_NODE": "0"}
    # Started in the background by a non-interactive shell, as `make run &` would be: SIGINT arrives ignored.
    shell = subprocess.Popen(
        ["sh", "-c", '"$@" & wait', "sh", sys.executable, "-m", "devtools.launcher"],
        cwd=BASE_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = ""
    try:
        # Migrations, the seed and four processes starting: well under a minute on a quiet machine; a loaded one
        # (the suite's own engines beside it) has taken more than two.
        deadline = time.monotonic() + 300
        while "Press Ctrl-C" not in output and time.monotonic() < deadline:
            line = shell.stdout.readline()
            assert line or shell.poll() is None, output
            output += line
        found = re.search(r"demo key:\s+(\S+)", output)
        assert found, f"the launcher did not finish starting within 300 s:\n{output}"
        token = found.group(1)
        base = f"http://127.0.0.1:{port}"

        (launcher,) = psutil.Process(shell.pid).children()
        children = launcher.children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "uvicorn" in names and "celery" in names
        assert "-Q webhooks" in names  # deliveries on a worker of their own, apart from the control worker

        assert get(f"{base}/healthz")[0] == 200
        assert get(f"{base}/readyz") == (200, {"status": "ok", "checks": {"database": "ok", "redis": "ok"}})
        status, docs = get(f"{base}/api/docs/")
        assert status == 200 and "swagger-ui" in docs
        status, me = get(f"{base}/api/v1/", token)
        assert status == 200 and me["tenant"] == "demo"
        assert get(f"{base}/api/v1/")[0] == 401
        # DEBUG=1, yet an anonymous caller gets the plain 404, not the page of every URL pattern.
        status, missing = get(f"{base}/no-such-page/")
        assert status == 404 and missing["error"]["code"] == "not_found"
        assert (tmp_path / "var" / "mint.sqlite3").exists()
    finally:
        for launcher in psutil.Process(shell.pid).children():
            launcher.send_signal(signal.SIGINT)
        # Within the supervisor's grace (then its SIGKILL), with room for a busy machine.
        shell.wait(timeout=STOP_GRACE_S + 20)
    assert "Stopping" in shell.stdout.read()
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
