"""One webhook on the wire: which URLs a job may name, the signature, the POST.

A webhook URL is checked twice: at submit (`check_url`: the scheme, no credentials, a host
on the operator's allow-list, PLURAI_WEBHOOK_HOSTS) and again at delivery, where the host
is resolved and each address checked (`address`): a private, loopback, link-local or
reserved one is refused unless PLURAI_WEBHOOK_PRIVATE allows it, and the POST goes to the
address that was checked, so a name that resolves elsewhere a moment later (DNS
rebinding) still reaches only an allowed address. Redirects are not followed.

Each POST carries `Plurai-Signature: t=<unix s>,v1=<hex>`: HMAC-SHA256 with
PLURAI_WEBHOOK_SECRET over "<t>." followed by the body. A receiver checks it with `verify`
(or the same three lines in any language) and refuses a stale `t`, so a captured delivery
cannot be replayed later.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import ipaddress
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL = 2048
SIGNATURE = "Plurai-Signature"
_READ_LIMIT = 64 << 10  # of a receiver's answer, read and dropped


class Refused(ValueError):
    """A webhook URL or address the deployment does not allow: what to change."""


def _host_allowed(host: str, allowed: list[str]) -> bool:
    for pattern in allowed:
        p = pattern.strip().lower().rstrip(".")
        if p == "*" or p == host or (p.startswith("*.") and host.endswith(p[1:])):
            return True
    return False


def check_url(url: object, allowed: list[str]) -> str:
    """`url` if a job may name it as its webhook, else Refused saying why."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL:
        raise Refused(f"webhook must be an http(s) URL of at most {MAX_URL} characters")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise Refused("webhook URL holds whitespace or control characters")
    try:
        u = urlsplit(url)
        port = u.port  # ValueError when not a number in range
    except ValueError as e:
        raise Refused(f"webhook is not a URL: {e}") from None
    if u.scheme not in ("http", "https"):
        raise Refused(f"webhook must be http:// or https://, got {u.scheme or 'no'} scheme")
    if u.username is not None or u.password is not None:
        raise Refused("webhook URL must not hold credentials (user:password@)")
    host = (u.hostname or "").rstrip(".")
    if not host or port == 0:
        raise Refused("webhook URL names no host")
    if not allowed:
        raise Refused(
            "webhooks are off in this deployment: its operator allows hosts with "
            "PLURAI_WEBHOOK_HOSTS"
        )
    if not _host_allowed(host, allowed):
        raise Refused(f"webhook host {host[:100]!r} is not in PLURAI_WEBHOOK_HOSTS")
    return url


def address(host: str, port: int, private: bool) -> str:
    """The address to send to: the first of `host`'s that is public (or any with
    `private`); Refused when it has none, OSError when it does not resolve."""
    seen = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if private or (ip.is_global and not ip.is_multicast):
            return str(ip)
        seen.append(str(ip))
    raise Refused(
        f"webhook host {host[:100]!r} resolves to {', '.join(seen[:4])}: not a public "
        "address (PLURAI_WEBHOOK_PRIVATE allows private ones)"
    )


def sign(secret: bytes, t: int, body: bytes) -> str:
    """The Plurai-Signature header's value of `body` sent at unix second `t`."""
    mac = hmac.new(secret, str(t).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def verify(
    secret: str | bytes,
    body: bytes,
    signature: str | None,
    tolerance_s: float = 300,
    now: float | None = None,
) -> bool:
    """For a receiver: whether `signature` (the Plurai-Signature header) signs `body` with
    `secret` and was made within `tolerance_s` of now."""
    key = secret.encode() if isinstance(secret, str) else secret
    parts = dict(p.split("=", 1) for p in (signature or "").split(",") if "=" in p)
    try:
        t = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    expected = sign(key, t, body).rsplit("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))


@dataclass(slots=True)
class Answer:
    """A try's outcome: the HTTP status (0 when none came back) and, when the try failed,
    why (`error`) and whether a later try may do better (`retry`)."""

    status: int = 0
    error: str = ""
    retry: bool = False

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


_AGAIN = {408, 425, 429}  # answers that say "later"


def post(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    allowed: list[str],
    private: bool,
    timeout: float,
) -> Answer:
    """POST `body` to `url` once, after checking it again (`check_url`, `address`)."""
    try:
        check_url(url, allowed)
        u = urlsplit(url)
        host = (u.hostname or "").rstrip(".")
        port = u.port or (443 if u.scheme == "https" else 80)
        ip = address(host, port, private)
    except Refused as e:
        return Answer(error=str(e))
    except OSError as e:  # the name does not resolve (now): maybe later
        return Answer(error=f"cannot resolve {host[:100]!r}: {e.strerror or e}", retry=True)
    kind = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = kind(host, port, timeout=timeout)
    # connect to the address checked above, whatever the name resolves to now; TLS still
    # checks the certificate against the name
    conn._create_connection = lambda _addr, t, src: socket.create_connection((ip, port), t, src)  # type: ignore[attr-defined]
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    try:
        conn.request("POST", path, body=body, headers=dict(headers))
        resp = conn.getresponse()
        resp.read(_READ_LIMIT)
        status = resp.status
    except (OSError, http.client.HTTPException) as e:
        return Answer(error=f"{type(e).__name__}: {str(e)[:200]}", retry=True)
    finally:
        conn.close()
    if 200 <= status < 300:
        return Answer(status)
    return Answer(status, f"HTTP {status}", retry=status in _AGAIN or status >= 500)
