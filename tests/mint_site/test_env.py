from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from mint_site.env import env_bool, env_choice, env_float, env_int, env_list, parse_database_url


def test_env_bool_reads_common_spellings(monkeypatch):
    monkeypatch.setenv("X_FLAG", "Yes")
    assert env_bool("X_FLAG", False) is True
    monkeypatch.setenv("X_FLAG", "0")
    assert env_bool("X_FLAG", True) is False
    monkeypatch.delenv("X_FLAG")
    assert env_bool("X_FLAG", True) is True


def test_env_bool_refuses_nonsense_naming_the_variable(monkeypatch):
    monkeypatch.setenv("X_FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="X_FLAG"):
        env_bool("X_FLAG", False)


def test_env_int_checks_type_and_minimum(monkeypatch):
    monkeypatch.setenv("X_NUM", "12")
    assert env_int("X_NUM", 1) == 12
    monkeypatch.setenv("X_NUM", "twelve")
    with pytest.raises(ImproperlyConfigured, match="X_NUM"):
        env_int("X_NUM", 1)
    monkeypatch.setenv("X_NUM", "0")
    with pytest.raises(ImproperlyConfigured, match="minimum"):
        env_int("X_NUM", 1, minimum=1)


def test_env_float_checks_type_and_minimum(monkeypatch):
    monkeypatch.setenv("X_SECONDS", "0.25")
    assert env_float("X_SECONDS", 1.0) == 0.25
    monkeypatch.setenv("X_SECONDS", "soon")
    with pytest.raises(ImproperlyConfigured, match="X_SECONDS"):
        env_float("X_SECONDS", 1.0)
    monkeypatch.setenv("X_SECONDS", "-1")
    with pytest.raises(ImproperlyConfigured, match="minimum"):
        env_float("X_SECONDS", 1.0, minimum=0)


def test_env_list_and_choice(monkeypatch):
    monkeypatch.setenv("X_LIST", " a, b ,,c")
    assert env_list("X_LIST", []) == ["a", "b", "c"]
    monkeypatch.setenv("X_CHOICE", "S3")
    assert env_choice("X_CHOICE", "filesystem", ("filesystem", "s3")) == "s3"
    monkeypatch.setenv("X_CHOICE", "ftp")
    with pytest.raises(ImproperlyConfigured, match="X_CHOICE"):
        env_choice("X_CHOICE", "filesystem", ("filesystem", "s3"))


def test_parse_postgres_url():
    db = parse_database_url("postgres://u:p%40ss@db.example:5433/mint?sslmode=require", base_dir=Path("/srv"))
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["USER"], db["PASSWORD"], db["HOST"], db["PORT"], db["NAME"]) == (
        "u",
        "p@ss",
        "db.example",
        5433,
        "mint",
    )
    assert db["OPTIONS"] == {"sslmode": "require", "pool": {"min_size": 1, "max_size": 10, "timeout": 10}}
    assert (db["CONN_MAX_AGE"], db["CONN_HEALTH_CHECKS"]) == (0, True)
    unpooled = parse_database_url("postgres://u@h/mint?pool=0&conn_max_age=60", base_dir=Path("/srv"))
    assert "pool" not in unpooled["OPTIONS"]
    assert unpooled["CONN_MAX_AGE"] == 60


def test_parse_sqlite_urls():
    assert parse_database_url("sqlite:///var/x.db", base_dir=Path("/srv"))["NAME"] == "/srv/var/x.db"
    absolute = parse_database_url("sqlite:////tmp/x.db", base_dir=Path("/srv"))
    assert absolute["NAME"] == "/tmp/x.db"
    assert absolute["OPTIONS"] == {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
    }


@pytest.mark.parametrize("url", ["mysql://u@h/db", "postgres://u@h/", "sqlite://", "ftp://h/x"])
def test_unsupported_database_urls_are_refused(url):
    with pytest.raises(ImproperlyConfigured):
        parse_database_url(url, base_dir=Path("/srv"))
