"""Sign-in throttling (django-axes): a username that failed too often from one address is refused there for a while.

Counters live in Redis and outlive a test, so every test here uses usernames and addresses of its own and
clears their counters before and after.
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from axes.utils import reset
from django.conf import settings as django_settings
from django.test import AsyncClient, Client

from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.django_db

ADDRESS = "203.0.113.7"
OTHER_ADDRESS = "203.0.113.8"
ASGI_TEST_ADDRESS = "127.0.0.1"  # what the ASGI test client always claims
USERNAMES = ("throttle-alice", "throttle-bob", "throttle-admin")


@pytest.fixture(autouse=True)
def _clean_counters():
    def clear() -> None:
        for username, address in itertools.product(USERNAMES, (ADDRESS, OTHER_ADDRESS, ASGI_TEST_ADDRESS)):
            reset(username=username, ip=address)

    clear()
    yield
    clear()


@pytest.fixture
def alice():
    return UserFactory(username="throttle-alice")


def sign_in(username: str, password: str, *, address: str = ADDRESS, path: str = "/login/", **headers):
    return Client(REMOTE_ADDR=address).post(path, {"username": username, "password": password}, **headers)


def fail(times: int, username: str, *, address: str = ADDRESS, path: str = "/login/", **headers) -> list[int]:
    return [sign_in(username, "wrong", address=address, path=path, **headers).status_code for _ in range(times)]


def assert_locked_out(response, *, retry_after: int) -> None:
    assert response.status_code == 429
    assert response["Retry-After"] == str(retry_after)
    content = response.content.decode()
    assert "Too many sign-in attempts" in content and "Try again in" in content
    assert django_settings.SESSION_COOKIE_NAME not in response.cookies  # nobody was signed in


def test_five_wrong_passwords_lock_out_even_the_right_one(alice, settings):
    assert settings.AXES_FAILURE_LIMIT == 5
    assert settings.AXES_COOLOFF_TIME.total_seconds() == 900
    assert fail(4, "throttle-alice") == [302] * 4  # each refusal redirects to the page that says so
    assert fail(1, "throttle-alice") == [429]
    assert_locked_out(sign_in("throttle-alice", PASSWORD), retry_after=900)


def test_lockout_is_per_username_and_address(alice):
    UserFactory(username="throttle-bob")
    fail(5, "throttle-alice")
    assert sign_in("throttle-alice", PASSWORD).status_code == 429
    assert sign_in("throttle-bob", PASSWORD).status_code == 302  # another username, same address
    assert sign_in("throttle-alice", PASSWORD, address=OTHER_ADDRESS).status_code == 302  # same username, elsewhere


def test_forwarded_headers_do_not_change_the_address(alice):
    # Only REMOTE_ADDR counts (uvicorn sets it from X-Forwarded-For for trusted proxies); a client's own
    # headers cannot spread its failures over made-up addresses.
    for n in range(5):
        sign_in("throttle-alice", "wrong", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}", HTTP_X_REAL_IP=f"198.51.100.{n}")
    assert sign_in("throttle-alice", PASSWORD, HTTP_X_FORWARDED_FOR="198.51.100.99").status_code == 429


def test_sign_in_works_again_after_the_cool_off(alice, settings):
    settings.AXES_COOLOFF_TIME = timedelta(seconds=1)
    fail(5, "throttle-alice")
    assert_locked_out(sign_in("throttle-alice", PASSWORD), retry_after=1)
    time.sleep(1.5)
    assert sign_in("throttle-alice", PASSWORD).status_code == 302


def test_a_good_password_clears_earlier_failures(alice):
    assert fail(4, "throttle-alice") == [302] * 4  # each refusal redirects to the page that says so
    assert sign_in("throttle-alice", PASSWORD).status_code == 302
    assert fail(4, "throttle-alice") == [302] * 4  # counted from zero again


def test_admin_login_is_throttled_too():
    UserFactory(username="throttle-admin", is_staff=True, is_superuser=True)
    assert fail(5, "throttle-admin", path="/admin/login/")[-1] == 429
    assert_locked_out(sign_in("throttle-admin", PASSWORD, path="/admin/login/"), retry_after=900)
    # The same pair is locked out of the dashboard's form as well: it is one account.
    assert sign_in("throttle-admin", PASSWORD).status_code == 429


def test_test_client_logins_are_not_throttled(alice):
    # Code that signs in without a request (the test client's login(), a shell) has no address to count.
    assert Client().login(username="throttle-alice", password=PASSWORD)
    assert not Client().login(username="throttle-alice", password="wrong")
    client = Client()
    client.force_login(alice)
    assert client.session["_auth_user_id"] == str(alice.pk)


def test_lockout_page_is_served_on_the_asgi_path_too(alice):
    # uvicorn runs the async middleware chain, where django-axes calls the lockout page differently.
    client = AsyncClient()
    statuses = [
        async_to_sync(client.post)("/login/", {"username": "throttle-alice", "password": "wrong"}).status_code
        for _ in range(5)
    ]
    assert statuses == [302] * 4 + [429]
    assert_locked_out(
        async_to_sync(client.post)("/login/", {"username": "throttle-alice", "password": PASSWORD}), retry_after=900
    )
