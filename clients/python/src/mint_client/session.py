"""A person's session on MinT, for what only people do: managing API keys (owners; keys never manage keys).

from mint_client import Session
session = Session.login("https://mint.example.com", "alice", getpass(), tenant="acme")
key = session.create_key("trainer", ["pipeline"], expires_at="2027-01-01T00:00:00Z")
print(key.token)                                   # shown once, stored nowhere
session.save()                                     # kept for later, readable by you only (SessionStore)
session = Session.from_store("https://mint.example.com")   # later; NotSignedIn when there is none

The session is Django's session cookie with its CSRF token (`POST /api/v1/session/`), sent back with an
`Origin` header of MinT's own origin, as the server's CSRF check wants for every unsafe request. A `Client`
(an API key) cannot do any of this, and a `Session` does nothing else.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from mint_client import errors
from mint_client._http import Http, same_origin
from mint_client.models import ApiKey, WhoAmI
from mint_client.routes import ROUTES

SESSIONS_FILE = "sessions.json"
FILE_VERSION = 1
# The server's answer when an unsafe request lacks a valid CSRF token: the stored token no longer fits.
CSRF_REFUSAL = "CSRF Failed"


def config_dir() -> Path:
    """Where `mint` keeps its sessions: $MINT_CONFIG_DIR, else $XDG_CONFIG_HOME/mint, else ~/.config/mint."""
    if explicit := os.environ.get("MINT_CONFIG_DIR"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base).expanduser() / "mint"


def normal_base_url(base_url: str | None) -> str:
    """MinT's base URL as sessions are filed under it (no trailing slash, no /api/v1), or ConfigurationError."""
    base_url = base_url or os.environ.get("MINT_BASE_URL")
    if not base_url:
        raise errors.ConfigurationError(
            "No MINT_BASE_URL: pass base_url= (CLI: --base-url) or set MINT_BASE_URL (e.g. http://127.0.0.1:8000)."
        )
    if not base_url.startswith(("http://", "https://")):
        raise errors.ConfigurationError(f"The base URL must start with http:// or https://, not {base_url!r}.")
    return base_url.rstrip("/").removesuffix("/api/v1")


def _origin(base_url: str) -> str:
    url = httpx.URL(base_url)
    default_port = {"http": 80, "https": 443}[url.scheme]
    port = f":{url.port}" if url.port not in (None, default_port) else ""
    return f"{url.scheme}://{url.host}{port}"


@dataclass
class StoredSession:
    """What a sign-in leaves to keep: whose session, for which tenant, its cookies and its CSRF token."""

    base_url: str
    user: str
    tenant: str | None
    cookies: dict[str, str]
    csrf_token: str
    tenants: list[dict] = field(default_factory=list)
    signed_in_at: str = ""

    def as_json(self) -> dict:
        data = asdict(self)
        del data["base_url"]  # the key it is filed under
        return data

    @classmethod
    def from_json(cls, base_url: str, data: dict) -> StoredSession:
        return cls(
            base_url=base_url,
            user=str(data.get("user", "")),
            tenant=data.get("tenant"),
            cookies={str(k): str(v) for k, v in (data.get("cookies") or {}).items()},
            csrf_token=str(data.get("csrf_token", "")),
            tenants=list(data.get("tenants") or []),
            signed_in_at=str(data.get("signed_in_at", "")),
        )


class SessionStore:
    """Sessions, one per base URL, in `<directory>/sessions.json`: mode 0600 in a 0700 directory, since a session
    cookie is as good as the password until it expires. `directory` defaults to `config_dir()`."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory is not None else config_dir()

    @property
    def path(self) -> Path:
        return self.directory / SESSIONS_FILE

    def get(self, base_url: str) -> StoredSession | None:
        base_url = normal_base_url(base_url)
        data = self._read().get(base_url)
        return StoredSession.from_json(base_url, data) if isinstance(data, dict) else None

    def put(self, stored: StoredSession) -> Path:
        sessions = self._read()
        sessions[stored.base_url] = stored.as_json()
        self._write(sessions)
        return self.path

    def remove(self, base_url: str) -> bool:
        """Forget the session of `base_url`; whether there was one."""
        base_url = normal_base_url(base_url)
        sessions = self._read()
        if sessions.pop(base_url, None) is None:
            return False
        self._write(sessions)
        return True

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise errors.ConfigurationError(
                f"{self.path} cannot be read ({exc}); delete it and run `mint login` again."
            ) from exc
        sessions = data.get("sessions") if isinstance(data, dict) else None
        return sessions if isinstance(sessions, dict) else {}

    def _write(self, sessions: dict[str, Any]) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # mkstemp creates the file 0600 (whatever the umask); replacing the old file is atomic, so a reader never
        # sees half a file and the old one's mode never matters.
        fd, tmp = tempfile.mkstemp(prefix=".sessions-", suffix=".json", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": FILE_VERSION, "sessions": sessions}, f, indent=2, sort_keys=True)
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class Session:
    """A signed-in person on MinT: list, create and revoke the tenant's API keys (owners only), and sign out.

    Make one with `Session.login(...)` (a password) or `Session.from_store(...)` (one saved before). `tenant`
    names the tenant to act for (`X-Mint-Tenant`) over the one chosen at sign-in. `retries` bounds the retries of
    reads and revocations; creating a key is never retried (the server keeps no answer holding a token). A
    session the server no longer accepts raises `NotSignedIn`.
    """

    def __init__(
        self,
        stored: StoredSession,
        *,
        tenant: str | None = None,
        timeout: float = 60.0,
        retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.stored = stored
        self.base_url = stored.base_url
        headers = {"X-CSRFToken": stored.csrf_token, "Origin": _origin(stored.base_url)}
        if tenant:
            headers["X-Mint-Tenant"] = tenant
        self._http = Http(
            base_url=stored.base_url,
            api_key=None,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            max_backoff=max_backoff,
            transport=transport,
            sleep=sleep,
            headers=headers,
            cookies=stored.cookies,
        )

    # ------------------------------------------------------------------ signing in and out

    @classmethod
    def login(
        cls,
        base_url: str | None,
        username: str,
        password: str,
        *,
        tenant: str | None = None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        **kwargs: Any,
    ) -> Session:
        """Sign in with a password (`POST /api/v1/session/`), once: a wrong password counts towards the
        server's lockout, so nothing is retried. Raises `AuthError` (wrong username or password),
        `LoginLockedOut` (too many of those; `.retry_after`), `NotFound` (`tenant` is not one of yours)."""
        base_url = normal_base_url(base_url)
        http = Http(
            base_url=base_url,
            api_key=None,
            timeout=timeout,
            retries=0,
            backoff=0.0,
            max_backoff=0.0,
            transport=transport,
            sleep=time.sleep,
            headers={"Origin": _origin(base_url)},
        )
        body: dict[str, str] = {"username": username, "password": password}
        if tenant:
            body["tenant"] = tenant
        try:
            response = http.request("POST", ROUTES["session.create"].url(), json=body, idempotent=False)
        finally:
            http.close()
        answer = response.json()
        stored = StoredSession(
            base_url=base_url,
            user=answer["user"],
            tenant=answer.get("tenant"),
            cookies={name: value for name, value in response.cookies.items()},
            csrf_token=answer["csrf_token"],
            tenants=list(answer.get("tenants") or []),
            signed_in_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        return cls(stored, timeout=timeout, transport=transport, **kwargs)

    @classmethod
    def from_store(cls, base_url: str | None = None, *, store: SessionStore | None = None, **kwargs: Any) -> Session:
        """The session saved for `base_url` (default MINT_BASE_URL), or `NotSignedIn` when there is none."""
        base_url = normal_base_url(base_url)
        store = store or SessionStore()
        stored = store.get(base_url)
        if stored is None:
            raise errors.NotSignedIn(f"Not signed in to {base_url}: run `mint login` first.")
        return cls(stored, **kwargs)

    def save(self, store: SessionStore | None = None) -> Path:
        """Keep this session for later (`from_store`); the file it is in."""
        return (store or SessionStore()).put(self.stored)

    def logout(self, store: SessionStore | None = None) -> bool:
        """End the session on the server (`DELETE /api/v1/session/`) and forget it in `store` (default: the
        user's). Whether one was stored. The local copy goes even when the server cannot be reached."""
        try:
            self._request("session.delete")
        finally:
            forgotten = (store or SessionStore()).remove(self.base_url)
        return forgotten

    @property
    def user(self) -> str:
        return self.stored.user

    @property
    def tenant(self) -> str | None:
        return self.stored.tenant

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self, route: str, *, url: str | None = None, path: dict[str, str] | None = None, **kwargs: Any
    ) -> httpx.Response:
        spec = ROUTES[route]
        try:
            return self._http.request(spec.method, url or spec.url(**(path or {})), **kwargs)
        except errors.LoginLockedOut:
            raise
        except errors.AuthError as exc:
            raise self._expired(exc) from exc
        except errors.PermissionDenied as exc:
            if exc.message.startswith(CSRF_REFUSAL):
                raise self._expired(exc) from exc
            raise

    def _expired(self, exc: errors.MintError) -> errors.NotSignedIn:
        return errors.NotSignedIn(
            f"The session of {self.stored.user} on {self.base_url} is not valid any more (it expired, was ended, "
            f"or its CSRF token no longer fits): run `mint login` again. The server said: {exc.message}",
            status=exc.status,
        )

    # ------------------------------------------------------------------ who, keys

    def whoami(self) -> WhoAmI:
        """The person, their tenant and role now, and what they may do there."""
        return WhoAmI.from_json(self._request("whoami").json())

    def api_keys(self, *, page_size: int | None = None) -> Iterator[ApiKey]:
        """The tenant's API keys (live, revoked and expired), over every page. Owners only."""
        url: str | None = ROUTES["keys.list"].url()
        params = {"limit": page_size} if page_size else None
        while url:
            body = self._request("keys.list", url=url, params=params).json()
            for item in body.get("results", []):
                yield ApiKey.from_json(item)
            url = same_origin(body.get("next"), self.base_url)
            params = None  # the cursor link carries the query

    def create_key(
        self,
        name: str,
        scopes: list[str] | tuple[str, ...],
        *,
        expires_at: datetime | str | None = None,
        adapters: list[str] | tuple[str, ...] | None = None,
        max_tokens_per_minute: int | None = None,
        monthly_token_budget: int | None = None,
    ) -> ApiKey:
        """A new key of the tenant, acting for this person; its `.token` is in this answer only. Owners only.

        Sent once, never retried: the server keeps no copy of an answer holding a token, so a retry after a lost
        answer would make a second key (list the keys to see whether the first one was made)."""
        body: dict[str, Any] = {"name": name, "scopes": list(scopes)}
        if expires_at is not None:
            body["expires_at"] = expires_at.isoformat() if isinstance(expires_at, datetime) else expires_at
        if adapters:
            body["adapters"] = list(adapters)
        if max_tokens_per_minute is not None:
            body["max_tokens_per_minute"] = max_tokens_per_minute
        if monthly_token_budget is not None:
            body["monthly_token_budget"] = monthly_token_budget
        return ApiKey.from_json(self._request("keys.create", json=body, idempotent=False).json())

    def revoke_key(self, prefix: str) -> None:
        """Revoke a key of the tenant by its prefix (`mint_<prefix>_…`); `NotFound` for none, or another tenant's."""
        prefix = prefix.removeprefix("mint_").split("_", 1)[0]
        self._request("keys.revoke", path={"prefix": prefix})

    # ------------------------------------------------------------------ people (owners)

    def members(self) -> list[dict[str, Any]]:
        """The tenant's members: username, email, role, joined_at, last_login, last_activity. Owners only."""
        return list(self._request("members.list").json())

    def invite(self, role: str, *, email: str = "", username: str = "") -> dict[str, Any]:
        """Invite a person by email or by username (exactly one) with a role; the server mails them the link."""
        if bool(email) == bool(username):
            raise ValueError("Invite by email or by username: give exactly one of them.")
        body = {"role": role, **({"email": email} if email else {"username": username})}
        return dict(self._request("invitations.create", json=body, idempotent=False).json())

    def set_role(self, username: str, role: str) -> dict[str, Any]:
        """Change a member's role (the last owner cannot be demoted: `Conflict`)."""
        return dict(self._request("members.role", path={"username": username}, json={"role": role}).json())

    def remove_member(self, username: str) -> None:
        """Remove a member: the keys they made in the tenant stop working at once."""
        self._request("members.remove", path={"username": username})
