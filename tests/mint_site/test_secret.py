"""SECRET_KEY: the configured one, else one generated once per installation, never one from the repository."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from mint_site.secret import KEY_FILE_NAME, secret_key

REPO = Path(__file__).resolve().parents[2]


def test_a_configured_key_is_used_as_it_is(tmp_path):
    assert secret_key(configured="k" * 60, var_dir=tmp_path, require=True) == "k" * 60
    assert not (tmp_path / KEY_FILE_NAME).exists()


def test_without_a_key_one_is_generated_once_private_and_kept(tmp_path, caplog):
    var_dir = tmp_path / "var"  # not there yet, as on a first `make run`
    with caplog.at_level(logging.WARNING, logger="mint_site.secret"):
        first = secret_key(configured="", var_dir=var_dir, require=False)
    path = var_dir / KEY_FILE_NAME
    assert len(first) >= 50 and len(set(first)) >= 5  # what Django's deploy check asks of a key
    assert path.read_text().strip() == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "SECRET_KEY is not set" in caplog.text and "production must set SECRET_KEY" in caplog.text
    assert secret_key(configured="", var_dir=var_dir, require=False) == first
    assert [p.name for p in var_dir.iterdir()] == [KEY_FILE_NAME]  # no temporary file left behind


def test_each_installation_gets_its_own_key(tmp_path):
    one = secret_key(configured="", var_dir=tmp_path / "one", require=False)
    two = secret_key(configured="", var_dir=tmp_path / "two", require=False)
    assert one != two


def test_processes_starting_at_once_agree_on_one_key(tmp_path):
    barrier = threading.Barrier(8)
    keys: list[str] = []

    def start() -> None:
        barrier.wait()
        keys.append(secret_key(configured="", var_dir=tmp_path, require=False))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8 and len(set(keys)) == 1
    assert (tmp_path / KEY_FILE_NAME).read_text().strip() == keys[0]
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE_NAME]


def test_an_empty_key_file_is_refused_not_used(tmp_path):
    (tmp_path / KEY_FILE_NAME).write_text("")
    with pytest.raises(ImproperlyConfigured, match="empty"):
        secret_key(configured="", var_dir=tmp_path, require=False)


def test_required_key_refuses_to_start_without_one_even_in_debug(tmp_path):
    with pytest.raises(ImproperlyConfigured, match="MINT_REQUIRE_SECRET_KEY"):
        secret_key(configured="", var_dir=tmp_path, require=True)
    assert not (tmp_path / KEY_FILE_NAME).exists()

    env = {k: v for k, v in os.environ.items() if k != "SECRET_KEY"}
    env |= {"MINT_REQUIRE_SECRET_KEY": "1", "DEBUG": "1", "MINT_VAR_DIR": str(tmp_path)}
    started = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=REPO,
        env=env | {"DJANGO_SETTINGS_MODULE": "mint_site.settings"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert "ImproperlyConfigured" in started.stderr and "MINT_REQUIRE_SECRET_KEY" in started.stderr


def test_the_old_repository_key_is_gone():
    assert settings.SECRET_KEY != "mint-insecure-local-development-key"
    assert "mint-insecure" not in (REPO / "mint_site" / "settings.py").read_text()


def test_a_var_dir_that_cannot_hold_the_key_stops_start_up_with_a_way_out(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ImproperlyConfigured, match="set SECRET_KEY"):
        secret_key(configured="", var_dir=blocker / "var", require=False)
