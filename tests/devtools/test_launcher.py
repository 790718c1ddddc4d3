"""The launcher's web command line and environment for one or several web processes (MINT_WEB_PROCESSES)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from devtools.launcher import DEFAULT_WEB_PROCESSES, web_argv, web_env, web_processes


def test_one_web_process_is_plain_uvicorn_as_tests_and_benchmarks_start_it():
    argv = web_argv("127.0.0.1", 8123)
    assert "--workers" not in argv
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--lifespan") + 1] == "on"


def test_several_web_processes_run_under_uvicorns_process_manager():
    argv = web_argv("127.0.0.1", 8123, processes=3)
    assert argv[argv.index("--workers") + 1] == "3"
    assert argv[: len(web_argv("127.0.0.1", 8123))] == web_argv("127.0.0.1", 8123)  # the same server otherwise


def test_web_processes_come_from_the_environment_and_refuse_bad_values(monkeypatch):
    monkeypatch.delenv("MINT_WEB_PROCESSES", raising=False)
    assert web_processes() == DEFAULT_WEB_PROCESSES
    monkeypatch.setenv("MINT_WEB_PROCESSES", "4")
    assert web_processes() == 4
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("MINT_WEB_PROCESSES", bad)
        with pytest.raises(ImproperlyConfigured, match="MINT_WEB_PROCESSES"):
            web_processes()


def test_several_processes_get_an_emptied_metrics_directory_and_one_gets_none(tmp_path):
    directory = tmp_path / "prometheus"
    directory.mkdir()
    (directory / "counter_1234.db").write_bytes(b"left by an earlier run")
    env = {"PATH": "/usr/bin"}

    assert web_env(env, processes=1, metrics_dir=directory) == env
    assert (directory / "counter_1234.db").exists()  # one process: the directory is not touched

    several = web_env(env, processes=2, metrics_dir=directory)
    assert several == env | {"PROMETHEUS_MULTIPROC_DIR": str(directory)}
    assert directory.is_dir() and not list(directory.iterdir())
    assert "PROMETHEUS_MULTIPROC_DIR" not in env  # the workers' environment stays as it was


def test_forwarded_headers_are_believed_only_from_the_proxies_named(monkeypatch):
    monkeypatch.delenv("MINT_FORWARDED_ALLOW_IPS", raising=False)
    argv = web_argv("127.0.0.1", 8123)
    assert "--no-proxy-headers" in argv and "--forwarded-allow-ips" not in argv  # uvicorn would trust 127.0.0.1
    monkeypatch.setenv("MINT_FORWARDED_ALLOW_IPS", " 10.0.0.5, 10.1.0.0/16 ")
    argv = web_argv("127.0.0.1", 8123)
    assert argv[argv.index("--forwarded-allow-ips") + 1] == "10.0.0.5,10.1.0.0/16"
    assert "--proxy-headers" in argv and "--no-proxy-headers" not in argv
