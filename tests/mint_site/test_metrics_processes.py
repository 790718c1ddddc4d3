"""/metrics with several web processes: prometheus_client's multiprocess mode (mint_site/metrics.py).

Other processes write the metric files here, as the web processes of `uvicorn --workers` do; this process
serves /metrics over them (tests/e2e/test_web_processes.py runs the real two-process server).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from adapters.models import BaseModel
from devtools.supervisor import BASE_DIR
from mint_site.env import env_dir
from tests.factories import ServingNodeFactory
from tests.metrics_scrape import scrape_metrics

# Another web process: counts gateway requests into the directory, under the same metric the gateway defines.
COUNTING_PROCESS = """
import sys
from prometheus_client import Counter
requests = Counter("mint_gateway_requests_total", "-", ["tenant", "adapter", "status"])
requests.labels("acme", "bot", "200").inc(int(sys.argv[1]))
"""


def _run(source: str, *args: str, directory: Path, **env: str) -> None:
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        cwd=BASE_DIR,
        env=os.environ | {"PROMETHEUS_MULTIPROC_DIR": str(directory)} | env,
        check=True,
        timeout=60,
    )


@pytest.mark.django_db
def test_metrics_sum_every_processs_counts_and_show_database_series_once(client, tmp_path):
    for count in (2, 3):
        _run(COUNTING_PROCESS, str(count), directory=tmp_path)
    base_model = BaseModel.objects.create(name="m", architecture="dense", config={}, max_lora_rank=16)
    ServingNodeFactory(name="n1", base_model=base_model)

    with override_settings(PROMETHEUS_MULTIPROC_DIR=tmp_path):
        text = scrape_metrics(client)

    assert len(list(tmp_path.glob("counter_*.db"))) == 2
    assert 'mint_gateway_requests_total{adapter="bot",status="200",tenant="acme"} 5.0' in text
    assert text.count('mint_node_up{node="n1",state="up"}') == 1  # from the database, once per scrape
    assert "process_cpu_seconds_total" not in text and "python_gc_objects_collected_total" not in text


@pytest.mark.django_db
def test_metrics_of_one_process_stay_in_memory(client):
    client.get("/healthz")
    text = scrape_metrics(client)
    assert 'mint_http_requests_total{method="GET",route="healthz",status="200"}' in text
    assert "process_cpu_seconds_total" in text or "python_gc_objects_collected_total" in text


def test_a_web_process_that_exits_drops_its_live_gauges_and_keeps_its_counts(tmp_path):
    # A live gauge ("livesum") counts only processes still running: a process's exit must remove its file.
    _run(
        """
        import django
        django.setup()
        import mint_site.metrics
        from prometheus_client import Counter, Gauge
        Gauge("probe_open", "-", multiprocess_mode="livesum").set(3)
        Counter("probe_total", "-").inc()
        import glob, os, sys
        assert glob.glob(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "gauge_livesum_*.db"))
        """,
        directory=tmp_path,
        DJANGO_SETTINGS_MODULE="mint_site.settings",
    )
    assert not list(tmp_path.glob("gauge_livesum_*.db"))
    assert len(list(tmp_path.glob("counter_*.db"))) == 1  # a gone process's counts still count


def test_env_dir_names_an_existing_directory_or_refuses(monkeypatch, tmp_path):
    monkeypatch.delenv("X_DIR", raising=False)
    assert env_dir("X_DIR") is None
    monkeypatch.setenv("X_DIR", str(tmp_path))
    assert env_dir("X_DIR") == tmp_path
    for bad in (str(tmp_path / "missing"), "", "  "):
        monkeypatch.setenv("X_DIR", bad)
        with pytest.raises(ImproperlyConfigured, match="X_DIR"):
            env_dir("X_DIR")
