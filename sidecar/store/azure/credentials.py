"""Which credential an Azure Blob store signs with, first match wins (none is ever logged or
shown in an error):

1. ``AZURE_STORAGE_CONNECTION_STRING``: its endpoint replaces the URL's; container and prefix
   still come from the URL;
2. ``AZURE_STORAGE_KEY``: the URL's account and this key;
3. a SAS token: ``AZURE_STORAGE_SAS_TOKEN``, else the URL's query;
4. else ``DefaultAzureCredential`` (:func:`_token_credential`), over https only.

The connection string is read here, not by the SDK: its parser is private
(``azure.storage.blob._shared.base_client.parse_connection_str``) and the public route,
``BlobServiceClient.from_connection_string``, builds a client, while the store needs the endpoint,
the account and the key before it has one (the endpoint picks the proxy and names the store in
every message; the client is made in the event loop on first use), and a one-line error naming
the field at fault. ``tests/store/test_azure.py`` checks both read the same endpoint and account.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit

from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential

from sidecar import log
from sidecar.store.azure.errors import one_line
from sidecar.store.azure.location import HOST_STYLE_RE, connection_string_fields

#: The emulator's documented development account, for ``UseDevelopmentStorage=true``.
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass
class Credentials:
    source: str  # "connection string" | "account key" | "SAS token" | "DefaultAzureCredential"
    secrets: tuple[str, ...]
    #: what the SDK client is given: AzureNamedKeyCredential, AzureSasCredential or an async
    #: token credential (which this store made and closes)
    credential: Any
    endpoint: str | None = None  # scheme://host[:port][/account] from a connection string
    account: str | None = None

    @property
    def owned(self) -> Any:
        """The token credential to close with the store, if any."""
        return self.credential if self.source == "DefaultAzureCredential" else None

    def hint(self, account: str) -> str:
        return {
            "connection string":
                "check AZURE_STORAGE_CONNECTION_STRING (AccountName/AccountKey or SAS) is current for this account",
            "account key": f"check AZURE_STORAGE_KEY is a current access key of account {account!r}",
            "SAS token":
                "check the SAS token is for this account and container, has not expired (se=) and the clock is right",
            "DefaultAzureCredential":
                "check the pod's managed or workload identity (AZURE_CLIENT_ID for a user-assigned one) and its token",
        }[self.source]


def _account_key(account: str, key: str, what: str) -> AzureNamedKeyCredential:
    try:
        base64.b64decode(key, validate=True)
    except (ValueError, binascii.Error):
        raise ValueError(f"{what} is not an account key (base64)") from None
    return AzureNamedKeyCredential(account, key)


def _from_connection_string(conn: str) -> Credentials:
    f = connection_string_fields(conn)
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
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError:
        raise ValueError(f"{bad}: BlobEndpoint must be an http(s) URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{bad}: BlobEndpoint must be an http(s) URL")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{bad}: BlobEndpoint must not contain a user name or password")
    if not account:
        m = HOST_STYLE_RE.match(parts.hostname)
        account = m.group("account") if m else (parts.path.strip("/").split("/")[0] or None)
    if not account:
        raise ValueError(f"{bad}: it has no AccountName")
    secrets = tuple(s for s in (conn, f.get("accountkey"), f.get("sharedaccesssignature")) if s)
    if f.get("accountkey"):
        credential: Any = _account_key(account, f["accountkey"], f"{bad}: its AccountKey")
    elif f.get("sharedaccesssignature"):
        credential = AzureSasCredential(f["sharedaccesssignature"].lstrip("?"))
    else:
        raise ValueError(f"{bad}: it has neither AccountKey nor SharedAccessSignature")
    return Credentials("connection string", secrets, credential, endpoint=endpoint, account=account)


#: The ``exclude_*`` flags of :func:`_token_credential`: the developer-tool sources of
#: DefaultAzureCredential, which a sidecar has no use for (they look for az, pwsh, azd, VS Code
#: and a shared token cache on the host).
_DEVELOPER_SOURCES = ("shared_token_cache", "visual_studio_code", "cli", "developer_cli", "powershell")


def _token_credential(env: Mapping[str, str], timeout: float) -> Any:
    """``azure.identity.aio.DefaultAzureCredential`` for a host without key or SAS.

    Unless ``AZURE_TOKEN_CREDENTIALS`` chooses otherwise (azure-identity's own switch: ``dev``,
    ``prod`` or one credential's name), only the production sources are tried, in the SDK's
    order: the environment's service principal (``AZURE_TENANT_ID``, ``AZURE_CLIENT_ID``,
    ``AZURE_CLIENT_SECRET``/certificate), workload identity (``AZURE_FEDERATED_TOKEN_FILE``) and
    managed identity (``IDENTITY_ENDPOINT`` + ``IDENTITY_HEADER`` on Container Apps and App
    Service, else the instance metadata service). Token requests time out after ``timeout``
    seconds, are not retried after a timeout and at most three times after a 5xx, so a broken
    identity endpoint is one clear error within seconds rather than minutes.
    Only this function imports azure-identity.
    """
    from azure.identity.aio import DefaultAzureCredential

    options: dict[str, Any] = {"connection_timeout": timeout, "read_timeout": timeout,
                               "retry_total": 3, "retry_read": 0}
    client_id = env.get("AZURE_CLIENT_ID") or None
    if client_id:
        options["managed_identity_client_id"] = client_id
    if not env.get("AZURE_TOKEN_CREDENTIALS", "").strip():
        options.update({f"exclude_{name}_credential": True for name in _DEVELOPER_SOURCES})
    try:
        return DefaultAzureCredential(**options)
    except ValueError as e:  # an AZURE_TOKEN_CREDENTIALS value it does not know
        raise ValueError(one_line(str(e), 240)) from None


def pick_credentials(env: Mapping[str, str], account: str, url_sas: str | None, scheme: str,
                      timeout: float = 10.0) -> Credentials:
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if conn:
        try:
            return _from_connection_string(conn)
        except ValueError as e:
            raise ValueError(log.redact(str(e), [conn])) from None
    key = env.get("AZURE_STORAGE_KEY", "").strip()
    if key:
        return Credentials("account key", (key,), _account_key(account, key, "AZURE_STORAGE_KEY"))
    sas = env.get("AZURE_STORAGE_SAS_TOKEN", "").strip().lstrip("?") or (url_sas or "").lstrip("?")
    if sas:
        if "sig=" not in sas:
            raise ValueError("AZURE_STORAGE_SAS_TOKEN does not look like a SAS token (it has no sig=)")
        secrets = tuple(s for s in (sas, *re.findall(r"sig=([^&]+)", sas)) if s)
        return Credentials("SAS token", secrets, AzureSasCredential(sas))
    if scheme != "https":
        raise ValueError("an Azure AD token (DefaultAzureCredential) is only sent over https; use an "
                         "https store URL, or AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_KEY for an emulator")
    return Credentials("DefaultAzureCredential", (), _token_credential(env, timeout))
