"""What an Azure Blob failure means, said in one line: :func:`store_error` maps an SDK exception to
:class:`~sidecar.store.base.StoreError` (fix something), :class:`~sidecar.store.base.TransientStoreError`
(retry) or :class:`~sidecar.store.base.NotFound`, naming the operation, the key and what to check,
never a secret. The SDK's own log records are routed here too (:class:`_SdkLogBridge`).
"""

from __future__ import annotations

import logging
import re
import ssl
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
from azure.core.exceptions import AzureError, ClientAuthenticationError, HttpResponseError

from sidecar import log
from sidecar.store.base import StoreError, TransientStoreError
from sidecar.store.proxy import Proxy

#: Statuses that retrying can fix (the SDK retries 408 and 5xx itself; 429 reaches the sidecar).
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: What a connection failure of each kind is called in a message.
_FAILED = {"dns": "cannot resolve the host", "refused": "connection refused", "timeout": "timed out"}


def one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def error_code(e: BaseException) -> str | None:
    """The storage error code (``BlobNotFound``...) of an SDK exception, as a plain string."""
    code = getattr(e, "error_code", None)
    code = getattr(code, "value", code)
    return str(code) if code else None


def _cause_chain(e: BaseException) -> list[BaseException]:
    """``e`` and what it wraps: causes, contexts, the SDK's ``inner_exception``, aiohttp's ``os_error``."""
    seen: set[int] = set()
    out: list[BaseException] = []
    todo: list[Any] = [e]
    while todo and len(out) < 16:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
        todo.extend([getattr(x, "inner_exception", None), getattr(x, "os_error", None), x.__cause__, x.__context__])
    return out


def failure_kind(e: BaseException) -> tuple[str, int | None]:
    """What kind of connection failure ``e`` is: ``proxy`` (the proxy refused the tunnel, with its
    status), ``tls``, ``dns``, ``refused``, ``timeout`` or ``failed``."""
    chain = _cause_chain(e)
    for x in chain:
        if isinstance(x, aiohttp.ClientHttpProxyError):
            return "proxy", x.status
    if any(isinstance(x, (ssl.SSLError, ssl.CertificateError, aiohttp.ClientSSLError)) for x in chain):
        return "tls", None
    if any(isinstance(x, aiohttp.ClientConnectorDNSError) or type(x).__name__ == "gaierror" for x in chain):
        return "dns", None
    if any(isinstance(x, ConnectionRefusedError) for x in chain):
        return "refused", None
    if any(isinstance(x, TimeoutError) or "Timeout" in type(x).__name__ for x in chain):
        return "timeout", None
    text = " ".join(str(x) for x in chain).lower()
    if "name or service not known" in text or "temporary failure in name resolution" in text:
        return "dns", None
    if "connection refused" in text or "errno 111" in text:
        return "refused", None
    return "failed", None



def _credential_reason(e: BaseException) -> str:
    """The line of an azure-identity failure that says why: the last credential the chain tried."""
    text = str(getattr(e, "message", None) or e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    tried = [line for line in lines if re.match(r"^\w+Credential: ", line)]
    return one_line(tried[-1] if tried else (lines[0] if lines else type(e).__name__), 240)


def _service_detail(e: BaseException) -> str:
    """The service's own reason for refusing a token (``AuthenticationErrorDetail``), if it gave one."""
    m = re.search(r"(?im)^\s*authenticationerrordetail:\s*(.+)$", str(getattr(e, "message", None) or e))
    return f": {one_line(m.group(1), 160)}" if m else ""



@dataclass(frozen=True)
class Where:
    """What a failure message names: the store, its credential, the route to it."""

    account: str
    container: str
    endpoint: str  # redacted
    credential: str  # the credential's source: "connection string", "account key"...
    hint: str  # what to check about that credential
    proxy: Proxy | None
    retry_total: int
    secrets: tuple[str, ...] = field(default=(), repr=False)

    def __str__(self) -> str:
        return f"Azure Blob store (account {self.account!r}, container {self.container!r})"

    def message(self, cls: type[StoreError], text: str) -> StoreError:
        """``cls`` with ``text`` after the store's name, redacted."""
        return cls(log.redact(f"{self}: {text}", self.secrets))


def store_error(e: BaseException, doing: str, where: Where, opened: bool) -> StoreError:
    """One clear, secret-free line for a failed operation (``doing``: "uploading 'r/k'"...);
    transient when retrying can help. ``opened``: the store was reached before, so a connection
    failure is an outage rather than a wrong endpoint."""

    def done(cls: type[StoreError], text: str) -> StoreError:
        return cls(log.redact(one_line(f"{where}: {doing} failed: {text}", 600), where.secrets))

    status = getattr(e, "status_code", None) if isinstance(e, HttpResponseError) else None
    if isinstance(e, ClientAuthenticationError) and status is None:
        # The credential itself could not get a token (no identity here, or a bad one).
        return done(
            StoreError,
            f"no usable Azure credential via {where.credential} ({_credential_reason(e)}); set "
            "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, "
            "or give the pod a managed/workload identity (AZURE_CLIENT_ID for a user-assigned one)",
        )
    if status is None:
        if isinstance(e, AzureError):
            return _connection_error(e, done, where, opened)
        return done(StoreError, one_line(f"{type(e).__name__}: {e}", 160))
    code = error_code(e)
    detail = f" ({' '.join(str(x) for x in (status, code) if x)})"
    if status == 407 and where.proxy is not None:
        return done(StoreError, f"the proxy {where.proxy.description} refused the request to {where.endpoint} "
                                "(HTTP 407); check the credentials in HTTP_PROXY, or add the host to NO_PROXY")
    if status in (401, 403):
        if code in ("AuthorizationPermissionMismatch", "AuthorizationResourceTypeMismatch",
                    "AuthorizationServiceMismatch"):
            if where.credential == "DefaultAzureCredential":
                what = (f"grant the identity the 'Storage Blob Data Contributor' role on container "
                        f"{where.container!r} (assignments take minutes to apply)")
            elif where.credential in ("SAS token", "connection string"):
                what = "a SAS needs read, add, create, write, delete and list permissions on the container"
            else:
                what = "check the account's firewall and network rules allow this host"
            return done(StoreError, f"permission denied{detail}; {what}")
        if code == "AuthorizationFailure":
            # Azure: a firewall / network rule or SAS scope; Azurite: also a wrong key.
            return done(StoreError, f"request not authorized{detail}; {where.hint}, "
                                    "and that the account's firewall / network rules allow this host")
        if code == "KeyBasedAuthenticationNotPermitted":
            return done(StoreError, f"shared key access is disabled on the account{detail}; use a managed identity or a SAS")
        if code == "AccountIsDisabled":
            return done(StoreError, f"the storage account is disabled{detail}")
        return done(StoreError, f"authentication failed{detail}{_service_detail(e)}; {where.hint}")
    if status == 404 and code == "ContainerNotFound":
        return done(StoreError, f"the container does not exist{detail}; was it deleted? the sidecar creates it on start")
    if status in TRANSIENT_STATUS or (status == 409 and code == "ContainerBeingDeleted"):
        kind = "throttled" if status in (429, 503) else "service error"
        retried = "" if status == 429 else f" after {where.retry_total} retries"
        return done(TransientStoreError, f"{kind}{detail}{retried}; will retry later")
    if code in ("Md5Mismatch", "Crc64Mismatch"):
        return done(TransientStoreError, f"the data was corrupted in transit{detail}; will retry")
    if status == 412:
        return done(TransientStoreError, f"the blob changed while it was read{detail}; will retry")
    return done(StoreError, f"unexpected answer{detail}")


def _connection_error(e: BaseException, done: Callable[[type[StoreError], str], StoreError], where: Where,
                      opened: bool) -> StoreError:
    kind, proxy_status = failure_kind(e)
    proxy = where.proxy
    if proxy is not None and kind in ("proxy", "dns", "refused"):
        # Only the proxy is looked up and dialled when there is one.
        if kind != "proxy":
            return done(StoreError if not opened else TransientStoreError,
                        f"{_FAILED[kind]} for the proxy {proxy.description} (reaching {where.endpoint}); check "
                        "HTTPS_PROXY / HTTP_PROXY, or add the host to NO_PROXY")
        if proxy_status in (401, 403, 407):
            return done(StoreError, f"the proxy {proxy.description} refused the connection to {where.endpoint} "
                                    f"(HTTP {proxy_status}); check the credentials in HTTPS_PROXY and the proxy's "
                                    "allow list, or add the host to NO_PROXY")
        return done(TransientStoreError, f"the proxy {proxy.description} could not reach {where.endpoint} (HTTP "
                                         f"{proxy_status}; check the account name in SIDECAR_STORE); will retry later")
    endpoint = where.endpoint + (f" through the proxy {proxy.description}" if proxy is not None else "")
    if kind == "tls":
        return done(StoreError, f"TLS failure talking to {endpoint}; check the URL scheme and host, "
                                "the CA bundle (SSL_CERT_FILE) and any TLS-intercepting proxy")
    what = _FAILED.get(kind, "connection failed")
    if not opened and kind in ("dns", "refused"):
        # Never reached the service at all: a wrong account name, endpoint or port.
        check = ("check the account name in SIDECAR_STORE (or the connection string's endpoint) "
                 "and DNS / private-endpoint resolution") if kind == "dns" else \
                "check the endpoint host and port are right and the service is running and reachable"
        return done(StoreError, f"{what} for {endpoint}; {check}")
    return done(TransientStoreError, f"{what} for {endpoint} after {where.retry_total} retries; "
                                     "check network reachability (firewall, proxy); will retry later")


# -- the SDK's own log records ---------------------------------------------------------------------

class _SdkLogBridge(logging.Handler):
    """Sends the ``azure`` loggers' records (WARNING and up) to :mod:`sidecar.log`, one redacted
    line each, instead of Python's last-resort handler (several raw lines on stderr).
    azure-identity's account of a failed token request comes at debug level: the store's own
    error says it once, in the line that matters."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = log.redact(one_line(record.getMessage(), 400))
        except Exception:  # a record that cannot be formatted is not worth a crash
            return
        if record.name.startswith("azure.identity"):
            log.debug("azure_sdk", logger=record.name, detail=text)
        elif record.levelno >= logging.WARNING:
            log.warning("azure_sdk", logger=record.name, detail=text)


def _route_sdk_logs() -> None:
    sdk = logging.getLogger("azure")
    if not any(isinstance(h, _SdkLogBridge) for h in sdk.handlers):
        sdk.addHandler(_SdkLogBridge())
    sdk.propagate = False
    if sdk.level == logging.NOTSET or sdk.level < logging.WARNING:
        sdk.setLevel(logging.WARNING)  # the SDK logs every request at INFO


_route_sdk_logs()
