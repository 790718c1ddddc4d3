"""The `oidc_provider` fixture: the test OpenID Connect provider (tests/oidc_provider/) in its own process, with
its people and client applications, and a helper that signs a person in through it like a browser would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from devtools.supervisor import free_port

REPO = Path(__file__).resolve().parents[2]
CALLBACK = "http://testserver/sso/callback/"
PEOPLE = [
    {"username": "ada", "password": "ada-at-the-idp", "email": "ada@idp.example"},
    {"username": "eve", "password": "eve-at-the-idp", "email": "eve@idp.example"},
]
# Applications registered at the provider; all but `mint` misbehave on purpose (tests/oidc_provider/validator.py).
CLIENTS = ["mint", "forger", "other-issuer", "wrong-audience"]


def _pem(path: Path) -> Path:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


@dataclass
class Provider:
    url: str
    process: subprocess.Popen
    log: Path

    def secret_of(self, client: str) -> str:
        return f"{client}-secret"

    def endpoints(self) -> dict[str, str]:
        return {
            "issuer": self.url,
            "authorization_endpoint": f"{self.url}/o/authorize/",
            "token_endpoint": f"{self.url}/o/token/",
            "userinfo_endpoint": f"{self.url}/o/userinfo/",
            "jwks_uri": f"{self.url}/o/.well-known/jwks.json",
        }

    def sign_in(self, mint_client, tenant_slug: str, username: str):
        """Sign `username` in to MinT's `/sso/<tenant>/` through this provider, as a browser would: MinT's side
        runs in `mint_client` (Django's test client), the provider's over HTTP. Returns MinT's last answer."""
        start = mint_client.get(f"/sso/{tenant_slug}/")
        if start.status_code != 302:
            return start
        browser = requests.Session()
        answer = browser.get(start["Location"], allow_redirects=False, timeout=10)
        assert answer.status_code == 302, answer.text[:500]
        login_url = urljoin(self.url, answer.headers["Location"])
        browser.get(login_url, timeout=10)
        password = next(p["password"] for p in PEOPLE if p["username"] == username)
        next_url = dict(part.split("=", 1) for part in urlsplit(login_url).query.split("&"))["next"]
        signed = browser.post(
            login_url,
            data={
                "csrfmiddlewaretoken": browser.cookies["csrftoken"],
                "username": username,
                "password": password,
                "next": requests.utils.unquote(next_url),
            },
            allow_redirects=False,
            timeout=10,
        )
        assert signed.status_code == 302, signed.text[:500]
        back = browser.get(urljoin(self.url, signed.headers["Location"]), allow_redirects=False, timeout=10)
        assert back.status_code == 302 and back.headers["Location"].startswith(CALLBACK), back.text[:500]
        return mint_client.get(back.headers["Location"].removeprefix("http://testserver"))


@pytest.fixture(scope="session")
def oidc_provider(tmp_path_factory):
    """A real OpenID Connect provider (django-oauth-toolkit) on a free loopback port, for the whole session."""
    work = tmp_path_factory.mktemp("oidc-provider")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spec = {
        "users": PEOPLE,
        "clients": [
            {"name": name, "client_id": name, "client_secret": f"{name}-secret", "redirect_uri": CALLBACK}
            for name in CLIENTS
        ],
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = os.environ | {
        "OIDC_PROVIDER_URL": url,
        "OIDC_PROVIDER_DB": str(work / "provider.sqlite3"),
        "OIDC_PROVIDER_KEY": str(_pem(work / "key.pem")),
        "OIDC_PROVIDER_FORGER_KEY": str(_pem(work / "forger.pem")),
    }
    log = work / "provider.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.oidc_provider.serve", str(port), str(work / "spec.json")],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    provider = Provider(url=url, process=process, log=log)
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(f"{url}/o/.well-known/openid-configuration", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the OIDC provider did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    yield provider
    process.terminate()
    process.wait(timeout=10)
