"""`POST/DELETE /api/v1/session/`: a person signs in to the REST API with a password, throttled by django-axes,
and the session (with its CSRF token) manages keys, which no key can.

django-axes' counters live in Redis and outlive a test, so the usernames' counters at this module's address are
cleared before and after each test.
"""

from __future__ import annotations

import itertools

import pytest
from asgiref.sync import async_to_sync
from axes.utils import reset
from django.conf import settings as django_settings
from django.test import AsyncClient, Client

from tenants.models import ApiKey, Role
from tests.conftest import error_of
from tests.factories import PASSWORD, MembershipFactory

pytestmark = pytest.mark.django_db

ADDRESS = "203.0.113.61"
OWNER, DEVELOPER = "acme-owner", "acme-developer"


@pytest.fixture(autouse=True)
def _clean_counters():
    def clear() -> None:
        for username, address in itertools.product((OWNER, DEVELOPER, "nobody-here"), (ADDRESS, "127.0.0.1")):
            reset(username=username, ip=address)

    clear()
    yield
    clear()


def browser(**kwargs) -> Client:
    return Client(REMOTE_ADDR=ADDRESS, enforce_csrf_checks=True, **kwargs)


def sign_in(client: Client, username: str, password: str = PASSWORD, **body):
    return client.post(
        "/api/v1/session/", {"username": username, "password": password, **body}, content_type="application/json"
    )


def has_session(response) -> bool:
    cookie = response.cookies.get(django_settings.SESSION_COOKIE_NAME)
    return cookie is not None and bool(cookie.value)


def test_sign_in_answers_the_person_and_their_tenant_and_the_session_reads_the_api(tenant_a):
    client = browser()
    response = sign_in(client, OWNER)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["user"] == OWNER and body["tenant"] == "acme"
    assert body["tenants"] == [{"slug": "acme", "name": tenant_a.tenant.name, "role": "owner"}]
    assert body["csrf_token"] and has_session(response)
    assert response.cookies[django_settings.CSRF_COOKIE_NAME].value  # the token's cookie comes along

    me = client.get("/api/v1/")
    assert me.status_code == 200
    assert me.json()["principal"] == OWNER and me.json()["role"] == "owner"


def test_a_wrong_password_is_refused_401_and_starts_no_session(tenant_a):
    response = sign_in(browser(), OWNER, "wrong-password")
    assert response.status_code == 401
    error = error_of(response)
    assert error["code"] == "invalid_credentials" and "username or password" in error["message"]
    assert not has_session(response)
    # An unknown username gets exactly the same answer.
    unknown = sign_in(browser(), "nobody-here", "wrong-password")
    assert (unknown.status_code, error_of(unknown)) == (401, error)


def test_api_failures_count_with_the_dashboards_for_django_axes(tenant_a):
    # Four wrong passwords here and one at /login/ make the five that lock the username out at that address.
    assert [sign_in(browser(), OWNER, "wrong").status_code for _ in range(4)] == [401] * 4
    dashboard = Client(REMOTE_ADDR=ADDRESS).post("/login/", {"username": OWNER, "password": "wrong"})
    assert dashboard.status_code == 429


def test_five_wrong_passwords_lock_out_even_the_right_one_with_retry_after(tenant_a, settings):
    assert settings.AXES_FAILURE_LIMIT == 5
    statuses = [sign_in(browser(), OWNER, "wrong").status_code for _ in range(5)]
    assert statuses == [401] * 4 + [429]

    locked = sign_in(browser(), OWNER)
    assert locked.status_code == 429
    assert locked["Retry-After"] == "900"
    assert locked["Content-Type"] == "application/json"  # the API's error, not the dashboard's lockout page
    error = error_of(locked)
    assert error["code"] == "login_locked_out" and "15 minute" in error["message"]
    assert error["detail"] == {"retry_after": 900}
    assert not has_session(locked)
    # Another username from the same address is not locked out.
    assert sign_in(browser(), DEVELOPER).status_code == 200


def test_the_lockout_is_the_apis_json_on_the_asgi_path_too(tenant_a):
    # uvicorn runs the async middleware chain, where django-axes swaps in its lockout page differently.
    client = AsyncClient()  # it claims 127.0.0.1, whose counters the fixture clears as well

    def post(password: str):
        body = {"username": OWNER, "password": password}
        return async_to_sync(client.post)("/api/v1/session/", body, content_type="application/json")

    assert [post("wrong").status_code for _ in range(5)] == [401] * 4 + [429]
    locked = post(PASSWORD)
    assert locked.status_code == 429 and locked["Retry-After"] == "900"
    assert error_of(locked)["code"] == "login_locked_out"


def test_a_good_password_clears_earlier_failures(tenant_a):
    assert [sign_in(browser(), OWNER, "wrong").status_code for _ in range(4)] == [401] * 4
    assert sign_in(browser(), OWNER).status_code == 200
    assert [sign_in(browser(), OWNER, "wrong").status_code for _ in range(4)] == [401] * 4


def test_a_person_in_several_tenants_picks_one_and_only_one_of_theirs(tenant_a, tenant_b):
    MembershipFactory(tenant=tenant_b.tenant, user=tenant_a.users[Role.OWNER], role=Role.DEVELOPER)

    client = browser()
    unnamed = sign_in(client, OWNER)
    assert unnamed.status_code == 200
    assert unnamed.json()["tenant"] is None
    assert [(t["slug"], t["role"]) for t in unnamed.json()["tenants"]] == [("acme", "owner"), ("globex", "developer")]
    assert client.get("/api/v1/").status_code == 400  # several tenants, none named
    assert client.get("/api/v1/", HTTP_X_MINT_TENANT="globex").json()["tenant"] == "globex"

    client = browser()
    named = sign_in(client, OWNER, tenant="globex")
    assert named.status_code == 200 and named.json()["tenant"] == "globex"
    me = client.get("/api/v1/").json()
    assert (me["tenant"], me["role"]) == ("globex", "developer")


def test_naming_a_tenant_not_ones_own_is_404_whether_it_exists_or_not_and_signs_nobody_in(tenant_a, tenant_b):
    other = sign_in(browser(), OWNER, tenant="globex")
    missing = sign_in(browser(), OWNER, tenant="no-such-tenant")
    assert other.status_code == missing.status_code == 404
    assert error_of(other)["code"] == "tenant_not_found"
    assert error_of(other)["message"].replace("globex", "X") == error_of(missing)["message"].replace(
        "no-such-tenant", "X"
    )
    assert not has_session(other) and not has_session(missing)


def test_sign_out_ends_the_session_and_needs_the_csrf_token(tenant_a):
    client = browser()
    token = sign_in(client, OWNER).json()["csrf_token"]

    refused = client.delete("/api/v1/session/")
    assert refused.status_code == 403 and "CSRF" in error_of(refused)["message"]
    assert client.get("/api/v1/").status_code == 200  # still signed in

    assert client.delete("/api/v1/session/", HTTP_X_CSRFTOKEN=token).status_code == 204
    gone = client.get("/api/v1/")
    assert gone.status_code == 401 and error_of(gone)["code"] == "not_authenticated"
    assert browser().delete("/api/v1/session/").status_code == 204  # nobody signed in: nothing to end


def test_an_api_keys_bearer_token_cannot_start_a_session(tenant_a):
    _, token = tenant_a.key("pipeline", "deploy")
    bare = browser().post("/api/v1/session/", {}, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert bare.status_code == 403 and error_of(bare)["code"] == "api_key_cannot_sign_in"
    # Not even with a password alongside it: a key never turns into a person's session.
    client = browser(HTTP_AUTHORIZATION=f"Bearer {token}")
    with_password = sign_in(client, OWNER)
    assert with_password.status_code == 403 and not has_session(with_password)
    # Nor is the token a password.
    assert sign_in(browser(), OWNER, token).status_code == 401


def test_sign_in_reads_only_json(tenant_a):
    # A cross-site form cannot send JSON without a CORS preflight: no other site signs a browser in.
    form = browser().post("/api/v1/session/", {"username": OWNER, "password": PASSWORD})
    assert form.status_code == 415
    assert not has_session(form)


def test_an_owners_session_manages_keys_with_its_csrf_token(tenant_a):
    client = browser()
    token = sign_in(client, OWNER).json()["csrf_token"]
    body = {"name": "trainer", "scopes": ["pipeline"]}

    no_csrf = client.post("/api/v1/keys/", body, content_type="application/json")
    assert no_csrf.status_code == 403 and "CSRF" in error_of(no_csrf)["message"]
    assert not ApiKey.objects.filter(name="trainer").exists()

    created = client.post("/api/v1/keys/", body, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert created.status_code == 201, created.content
    prefix = created.json()["prefix"]
    assert created.json()["created_by"] == OWNER and created.json()["token"].startswith(f"mint_{prefix}_")
    assert [k["prefix"] for k in client.get("/api/v1/keys/").json()["results"]] == [prefix]

    assert client.delete(f"/api/v1/keys/{prefix}/", HTTP_X_CSRFTOKEN=token).status_code == 204
    assert ApiKey.objects.get(prefix=prefix).revoked_at is not None


def test_a_developers_session_cannot_manage_keys(tenant_a):
    client = browser()
    token = sign_in(client, DEVELOPER).json()["csrf_token"]
    refused = client.post(
        "/api/v1/keys/", {"name": "x", "scopes": ["pipeline"]}, content_type="application/json", HTTP_X_CSRFTOKEN=token
    )
    assert refused.status_code == 403
    assert error_of(refused)["code"] == "forbidden" and "needs owner" in error_of(refused)["message"]


def test_a_sign_in_answer_is_never_kept_for_an_idempotency_key(tenant_a):
    """Its body holds the CSRF token of a new session: replaying it without the cookie would hand it out."""
    from rest_framework.test import APIClient

    owner = tenant_a.users["owner"]
    owner.set_password("s3cret-pass-1")
    owner.save()
    response = APIClient().post(
        "/api/v1/session/",
        {"username": owner.get_username(), "password": "s3cret-pass-1"},
        format="json",
        HTTP_IDEMPOTENCY_KEY="login-1",
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "idempotency_not_supported"
