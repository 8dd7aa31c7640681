"""Where an Azure Blob store is: the ``SIDECAR_STORE`` URL, parsed once, and the connection
string's fields that name the account. No SDK here: the URL check runs with the configuration.

``SIDECAR_STORE`` names the container and an optional prefix, in either form::

    https://<account>.blob.core.windows.net/<container>[/<prefix>]       host style (Azure)
    http://127.0.0.1:10000/<account>/<container>[/<prefix>]             path style (Azurite)

Path style applies when the host is an IP address or ``localhost``, or when the first path segment
is the account named by the connection string (or ``AZURE_STORAGE_ACCOUNT``). ``SIDECAR_PREFIX``
nests below the URL's prefix. A query is only accepted when it is a SAS token; no message shows it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import unquote, urlsplit

from sidecar import log
from sidecar.paths import UnsafeKey, validate_relpath

_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_CONTAINER_RE = re.compile(r"^(?=.{3,63}$)[a-z0-9](?:-?[a-z0-9])*$")
#: A host-style endpoint's host: ``<account>.blob.<suffix>`` (public, sovereign and private-link).
HOST_STYLE_RE = re.compile(r"^(?P<account>[a-z0-9]{3,24})\.(?:privatelink\.)?blob\.", re.IGNORECASE)


@dataclass(frozen=True)
class BlobLocation:
    """Where a store URL points. ``endpoint`` is the account's blob endpoint, without query."""

    scheme: str
    netloc: str
    account: str
    container: str
    prefix: str  # "" or "a/b", no leading or trailing slash
    path_style: bool
    sas: str | None  # the URL's query when it is a SAS token

    @property
    def endpoint(self) -> str:
        base = f"{self.scheme}://{self.netloc}"
        return f"{base}/{self.account}" if self.path_style else base

    @property
    def local_path(self) -> None:
        """A blob container is not on this machine's filesystem (see ``sidecar.store.registry``)."""
        return None

    def check_volume(self, platform: str, roots: list[str], cwd: str,
                     container_root: str = "/") -> list[tuple[str, dict[str, str]]]:
        """Nothing to check: a container is no volume of this machine's (``sidecar.store.registry``)."""
        return []

    def with_prefix(self, prefix: str) -> "BlobLocation":
        """This location with ``prefix`` (``SIDECAR_PREFIX``, the namespace) nested below its own;
        ValueError for a prefix that cannot be a blob-name prefix."""
        if not prefix.strip("/"):
            return self
        return dataclasses.replace(self, prefix=_join_prefix(self.prefix, prefix, what="SIDECAR_PREFIX"))

def _is_ip_or_localhost(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _join_prefix(*parts: str, what: str) -> str:
    segments: list[str] = []
    for part in parts:
        part = part.strip("/")
        if "//" in part:
            raise ValueError(f"bad {what}: empty segment in {part[:60]!r}")
        segments.extend(s for s in part.split("/") if s)
    if any(s.startswith(".") for s in segments):  # would reach roots or the sidecar's own objects
        raise ValueError(f"bad {what}: a segment must not start with '.'")
    prefix = "/".join(segments)
    if prefix:
        try:
            validate_relpath(prefix)
        except UnsafeKey as e:
            raise ValueError(f"bad {what}: {e}") from None
    return prefix


def parse_store_url(url: str, prefix: str = "", known_account: str | None = None) -> BlobLocation:
    """Split a ``SIDECAR_STORE`` URL into account, container and prefix; ValueError if malformed.

    ``prefix`` (``SIDECAR_PREFIX``) nests below the URL's own prefix. ``known_account`` (from a
    connection string or ``AZURE_STORAGE_ACCOUNT``) lets a custom host use path style.
    """
    form = (
        "expected https://<account>.blob.core.windows.net/<container>[/<prefix>] or "
        "http://127.0.0.1:10000/<account>/<container>[/<prefix>]"
    )
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a bad port
    except ValueError:
        raise ValueError(f"store URL is not a valid URL; {form}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"store URL scheme must be https (or http for an emulator); {form}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("store URL must not contain a user name or password; use the AZURE_STORAGE_* variables")
    if parts.fragment:
        raise ValueError(f"store URL must not contain a #fragment; {form}")
    host = (parts.hostname or "").lower()
    if not host:
        raise ValueError(f"store URL has no host; {form}")
    sas = None
    if parts.query:
        if "sig=" not in parts.query:
            raise ValueError(
                "store URL has a query that is not a SAS token (a SAS has sv=...&sig=...); "
                "remove it or pass the SAS in AZURE_STORAGE_SAS_TOKEN"
            )
        sas = parts.query
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    if "//" in parts.path.rstrip("/").lstrip("/"):
        raise ValueError("bad store URL: an empty path segment ('//')")
    segments = [unquote(s) for s in parts.path.split("/") if s]

    m = HOST_STYLE_RE.match(host)
    if _is_ip_or_localhost(host):
        path_style = True
    elif m is not None:
        path_style = False
    elif known_account and segments and segments[0] == known_account:
        path_style = True
    else:
        raise ValueError(
            f"cannot tell the storage account from host {host!r}: use "
            "https://<account>.blob.core.windows.net/<container>, or a path-style URL "
            "http(s)://<host>/<account>/<container> together with a connection string or "
            "AZURE_STORAGE_ACCOUNT naming that account"
        )
    if path_style:
        if not segments:
            raise ValueError(f"store URL names no account and container; {form}")
        account, segments = segments[0], segments[1:]
    else:
        assert m is not None  # host style: the host matched
        account = m.group("account").lower()
    if not _ACCOUNT_RE.match(account):
        raise ValueError(f"storage account name {account!r} is invalid (3-24 lowercase letters and digits)")
    if not segments:
        raise ValueError(f"store URL names no container; {form}")
    container = segments[0]
    if not _CONTAINER_RE.match(container):
        raise ValueError(
            f"container name {container!r} is invalid: 3-63 lowercase letters, digits and "
            "single hyphens, starting and ending with a letter or digit"
        )
    full_prefix = _join_prefix("/".join(segments[1:]), what="prefix in store URL")
    full_prefix = _join_prefix(full_prefix, prefix, what="SIDECAR_PREFIX")
    return BlobLocation(scheme, netloc, account, container, full_prefix, path_style, sas)


def connection_string_fields(conn: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in conn.split(";"):
        if "=" in item:
            k, v = item.split("=", 1)
            fields[k.strip().lower()] = v.strip()
    return fields


def known_account(env: Mapping[str, str]) -> str | None:
    """The account the environment names (the connection string's ``AccountName``, else
    ``AZURE_STORAGE_ACCOUNT``): with it, a custom host's URL may be path style."""
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    return connection_string_fields(conn).get("accountname") or env.get("AZURE_STORAGE_ACCOUNT") or None


def parse_url(url: str, env: Mapping[str, str]) -> BlobLocation:
    """The registry's URL check: ``url`` as a :class:`BlobLocation` (no ``SIDECAR_PREFIX`` yet);
    ValueError, one line that never shows the URL's query (a SAS token), when malformed."""
    try:
        return parse_store_url(url, known_account=known_account(env))
    except ValueError as e:
        raise ValueError(log.redact(str(e), [urlsplit(url).query] if "?" in url else [])) from None
