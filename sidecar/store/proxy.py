"""Which HTTP proxy a store's requests take: ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY``.

Backend-neutral: a backend asks :func:`proxy_for` once, for its endpoint, and sends every request
of the store through the answer (or directly). The rules are curl's and urllib's: the lower-case
variable wins, an empty one turns the proxy off, loopback is never proxied.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class Proxy:
    """The HTTP proxy a store's requests go through. ``url`` may hold credentials: a secret."""

    host: str
    port: int
    url: str = field(repr=False)
    secrets: tuple[str, ...] = field(default=(), repr=False)

    @property
    def description(self) -> str:
        """``host:port``, for messages: never the credentials."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _proxy_env(env: Mapping[str, str], name: str) -> str:
    """The lower-case variable if set (even empty: that turns the proxy off, as in urllib), else
    the upper-case one."""
    lower = name.lower()
    return (env[lower] if lower in env else env.get(name.upper(), "")).strip()


def proxy_for(scheme: str, host: str, port: int, env: Mapping[str, str]) -> Proxy | None:
    """The proxy for ``scheme://host:port``, or None to connect directly.

    ``HTTPS_PROXY`` (``https_proxy``) for https, ``HTTP_PROXY`` (``http_proxy``) for http; the
    lower-case name wins when both are set, as in curl. ``NO_PROXY`` (``no_proxy``) lists hosts
    reached directly: ``*``, a host name (which also covers its subdomains; a leading ``.`` or
    ``*.`` means the same), an IP address or a CIDR network, each optionally with ``:port``.
    Loopback and ``localhost`` are never proxied. Only ``http://`` proxies; credentials in the URL
    become ``Proxy-Authorization: Basic``. ``ValueError`` (one line, no credentials) for a proxy
    URL that cannot be used, whichever host it would be for.
    """
    name = "https_proxy" if scheme == "https" else "http_proxy"
    url = _proxy_env(env, name)
    if not url:
        return None
    proxy = _parse_proxy(name, url)
    return None if _bypassed(host, port, _proxy_env(env, "no_proxy")) else proxy


def _parse_proxy(name: str, url: str) -> Proxy:
    unusable = (f"{name.upper()} is not an http://[user:password@]host[:port] URL "
                "(percent-encode special characters in the user name and password)")
    try:  # no message of urlsplit's is shown: it could quote part of the password
        parts = urlsplit(url if "://" in url else f"http://{url}")
        scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port or 80
    except ValueError:
        raise ValueError(unusable) from None
    if scheme != "http":
        raise ValueError(f"{name.upper()}: only http:// proxies are supported (got {scheme}://)")
    if not host or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(unusable)
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    secrets: tuple[str, ...] = ()
    if parts.username is not None:
        user, password = parts.username, parts.password or ""
        secrets = tuple(s for s in (password, unquote(password), url) if s)
        netloc = f"{user}:{password}@{netloc}"
    return Proxy(host, port, f"http://{netloc}", secrets)


def _bypassed(host: str, port: int, no_proxy: str) -> bool:
    """True when ``host`` is reached directly: loopback, or matched by ``no_proxy``."""
    host = host.strip("[]").lower().rstrip(".")
    try:
        address: Any = ipaddress.ip_address(host)
    except ValueError:
        address = None
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

