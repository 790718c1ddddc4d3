"""The documented production environment passes Django's deployment check, and its settings do what they say.

PRODUCTION_ENVIRONMENT below is the one docs/operations.md ("Production settings") documents: a deployment
behind a TLS-terminating proxy at https://mint.example.com. Placeholders in <angle brackets> are filled in
by the test (and by the operator: each secret a long random string of its own).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PRODUCTION_ENVIRONMENT = {
    "DEBUG": "0",
    "SECRET_KEY": "<50 or more random characters>",
    "MINT_REQUIRE_SECRET_KEY": "1",
    "ALLOWED_HOSTS": "mint.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://mint.example.com",
    "DATABASE_URL": "postgres://mint:<password>@db.internal:5432/mint",
    "REDIS_URL": "redis://redis.internal:6379/0",
    "MINT_VAR_DIR": "/var/lib/mint",
    "MINT_SECURE_COOKIES": "1",
    "MINT_SSL_REDIRECT": "1",
    "MINT_HSTS_SECONDS": "31536000",
    "MINT_HSTS_INCLUDE_SUBDOMAINS": "1",
    "MINT_HSTS_PRELOAD": "1",
    "MINT_TRUSTED_PROXY_HEADER": "X-Forwarded-Proto",
    "MINT_METRICS_TOKEN": "<32 or more random characters>",
}


def production_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    """PRODUCTION_ENVIRONMENT with its placeholders filled, and nothing of this test run's own environment."""
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    env |= PRODUCTION_ENVIRONMENT | {
        "SECRET_KEY": secrets.token_urlsafe(50),
        "DATABASE_URL": f"postgres://mint:{secrets.token_urlsafe(16)}@db.internal:5432/mint",
        "MINT_VAR_DIR": str(tmp_path / "var"),
        "MINT_METRICS_TOKEN": secrets.token_urlsafe(32),
    }
    return env | overrides


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_production_environment_passes_the_deploy_check_without_a_warning(tmp_path):
    checked = run(["manage.py", "check", "--deploy", "--fail-level", "WARNING"], production_env(tmp_path))
    output = checked.stdout + checked.stderr
    assert checked.returncode == 0, output
    assert "WARNING" not in output.upper(), output
    assert "System check identified no issues" in output, output
    assert not (tmp_path / "var" / "secret_key").exists()  # the configured key, not a generated one


SHOW_SETTINGS = """
import json, django
django.setup()
from django.conf import settings as s
print(json.dumps({name: getattr(s, name, None) for name in [
    "DEBUG", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_HSTS_SECONDS", "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_HSTS_PRELOAD", "SECURE_SSL_REDIRECT", "SECURE_PROXY_SSL_HEADER", "SECURE_REDIRECT_EXEMPT",
]}))
"""


def show_settings(env: dict[str, str]) -> dict:
    shown = run(["-c", SHOW_SETTINGS], env | {"DJANGO_SETTINGS_MODULE": "mint_site.settings"})
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout.strip().splitlines()[-1])


def test_production_environment_turns_every_https_setting_on(tmp_path):
    assert show_settings(production_env(tmp_path)) == {
        "DEBUG": False,
        "SESSION_COOKIE_SECURE": True,
        "CSRF_COOKIE_SECURE": True,
        "SECURE_HSTS_SECONDS": 31536000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
        "SECURE_HSTS_PRELOAD": True,
        "SECURE_SSL_REDIRECT": True,
        "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"],
        "SECURE_REDIRECT_EXEMPT": ["^healthz$", "^readyz$"],
    }


def test_defaults_keep_plain_http_working_for_make_run(tmp_path):
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    shown = show_settings(env | {"MINT_VAR_DIR": str(tmp_path / "var")})
    assert shown["SESSION_COOKIE_SECURE"] is False and shown["CSRF_COOKIE_SECURE"] is False
    assert shown["SECURE_SSL_REDIRECT"] is False and shown["SECURE_HSTS_SECONDS"] == 0
    assert shown["SECURE_PROXY_SSL_HEADER"] is None


@pytest.mark.parametrize(
    ("name", "value", "complaint"),
    [
        ("MINT_TRUSTED_PROXY_HEADER", "X-Forwarded-Proto: https", "MINT_TRUSTED_PROXY_HEADER"),
        ("MINT_METRICS_TOKEN", "short", "MINT_METRICS_TOKEN"),
    ],
)
def test_a_bad_security_setting_stops_the_process(tmp_path, name, value, complaint):
    started = run(
        ["-c", "import django; django.setup()"],
        production_env(tmp_path, **{name: value}) | {"DJANGO_SETTINGS_MODULE": "mint_site.settings"},
    )
    assert started.returncode != 0
    assert "ImproperlyConfigured" in started.stderr and complaint in started.stderr


@pytest.mark.django_db
def test_ssl_redirect_spares_the_probes(client, settings):
    settings.SECURE_SSL_REDIRECT = True
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    login = client.get("/login/")
    assert login.status_code == 301 and login["Location"] == "https://testserver/login/"
    metrics = client.get("/metrics")
    assert metrics.status_code == 301  # the scraper's token never travels in the clear


@pytest.mark.django_db
def test_the_trusted_proxy_header_marks_requests_secure(client, settings):
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    assert client.get("/login/", HTTP_X_FORWARDED_PROTO="https").status_code == 200
    assert client.get("/login/", HTTP_X_FORWARDED_PROTO="http").status_code == 301
