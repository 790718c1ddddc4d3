"""One signed POST to a receiver, pinned to the address its name resolved to, bounded in time and bytes.

The receiver is untrusted (any tenant names it), so:
- only http and https, no user-info in the URL, no redirects followed (a 3xx is a failed attempt);
- the name is resolved once per attempt, every address it resolves to must be public (`address_problem`),
  and the connection goes to that address (the `Host` header and TLS SNI carry the name), so a name cannot
  rebind into the private network between the check and the connect;
- the whole attempt (resolution, connect, TLS, request, response headers) has one deadline, so a receiver
  that trickles costs at most MINT_WEBHOOK_TIMEOUT_S of a worker, and the connection its own, shorter one
  (MINT_WEBHOOK_CONNECT_TIMEOUT_S: an address that drops packets is given up on early); at most
  MINT_WEBHOOK_MAX_RESPONSE_BYTES of a failed response's body are read (undecoded: no decompression bomb),
  none of a successful one's;
- no proxy from the environment (it would resolve the name itself).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
DEFAULT_PORTS = {"http": 80, "https": 443}
NAT64 = ipaddress.ip_network("64:ff9b::/96")
USER_AGENT = "MinT-Webhooks/1"


class Refused(Exception):
    """The URL, or an address its name resolves to, may not be called. The message names the problem."""


class Unresolved(Exception):
    """The name did not resolve (now): a transient failure."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # as written in the URL, lower-cased, without brackets
    port: int
    path: str  # path and query, at least "/"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


def parse_url(url: str, *, max_length: int) -> Target:
    """The parts of a receiver URL, or `Refused` naming what is wrong with it."""
    if not isinstance(url, str) or not url:
        raise Refused("The URL is empty.")
    if len(url) > max_length:
        raise Refused(f"The URL is {len(url)} characters long; at most {max_length} are accepted.")
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise Refused("The URL contains whitespace or control characters.")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise Refused(f"The URL cannot be parsed: {exc}.") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise Refused(f"The URL's scheme is {parts.scheme or 'missing'}; only http and https are allowed.")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise Refused("The URL may not carry a user name or password; put credentials in the path or query.")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise Refused("The URL names no host.")
    if _literal(host) is None and (len(host) > 253 or any(len(label) > 63 for label in host.split("."))):
        # Said plainly here: the resolver would refuse it with an encoder's error about labels.
        raise Refused(
            f"The URL's host name is {len(host)} characters long; a host name has at most 253, and each part "
            "between dots at most 63."
        )
    if port == 0:
        raise Refused("The URL's port is 0.")
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return Target(scheme=scheme, host=host, port=port or DEFAULT_PORTS[scheme], path=path)


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_problem(ip: IPAddress, *, allow_private: bool) -> str | None:
    """Why a receiver may not be reached at `ip` (None: it may).

    Unspecified and multicast addresses are never receivers. Loopback, private, link-local (the cloud metadata
    service), shared and reserved ranges are refused unless the operator allows private receivers.
    """
    if ip.is_unspecified:
        return f"{ip} is the unspecified address"
    if ip.is_multicast:
        return f"{ip} is a multicast address"
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        if inner is not None:
            problem = address_problem(inner, allow_private=allow_private)
            if problem:
                return f"{ip} embeds {problem}"
    if allow_private:
        return None
    for kind in ("loopback", "link_local", "private", "reserved", "site_local"):
        if getattr(ip, f"is_{kind}", False):
            return f"{ip} is a {kind.replace('_', '-')} address"
    if not ip.is_global:
        return f"{ip} is not a public address"
    return None


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def resolve(host: str, port: int, *, timeout_s: float) -> list[IPAddress]:
    """The addresses `host` resolves to, once, waiting at most `timeout_s` (the lookup runs in a daemon thread:
    `getaddrinfo` has no timeout of its own, and a hung one must not hold the caller)."""
    literal = _literal(host)
    if literal is not None:
        return [literal]
    found: list = []
    failed: list[BaseException] = []

    def lookup() -> None:
        try:
            found.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP))
        except (OSError, UnicodeError) as exc:
            failed.append(exc)

    thread = threading.Thread(target=lookup, name="webhook-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Unresolved(f"{host} did not resolve within {timeout_s:g} s")
    if failed or not found:
        raise Unresolved(f"{host} does not resolve ({failed[0] if failed else 'no address'})")
    addresses: list[IPAddress] = []
    for *_, sockaddr in found:
        ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        if ip not in addresses:
            addresses.append(ip)
    return addresses


def check_addresses(host: str, addresses: list[IPAddress], *, allow_private: bool) -> IPAddress:
    """The address to connect to: the first, once every one `host` resolved to is allowed (else `Refused`)."""
    for ip in addresses:
        problem = address_problem(ip, allow_private=allow_private)
        if problem:
            shown = "" if _literal(host) is not None else f"{host} resolves to "
            raise Refused(
                f"Webhook receivers on private networks are refused: {shown}{problem}. An operator can allow "
                "them with the setting MINT_WEBHOOK_ALLOW_PRIVATE=1 (a laptop, a closed network)."
            )
    return addresses[0]


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """`v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`: the `X-Mint-Signature` header."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"v1={mac.hexdigest()}"


@dataclass(frozen=True)
class Outcome:
    """How one attempt went: `status_code` when the receiver answered; `error` says why it was not delivered."""

    status_code: int | None = None
    error: str = ""
    permanent: bool = False  # refused by the address rules: another attempt would be refused too

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def _clip(data: bytes, limit: int = 500) -> str:
    return data[:limit].decode("utf-8", "replace").strip()


async def _post(
    url: str,
    *,
    headers: dict[str, str],
    body: bytes,
    sni: str | None,
    timeout_s: float,
    connect_timeout_s: float,
    max_bytes: int,
) -> Outcome:
    extensions = {"sni_hostname": sni} if sni else {}
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, connect_timeout_s))
    async with (
        asyncio.timeout(timeout_s),
        httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client,
        client.stream("POST", url, content=body, headers=headers, extensions=extensions) as response,
    ):
        status = response.status_code
        if 200 <= status < 300:
            return Outcome(status_code=status)
        if 300 <= status < 400:
            location = response.headers.get("location", "")[:300]
            return Outcome(status_code=status, error=f"HTTP {status}: redirects are not followed ({location})")
        excerpt = bytearray()
        if max_bytes:
            async for chunk in response.aiter_raw():
                excerpt += chunk[: max_bytes - len(excerpt)]
                if len(excerpt) >= max_bytes:
                    break
        detail = _clip(bytes(excerpt))
        return Outcome(status_code=status, error=f"HTTP {status}" + (f": {detail}" if detail else ""))


def post_signed(
    *,
    url: str,
    body: bytes,
    headers: dict[str, str],
    secret: str,
    timeout_s: float,
    max_bytes: int,
    allow_private: bool,
    max_url_length: int,
    connect_timeout_s: float | None = None,
) -> Outcome:
    """POST `body` to `url`, signed with `secret`, under the rules of this module's docstring. Never raises."""
    deadline = time.monotonic() + timeout_s
    try:
        target = parse_url(url, max_length=max_url_length)
        addresses = resolve(target.host, target.port, timeout_s=timeout_s)
        ip = check_addresses(target.host, addresses, allow_private=allow_private)
    except Refused as exc:
        return Outcome(error=str(exc), permanent=True)
    except Unresolved as exc:
        return Outcome(error=str(exc))
    pinned = f"[{ip}]" if ip.version == 6 else str(ip)
    timestamp = str(int(time.time()))
    sent = {
        **headers,
        "Host": target.host_header,
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Accept-Encoding": "identity",
        "X-Mint-Timestamp": timestamp,
        "X-Mint-Signature": signature(secret, timestamp, body),
    }
    sni = target.host if target.scheme == "https" and _literal(target.host) is None else None
    remaining = max(0.05, deadline - time.monotonic())
    try:
        return asyncio.run(
            _post(
                f"{target.scheme}://{pinned}:{target.port}{target.path}",
                headers=sent,
                body=body,
                sni=sni,
                timeout_s=remaining,
                connect_timeout_s=remaining if connect_timeout_s is None else connect_timeout_s,
                max_bytes=max_bytes,
            )
        )
    except TimeoutError:
        return Outcome(error=f"no answer within {timeout_s:g} s")
    except httpx.ConnectTimeout:
        return Outcome(error=f"no connection within {min(timeout_s, connect_timeout_s or timeout_s):g} s")
    except httpx.TimeoutException:
        return Outcome(error=f"no answer within {timeout_s:g} s")
    except httpx.HTTPError as exc:
        return Outcome(error=f"{type(exc).__name__}: {str(exc)[:300] or 'connection failed'}")
    except OSError as exc:
        return Outcome(error=f"{type(exc).__name__}: {str(exc)[:300]}")
