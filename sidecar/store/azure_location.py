"""Where a ``SIDECAR_STORE`` Azure URL points and which credential to use: parsing and choosing
only, no client and no event loop, so that :mod:`sidecar.store.early` can ask for the first
listing while Python is still importing. :mod:`sidecar.store.azure` builds the store from these.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping
from urllib.parse import unquote, urlsplit

from sidecar.paths import UnsafeKey, validate_relpath
from sidecar.store.sign import SasToken, SharedKey

_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_CONTAINER_RE = re.compile(r"^(?=.{3,63}$)[a-z0-9](?:-?[a-z0-9])*$")
_HOST_STYLE_RE = re.compile(r"^(?P<account>[a-z0-9]{3,24})\.(?:privatelink\.)?blob\.", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# Redaction
# ---------------------------------------------------------------------------------------------

_REDACT_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Connection-string fields and query parameters holding secrets: AccountKey=..., sig=...
    (
        re.compile(
            r"(?i)\b(AccountKey|SharedAccessSignature|SharedAccessKey|sig|signature|client_secret|"
            r"password|pwd|access_token|refresh_token|token)=([^;&\s'\",]+)"
        ),
        r"\1=***",
    ),
    # Authorization header values.
    (re.compile(r"(?i)\b(Bearer)\s+[A-Za-z0-9._~+/=-]+"), r"\1 ***"),
    (re.compile(r"(?i)\b(SharedKey(?:Lite)?)\s+([^:\s]+):\S+"), r"\1 \2:***"),
    # JWTs (Azure AD tokens) wherever they appear.
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"), "***"),
    # A bare storage account key: 64 random bytes are 88 base64 characters ending in '=='.
    (re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{86}=="), "***"),
]


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every known secret and anything shaped like a credential replaced by ``***``.

    ``secrets`` are exact values to remove (keys, SAS tokens, connection strings), also in their
    URL-decoded form; the patterns catch ``AccountKey=``, ``sig=``, ``Bearer``/``SharedKey``
    authorization values, JWTs and bare account keys even when the value is not known.
    """
    out = str(text)
    known: set[str] = set()
    for s in secrets:
        if s and len(s) >= 6:
            known.add(s)
            known.add(unquote(s))
    for s in sorted(known, key=len, reverse=True):
        out = out.replace(s, "***")
    for pattern, repl in _REDACT_PATTERNS:
        out = pattern.sub(repl, out)
    return out


# ---------------------------------------------------------------------------------------------
# URL and credentials
# ---------------------------------------------------------------------------------------------


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
        segments.extend(s for s in part.strip("/").split("/") if s)
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
    segments = [unquote(s) for s in parts.path.split("/") if s]

    m = _HOST_STYLE_RE.match(host)
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


def _connection_string_fields(conn: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in conn.split(";"):
        if "=" in item:
            k, v = item.split("=", 1)
            fields[k.strip().lower()] = v.strip()
    return fields


#: The emulator's documented development account, for ``UseDevelopmentStorage=true``.
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass
class _Credentials:
    source: str  # "connection string" | "account key" | "SAS token" | "DefaultAzureCredential"
    secrets: tuple[str, ...]
    auth: Any  # a blobapi authorisation: SharedKey, SasToken or BearerToken
    endpoint: str | None = None  # scheme://host[:port][/account] from a connection string
    account: str | None = None

    def hint(self, account: str) -> str:
        return {
            "connection string": "check AZURE_STORAGE_CONNECTION_STRING (AccountName/AccountKey or SAS) is current for this account",
            "account key": f"check AZURE_STORAGE_KEY is a current access key of account {account!r}",
            "SAS token": "check the SAS token is for this account and container, has not expired (se=) and the clock is right",
            "DefaultAzureCredential": "check the pod's managed or workload identity (AZURE_CLIENT_ID for a user-assigned one) and its token",
        }[self.source]


def _from_connection_string(conn: str) -> _Credentials:
    f = _connection_string_fields(conn)
    secrets = tuple(s for s in (conn, f.get("accountkey"), f.get("sharedaccesssignature")) if s)
    bad = "AZURE_STORAGE_CONNECTION_STRING is not a usable storage connection string"
    if f.get("usedevelopmentstorage", "").lower() == "true":
        f.setdefault("accountname", _DEV_ACCOUNT)
        f.setdefault("accountkey", _DEV_KEY)
        f.setdefault("blobendpoint", f"http://127.0.0.1:10000/{_DEV_ACCOUNT}")
    account = f.get("accountname")
    endpoint = f.get("blobendpoint", "").rstrip("/")
    if not endpoint and account:
        scheme = f.get("defaultendpointsprotocol", "https").lower()
        endpoint = f"{scheme}://{account}.blob.{f.get('endpointsuffix', 'core.windows.net')}"
    if not endpoint:
        raise ValueError(f"{bad}: it names neither BlobEndpoint nor AccountName")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{bad}: BlobEndpoint must be an http(s) URL")
    if not account:
        m = _HOST_STYLE_RE.match(parts.hostname)
        account = m.group("account") if m else (parts.path.strip("/").split("/")[0] or None)
    if not account:
        raise ValueError(f"{bad}: it has no AccountName")
    if f.get("accountkey"):
        auth: Any = SharedKey(account, f["accountkey"])
    elif f.get("sharedaccesssignature"):
        auth = SasToken(f["sharedaccesssignature"])
    else:
        raise ValueError(f"{bad}: it has neither AccountKey nor SharedAccessSignature")
    return _Credentials("connection string", secrets, auth, endpoint=endpoint, account=account)


def _pick_credentials(env: Mapping[str, str], account: str, url_sas: str | None, scheme: str,
                      allow_token: bool = True) -> _Credentials | None:
    """The first configured credential (see the module docstring); ``None`` instead of an Azure AD
    credential when ``allow_token`` is false."""
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if conn:
        try:
            return _from_connection_string(conn)
        except ValueError as e:
            raise ValueError(redact(str(e), [conn])) from None
    key = env.get("AZURE_STORAGE_KEY", "").strip()
    if key:
        try:
            return _Credentials("account key", (key,), SharedKey(account, key))
        except ValueError:
            raise ValueError("AZURE_STORAGE_KEY is not an account key (base64)") from None
    sas = env.get("AZURE_STORAGE_SAS_TOKEN", "").strip().lstrip("?") or (url_sas or "").lstrip("?")
    if sas:
        if "sig=" not in sas:
            raise ValueError("AZURE_STORAGE_SAS_TOKEN does not look like a SAS token (it has no sig=)")
        secrets = tuple(s for s in (sas, *re.findall(r"sig=([^&]+)", sas)) if s)
        return _Credentials("SAS token", secrets, SasToken(sas))
    if scheme != "https":
        raise ValueError("an Azure AD token (DefaultAzureCredential) is only sent over https; use an "
                         "https store URL, or AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_KEY for an emulator")
    if not allow_token:
        return None
    # Only this path imports azure-identity (and, with it, azure-core and aiohttp) and the client.
    from azure.identity.aio import DefaultAzureCredential

    from sidecar.store import blobapi

    client_id = env.get("AZURE_CLIENT_ID") or None
    cred = DefaultAzureCredential(**({"managed_identity_client_id": client_id} if client_id else {}))
    return _Credentials("DefaultAzureCredential", (), blobapi.BearerToken(cred))


def resolve(url: str, prefix: str = "", env: Mapping[str, str] | None = None,
            allow_token: bool = True) -> tuple[BlobLocation, _Credentials | None]:
    """Location and credentials for ``SIDECAR_STORE=url``, ``SIDECAR_PREFIX=prefix``; ValueError,
    without any secret in the message, for a bad URL or credential."""
    env = os.environ if env is None else env
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    known = _connection_string_fields(conn).get("accountname") or env.get("AZURE_STORAGE_ACCOUNT") or None
    try:
        location = parse_store_url(url, prefix, known_account=known)
    except ValueError as e:
        # The URL may carry a SAS token; never echo it.
        raise ValueError(redact(str(e), [urlsplit(url).query] if "?" in url else [])) from None
    return location, _pick_credentials(env, location.account, location.sas, location.scheme, allow_token)


def endpoint_of(location: BlobLocation, credentials: _Credentials) -> tuple[str, str]:
    """``(scheme://host[:port], base path)`` of the blob endpoint requests go to: a connection
    string's endpoint replaces the URL's; the base path is the account segment in path style."""
    parts = urlsplit(credentials.endpoint or location.endpoint)
    return f"{parts.scheme}://{parts.netloc}", parts.path.rstrip("/")


def list_query(start: str, marker: str = "") -> list[tuple[str, str]]:
    """The List Blobs query for one page from ``marker`` of the names starting with ``start``."""
    query = [("restype", "container"), ("comp", "list"), ("include", "metadata"), ("maxresults", "5000")]
    if start:
        query.append(("prefix", start))
    if marker:
        query.append(("marker", marker))
    return query
