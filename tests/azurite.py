"""Run Azurite (the Azure Storage emulator) for tests and benchmarks.

Two things live here, both plain so other conftest files (and ``bench/``) can import them:

* :class:`Azurite` starts ``node <azurite>/dist/src/blob/main.js`` on 127.0.0.1 with a port and a
  workspace directory of its own, waits until it answers, and can :meth:`Azurite.stop` and
  :meth:`Azurite.start` again on the same port and location (outage tests). With ``cert`` and
  ``key`` it serves https (:func:`self_signed_cert` makes a pair), with ``oauth="basic"`` it also
  accepts Azure AD bearer tokens (checked for lifetime, issuer and audience, not signature).
* the session fixture :func:`azurite`, which uses ``AZURITE_BLOB_URL`` (e.g.
  ``http://127.0.0.1:10000/devstoreaccount1``, set by CI) when present and otherwise starts its
  own Azurite; it yields an :class:`AzuriteEndpoint` with the blob endpoint URL and the well-known
  ``devstoreaccount1`` connection string.

The Azurite install is found via ``AZURITE_BLOB_BIN`` (the blob ``main.js``, or an executable
such as ``azurite-blob``) or under ``.cache/azurite/node_modules/azurite`` in the repository.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The emulator's well-known development account (public, documented; not a secret).
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

_MAIN_JS = os.path.join("node_modules", "azurite", "dist", "src", "blob", "main.js")

#: The pinned Azurite (scripts/lib/env.sh installs it into the cache).
AZURITE_VERSION = "3.35.0"


class AzuriteUnavailable(RuntimeError):
    """No Azurite install (or no node) to start."""


def connection_string(blob_url: str, account: str = DEV_ACCOUNT, key: str = DEV_KEY) -> str:
    """The connection string for a path-style Azurite endpoint ``http://host:port/<account>``."""
    scheme = urlsplit(blob_url).scheme or "http"
    return (
        f"DefaultEndpointsProtocol={scheme};AccountName={account};AccountKey={key};"
        f"BlobEndpoint={blob_url.rstrip('/')};"
    )


def find_azurite_command() -> list[str]:
    """The argv prefix that runs Azurite's blob service; :class:`AzuriteUnavailable` if none."""
    explicit = os.environ.get("AZURITE_BLOB_BIN")
    cache = os.environ.get("SIDECAR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "checkpoint-sidecar")
    candidates = [explicit] if explicit else [os.path.join(cache, f"azurite-{AZURITE_VERSION}", _MAIN_JS),
                                              os.path.join(REPO, ".cache", "azurite", _MAIN_JS)]
    for path in candidates:
        if path and os.path.exists(path):
            if path.endswith(".js"):
                node = shutil.which("node")
                if node is None:
                    raise AzuriteUnavailable("node is not on PATH")
                return [node, path]
            return [path]
    raise AzuriteUnavailable(
        "Azurite not found: set AZURITE_BLOB_URL to a running instance, AZURITE_BLOB_BIN to its "
        f"blob main.js, or install it with scripts/test ({candidates[0]})"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


def self_signed_cert(directory: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> tuple[str, str]:
    """A self-signed certificate for ``hosts`` (IP addresses or names) and its key, written as PEM
    files into ``directory``: (cert path, key path). The certificate is its own CA: trust it with
    ``SSL_CERT_FILE`` (or ``connection_verify=`` for an SDK client in the test process)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    alt: list[x509.GeneralName] = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


def answers(blob_url: str, timeout: float = 1.0, cafile: str | None = None) -> bool:
    """True when something speaking HTTP answers at ``blob_url`` (any status counts); an https
    one must present a certificate that ``cafile`` vouches for."""
    opener = _DIRECT
    if cafile is not None:
        import ssl

        context = ssl.create_default_context(cafile=cafile)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(f"{blob_url.rstrip('/')}?comp=list", timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # 403 without credentials: it is up
    except (OSError, urllib.error.URLError):
        return False


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass (then TimeoutError)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Azurite:
    """One Azurite blob service process on 127.0.0.1, restartable on the same port and location."""

    location: str
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"
    startup_timeout: float = 30.0
    cert: str | None = None  # PEM certificate and key: serve https
    key: str | None = None
    oauth: str | None = None  # "basic": accept bearer tokens too (needs https)
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _log: object = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        scheme = "https" if self.cert else "http"
        return f"{scheme}://{self.host}:{self.port}/{DEV_ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return connection_string(self.url)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> str:
        return os.path.join(self.location, "azurite.log")

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "Azurite":
        if self.running():
            return self
        os.makedirs(self.location, exist_ok=True)
        argv = find_azurite_command() + [
            "--blobHost", self.host,
            "--blobPort", str(self.port),
            "--location", self.location,
            "--skipApiVersionCheck",
            "--disableTelemetry",
            "--silent",
        ]
        if self.cert:
            argv += ["--cert", self.cert, "--key", self.key or ""]
        if self.oauth:
            argv += ["--oauth", self.oauth]
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (the server's log while it runs; closed in stop)
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,  # our own process group: a test's ^C does not hit it twice
        )

        def up() -> bool:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"Azurite exited with status {self._proc.returncode} during startup; "
                    f"see {self.log_path}"
                )
            return answers(self.url, timeout=0.5, cafile=self.cert)

        try:
            wait_until(up, self.startup_timeout, what=f"Azurite on port {self.port}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop this Azurite (by its own PID): SIGTERM so it saves its state, then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        # The port must be free again before a restart on it can succeed.
        if proc is not None:
            wait_until(lambda: not answers(self.url, timeout=0.2, cafile=self.cert), timeout, what="Azurite to stop")

    def restart(self) -> "Azurite":
        self.stop()
        return self.start()

    def __enter__(self) -> "Azurite":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class AzuriteEndpoint:
    """What tests need to reach Azurite. ``server`` is None when CI runs Azurite for us."""

    url: str  # http://127.0.0.1:PORT/devstoreaccount1
    account: str = DEV_ACCOUNT
    key: str = DEV_KEY
    server: Azurite | None = None

    @property
    def connection_string(self) -> str:
        return connection_string(self.url, self.account, self.key)

    def env(self) -> dict[str, str]:
        """A credential environment for :func:`azure_store` (``env=...``)."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def container_url(self, container: str) -> str:
        return f"{self.url.rstrip('/')}/{container}"


def unique_container(stem: str = "t") -> str:
    """A fresh valid container name (3-63 chars, lowercase letters, digits, single hyphens)."""
    return f"{stem}-{uuid.uuid4().hex[:20]}"


@pytest.fixture(scope="session")
def azurite() -> Iterator[AzuriteEndpoint]:
    """The Azurite blob endpoint for this test session (``AZURITE_BLOB_URL`` or our own)."""
    external = os.environ.get("AZURITE_BLOB_URL")
    if external:
        if not answers(external, timeout=2.0):
            pytest.fail(f"AZURITE_BLOB_URL={external} does not answer")
        yield AzuriteEndpoint(url=external.rstrip("/"))
        return
    try:
        find_azurite_command()
    except AzuriteUnavailable as e:
        pytest.skip(str(e))
    location = tempfile.mkdtemp(prefix="azurite-")
    server = Azurite(location)
    try:
        server.start()
        yield AzuriteEndpoint(url=server.url, server=server)
    finally:
        server.stop()
        shutil.rmtree(location, ignore_errors=True)


def azure_store(url: str, prefix: str = "", env: Mapping[str, str] | None = None, **options: Any) -> Any:
    """The Azure store of ``SIDECAR_STORE=url`` and ``SIDECAR_PREFIX=prefix``, not opened, made
    as the registry makes it (the URL checked by the backend's ``parse_url``, the store built at
    that location), credentials and proxy from ``env`` (default ``os.environ``); ``options`` tune
    its client as a test needs (``retry_total``, ``retry_backoff``, ``request_hook``...:
    ``AzureBlobStore.at``'s)."""
    from sidecar.store.azure import parse_url
    from sidecar.store.azure.store import AzureBlobStore

    env = os.environ if env is None else env
    return AzureBlobStore.at(parse_url(url, env).with_prefix(prefix), env, **options)
