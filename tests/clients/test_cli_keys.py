"""`mint login`, `mint logout` and `mint keys …` through `main(argv)` against the live app: a person's session,
kept 0600 per base URL, manages keys (owners only); without one the CLI exits 6 saying to run `mint login`."""

from __future__ import annotations

import io
import json
import stat
import sys
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from axes.utils import reset
from django.contrib.sessions.models import Session as DjangoSession
from mint_client import AuthError, Client, NotSignedIn, Session, SessionStore, StoredSession
from mint_client.cli import main
from mint_client.cli.keys import parse_expires

from tenants.models import ApiKey, Role
from tests.factories import PASSWORD, MembershipFactory

OWNER, DEVELOPER = "acme-owner", "acme-developer"
LIVE_SERVER_ADDRESS = "127.0.0.1"  # where the live server sees the CLI come from (django-axes counts per address)


@pytest.fixture(autouse=True)
def _clean_login_counters():
    def clear() -> None:
        for username in (OWNER, DEVELOPER):
            reset(username=username, ip=LIVE_SERVER_ADDRESS)

    clear()
    yield
    clear()


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    directory = tmp_path / "mint-config"
    monkeypatch.setenv("MINT_CONFIG_DIR", str(directory))
    return directory


@pytest.fixture
def mint(live_mint, config_dir, capsys, monkeypatch):
    """`mint(*argv, stdin=None) -> (exit code, JSON printed or None)`, with --json and the live app's URL."""

    def call(*argv: str, stdin: str | None = None, json_out: bool = True):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin or ""))
        extra = ["--json"] if json_out else []
        code = main([*argv, *extra, "--base-url", live_mint.url])
        out, err = capsys.readouterr()
        if not json_out:
            return code, out, err
        return code, (json.loads(out) if out.strip() else None)

    return call


def login(mint, username: str = OWNER, password: str = PASSWORD, *extra: str):
    return mint("login", "--username", username, "--password-stdin", *extra, stdin=password + "\n")


def test_login_keeps_the_session_0600_and_the_owner_lists_creates_and_revokes_keys(mint, live_mint, config_dir):
    code, out = login(mint)
    assert code == 0, out
    assert (out["user"], out["tenant"], out["base_url"]) == (OWNER, "acme", live_mint.url)
    path = config_dir / "sessions.json"
    assert out["session_file"] == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(config_dir.stat().st_mode) == 0o700
    kept = json.loads(path.read_text())["sessions"][live_mint.url]
    assert kept["user"] == OWNER and kept["csrf_token"] and kept["cookies"].get("sessionid")
    assert PASSWORD not in path.read_text()
    assert "csrf_token" not in json.dumps(out) and kept["cookies"]["sessionid"] not in json.dumps(out)

    code, key = mint(
        "keys", "create", "trainer", "--scopes", "pipeline,deploy", "--expires", "30d", "--adapters", "a,b"
    )
    assert code == 0, key
    assert key["token"].startswith(f"mint_{key['prefix']}_")
    assert (key["name"], sorted(key["scopes"]), key["created_by"], key["adapters"]) == (
        "trainer",
        ["deploy", "pipeline"],
        OWNER,
        ["a", "b"],
    )
    expires = datetime.fromisoformat(key["expires_at"].replace("Z", "+00:00"))
    assert abs(expires - (datetime.now(UTC) + timedelta(days=30))) < timedelta(minutes=5)
    with Client(live_mint.url, key["token"], retries=0) as made:
        assert sorted(made.whoami().scopes) == ["deploy", "pipeline"]

    code, listed = mint("keys", "list")
    assert code == 0 and key["prefix"] in [k["prefix"] for k in listed]
    assert all("token" not in k for k in listed)

    code, out = mint("keys", "revoke", key["prefix"])
    assert code == 0 and out == {"revoked": key["prefix"]}
    with Client(live_mint.url, key["token"], retries=0) as revoked, pytest.raises(AuthError) as refused:
        revoked.whoami()
    assert refused.value.code == "api_key_revoked"


def test_a_new_keys_token_is_printed_once_alone_on_stdout(mint, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = mint("login", "--username", OWNER, "--password-stdin", stdin=PASSWORD, json_out=False)
    assert code == 0 and f"as {OWNER}, tenant acme (owner)" in out and "readable by you only" in out
    code, out, err = mint("keys", "create", "ci", "--scopes", "pipeline", json_out=False)
    assert code == 0
    token = out.strip()
    assert token.startswith("mint_") and "\n" not in token
    assert "shown this once" in err
    prefix = token.split("_")[1]
    assert ApiKey.objects.get(prefix=prefix).name == "ci"
    code, out, _ = mint("keys", "list", json_out=False)
    assert code == 0 and f"mint_{prefix}_…" in out and token not in out


def test_keys_without_a_session_exit_6_and_say_to_run_mint_login(mint, config_dir):
    code, out = mint("keys", "list")
    assert code == 6 and out["exit_code"] == 6
    assert out["error"]["code"] == "not_signed_in" and "mint login" in out["error"]["message"]
    assert not (config_dir / "sessions.json").exists()


def test_a_stored_csrf_token_that_no_longer_fits_exits_6_and_says_to_run_mint_login(mint, live_mint, config_dir):
    assert login(mint)[0] == 0
    store = SessionStore(config_dir)
    kept = store.get(live_mint.url)
    kept.csrf_token = "x" * 32
    store.put(kept)
    assert mint("keys", "list")[0] == 0  # reads need no token
    code, out = mint("keys", "create", "x", "--scopes", "pipeline")
    assert code == 6 and "mint login" in out["error"]["message"] and "CSRF" in out["error"]["message"]
    assert not ApiKey.objects.filter(name="x").exists()


def test_a_session_the_server_ended_exits_6_and_says_to_run_mint_login(mint):
    assert login(mint)[0] == 0
    DjangoSession.objects.all().delete()  # expired, or ended elsewhere
    code, out = mint("keys", "create", "x", "--scopes", "pipeline")
    assert code == 6
    assert out["error"]["code"] == "not_signed_in" and "mint login" in out["error"]["message"]


def test_logout_ends_the_session_on_the_server_and_forgets_it(mint, live_mint, config_dir):
    assert login(mint)[0] == 0
    kept = SessionStore(config_dir).get(live_mint.url)
    code, out = mint("logout")
    assert code == 0 and out["signed_out"] is True
    assert SessionStore(config_dir).get(live_mint.url) is None
    # The old cookie is worth nothing now, even to someone who copied it.
    answer = httpx.get(f"{live_mint.url}/api/v1/keys/", cookies=kept.cookies)
    assert answer.status_code == 401
    assert mint("keys", "list")[0] == 6
    assert mint("logout") == (0, {"base_url": live_mint.url, "signed_out": False})


def test_a_non_owner_cannot_create_keys_exit_4_with_the_servers_reason(mint):
    assert login(mint, DEVELOPER)[0] == 0
    code, out = mint("keys", "create", "mine", "--scopes", "pipeline")
    assert code == 4
    assert out["error"]["code"] == "forbidden"
    assert "developer" in out["error"]["message"] and "needs owner" in out["error"]["message"]
    assert not ApiKey.objects.filter(name="mine").exists()
    assert mint("keys", "list")[0] == 4


def test_another_tenants_key_prefix_cannot_be_revoked_exit_5(mint, tenant_b):
    b_key, _ = tenant_b.key("pipeline")
    assert login(mint)[0] == 0
    code, out = mint("keys", "revoke", b_key.prefix)
    assert code == 5 and out["error"]["code"] == "not_found"
    b_key.refresh_from_db()
    assert b_key.revoked_at is None
    assert mint("keys", "revoke", "000000000000")[1]["error"] == out["error"]  # the same as for no such key


def test_a_wrong_password_exits_6_and_five_lock_the_username_out(mint, config_dir):
    codes = [login(mint, OWNER, "wrong") for _ in range(5)]
    assert [c for c, _ in codes] == [6] * 5
    assert [o["error"]["code"] for _, o in codes] == ["invalid_credentials"] * 4 + ["login_locked_out"]

    code, out = login(mint)  # the right password, too late
    assert code == 6
    assert out["error"]["code"] == "login_locked_out" and out["error"]["status"] == 429
    assert "try again in 15 minute" in out["error"]["message"]
    assert not (config_dir / "sessions.json").exists()


def test_login_asks_for_the_password_without_echo(mint, monkeypatch):
    asked = []

    def getpass(prompt: str) -> str:
        asked.append(prompt)
        return PASSWORD

    monkeypatch.setattr("mint_client.cli.keys.getpass.getpass", getpass)
    code, out = mint("login", "--username", OWNER)
    assert code == 0 and out["user"] == OWNER
    assert asked and OWNER in asked[0]


def test_a_person_in_several_tenants_picks_one_at_login_or_per_command(mint, tenant_a, tenant_b):
    MembershipFactory(tenant=tenant_b.tenant, user=tenant_a.users[Role.OWNER], role=Role.OWNER)
    a_key, _ = tenant_a.key("pipeline")
    b_key, _ = tenant_b.key("pipeline")

    code, out = login(mint)
    assert code == 0 and out["tenant"] is None
    assert sorted(t["slug"] for t in out["tenants"]) == ["acme", "globex"]
    code, out = mint("keys", "list")
    assert code == 2 and "--tenant" in out["error"]["message"] and "globex" in out["error"]["message"]
    code, out = mint("keys", "list", "--tenant", "globex")
    assert code == 0 and b_key.prefix in {k["prefix"] for k in out} and a_key.prefix not in {k["prefix"] for k in out}

    code, out = login(mint, OWNER, PASSWORD, "--tenant", "acme")
    assert code == 0 and out["tenant"] == "acme"
    code, out = mint("keys", "list")
    assert code == 0 and a_key.prefix in {k["prefix"] for k in out} and b_key.prefix not in {k["prefix"] for k in out}

    code, out = login(mint, OWNER, PASSWORD, "--tenant", "initech")
    assert code == 5 and out["error"]["code"] == "tenant_not_found"


def test_usage_errors_exit_2(mint):
    assert login(mint)[0] == 0
    code, out = mint("keys", "create", "x", "--scopes", "pipeline", "--expires", "next tuesday")
    assert code == 2 and "--expires" in out["error"]["message"]
    code, out = mint("login", "--username", OWNER, "--password-stdin", stdin="\n")
    assert code == 2 and "No password" in out["error"]["message"]


def test_expires_takes_a_duration_or_an_iso_date():
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    assert parse_expires("30d", now=now) == now + timedelta(days=30)
    assert parse_expires("12h", now=now) == now + timedelta(hours=12)
    assert parse_expires("2027-01-31", now=now) == datetime(2027, 1, 31, tzinfo=UTC)
    assert parse_expires("2027-01-31T12:00:00Z", now=now) == datetime(2027, 1, 31, 12, tzinfo=UTC)
    with pytest.raises(ValueError):
        parse_expires("soon", now=now)


def test_sessions_are_kept_per_base_url(tmp_path):
    store = SessionStore(tmp_path / "cfg")
    for url, user in (("http://a.example:8000", "alice"), ("https://b.example", "bob")):
        store.put(StoredSession(base_url=url, user=user, tenant=None, cookies={"sessionid": user}, csrf_token="t"))
    assert store.get("http://a.example:8000/api/v1/").user == "alice"  # the same MinT however its URL is written
    assert store.remove("http://a.example:8000") is True
    assert store.get("http://a.example:8000") is None and store.get("https://b.example").user == "bob"
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    with pytest.raises(NotSignedIn):
        Session.from_store("http://a.example:8000", store=store)


def test_the_sdk_session_manages_keys_and_no_api_key_can(live_mint, tmp_path):
    store = SessionStore(tmp_path / "cfg")
    with Session.login(live_mint.url, OWNER, PASSWORD, retries=0) as session:
        session.save(store)
        assert session.whoami().principal == OWNER
    with Session.from_store(live_mint.url, store=store, retries=0) as session:
        key = session.create_key("sdk", ["inference"], adapters=["support-bot"], max_tokens_per_minute=100)
        assert key.token and key.max_tokens_per_minute == 100
        assert key.prefix in [k.prefix for k in session.api_keys()]
        session.revoke_key(f"mint_{key.prefix}_…")
        assert ApiKey.objects.get(prefix=key.prefix).revoked_at is not None
    # A key (here the owner's own, with every scope) is refused by the same API: keys never manage keys.
    refused = httpx.get(f"{live_mint.url}/api/v1/keys/", headers={"Authorization": f"Bearer {live_mint.owner_both}"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"
