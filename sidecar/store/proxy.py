"""Which HTTP proxy a store connection goes through, from the usual environment variables.

``HTTPS_PROXY`` (or ``https_proxy``) for ``https://`` stores, ``HTTP_PROXY`` (``http_proxy``) for
``http://`` ones; the lower-case name wins when both are set, as in curl. ``NO_PROXY``
(``no_proxy``) lists hosts reached directly: ``*``, a host name (which also covers its
subdomains; a leading ``.`` or ``*.`` means the same), an IP address or a CIDR network, each
optionally with ``:port``. Loopback addresses and ``localhost`` are never proxied (as in Go's
``net/http``), so an emulator on 127.0.0.1 is reached directly whatever the environment says.

Only ``http://`` proxies are supported: an ``https://`` store is reached through a ``CONNECT``
tunnel, an ``http://`` one with absolute-form requests. Credentials in the proxy URL are sent as
``Proxy-Authorization: Basic`` and never appear in a message.
"""

from __future__ import annotations

import base64
import ipaddress
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class Proxy:
    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)  # "Basic ...": a secret

    @property
    def description(self) -> str:
        """``host:port``, for messages: never the credentials."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _env(env: Mapping[str, str], name: str) -> str:
    """The lower-case variable if set (even empty: that turns the proxy off, as in urllib), else
    the upper-case one."""
    lower = name.lower()
    return (env[lower] if lower in env else env.get(name.upper(), "")).strip()


def proxy_for(scheme: str, host: str, port: int, env: Mapping[str, str]) -> Proxy | None:
    """The proxy for ``scheme://host:port``, or None to connect directly. ``ValueError`` (one
    line, no credentials) for a proxy URL that cannot be used."""
    name = "https_proxy" if scheme == "https" else "http_proxy"
    url = _env(env, name)
    if not url or bypassed(host, port, _env(env, "no_proxy")):
        return None
    return _parse(name, url)


def check(scheme: str, env: Mapping[str, str]) -> None:
    """``ValueError`` if the proxy variable for ``scheme`` is set to something unusable, whichever
    host it would be for."""
    name = "https_proxy" if scheme == "https" else "http_proxy"
    if url := _env(env, name):
        _parse(name, url)


def _parse(name: str, url: str) -> Proxy:
    unusable = (f"{name.upper()} is not an http://[user:password@]host[:port] URL "
                "(percent-encode special characters in the user name and password)")
    try:  # no message of urlsplit's is shown: it could quote part of the password
        parts = urlsplit(url if "://" in url else f"http://{url}")
        scheme, host, proxy_port = parts.scheme.lower(), parts.hostname, parts.port or 80
    except ValueError:
        raise ValueError(unusable) from None
    if scheme != "http":
        raise ValueError(f"{name.upper()}: only http:// proxies are supported (got {scheme}://)")
    if not host or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(unusable)
    authorization = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode()
    return Proxy(host, proxy_port, authorization)


def bypassed(host: str, port: int, no_proxy: str) -> bool:
    """True when ``host`` is reached directly: loopback, or matched by ``no_proxy``."""
    host = host.strip("[]").lower().rstrip(".")
    address = _address(host)
    if host == "localhost" or host.endswith(".localhost") or (address is not None and address.is_loopback):
        return True
    for entry in no_proxy.split(","):
        entry = entry.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        entry, entry_port = _split_port(entry)
        if entry_port is not None and entry_port != port:
            continue
        entry = entry.strip("[]")
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        entry = entry.removeprefix("*").lstrip(".").rstrip(".")
        if entry and (host == entry or host.endswith("." + entry)):
            return True
    return False


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host:port`` / ``[v6]:port`` → (host, port); a bare IPv6 address or CIDR keeps its colons."""
    if entry.startswith("["):
        inside, _, rest = entry[1:].partition("]")
        return inside, int(rest[1:]) if rest[1:].isdigit() else None
    if entry.count(":") == 1:
        name, _, port = entry.partition(":")
        if port.isdigit():
            return name, int(port)
    return entry, None
