"""The production credential path for real: a managed identity token, bearer auth, over TLS.

Azure Container Apps and App Service hand a container its managed identity through
``IDENTITY_ENDPOINT`` + ``IDENTITY_HEADER``. Here only that token endpoint is emulated (a small
HTTP server on 127.0.0.1 that checks the header and the resource and answers with a JWT shaped
like Entra ID's); everything else is real: the sidecar's ``sync``, ``restore`` and ``run``
processes with no key, SAS or connection string, azure-identity's ``DefaultAzureCredential``
chain (which reaches ``ManagedIdentityCredential``), the SDK's bearer policy, and an Azurite of
the store tests' own serving https (``tls_azurite``) with ``--oauth basic`` (it checks a token's lifetime, issuer and
audience, not its signature).

The chain tries only the environment's service principal, workload identity and managed identity
(``sidecar.store.azure.credentials._token_credential``), and the test environment carries none of the
variables the first two need, so nothing but the emulated endpoint is ever asked for a token: no
developer tool, no instance metadata service (169.254.169.254).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import anyio
import pytest

from support import Sidecar, disk_tree, run_cli, sidecar_env, wait_for, write_atomic
from tests.azurite import DEV_ACCOUNT, DEV_KEY, Azurite

pytestmark = pytest.mark.azure

#: What IDENTITY_HEADER holds: a secret shared by the platform and the container.
IDENTITY_HEADER = "identity-header-" + uuid.uuid4().hex
CLIENT_ID = "5f2e1a0c-0000-4000-8000-00000000c1d1"  # the user-assigned identity AZURE_CLIENT_ID picks
TENANT = "72f988bf-0000-4000-8000-0000000000aa"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def mint_jwt(expires_on: int, signing_key: bytes) -> str:
    """A bearer token as Entra ID issues one for storage: audience, issuer, lifetime; self-signed."""
    now = int(time.time())
    header = {"alg": "HS256", "typ": "JWT"}
    claims = {"aud": "https://storage.azure.com", "iss": f"https://sts.windows.net/{TENANT}/", "iat": now - 60,
              "nbf": now - 60, "exp": expires_on, "appid": CLIENT_ID, "oid": str(uuid.uuid4()), "tid": TENANT,
              "sub": CLIENT_ID, "ver": "1.0"}
    signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
    signature = hmac.new(signing_key, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64url(signature)}"


class TokenEndpoint:
    """The App Service / Container Apps managed identity endpoint (api-version 2019-08-01).

    ``mode``: ``ok`` (a token valid for an hour), ``expired`` (a token that expired a minute ago),
    ``400`` / ``500`` (refuses), ``slow`` (answers only when :meth:`release` is called).
    ``requests`` records (header was right, query) for every request; ``tokens`` what was handed out.
    """

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.requests: list[tuple[bool, dict[str, list[str]]]] = []
        self.tokens: list[str] = []
        self._released = threading.Event()
        self._key = os.urandom(32)
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                query = parse_qs(urlsplit(self.path).query)
                header_ok = self.headers.get("X-IDENTITY-HEADER") == IDENTITY_HEADER
                endpoint.requests.append((header_ok, query))
                if endpoint.mode == "slow":
                    endpoint._released.wait(120)
                if not header_ok or query.get("resource") != ["https://storage.azure.com"]:
                    return self._answer(400, {"error": "invalid_request", "error_description": "bad header or resource"})
                if endpoint.mode in ("400", "500"):
                    return self._answer(int(endpoint.mode), {"error": "unavailable",
                                                             "error_description": "identity not assigned"})
                expires_on = int(time.time()) + (-60 if endpoint.mode == "expired" else 3600)
                token = mint_jwt(expires_on, endpoint._key)
                endpoint.tokens.append(token)
                self._answer(200, {"access_token": token, "expires_on": str(expires_on),
                                   "resource": "https://storage.azure.com", "token_type": "Bearer",
                                   "client_id": query.get("client_id", [""])[0]})

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="token-endpoint", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/msi/token"

    def release(self) -> None:
        self._released.set()

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def identity():
    endpoint = TokenEndpoint()
    yield endpoint
    endpoint.stop()


def identity_env(azurite: Azurite, endpoint: TokenEndpoint, **extra: str) -> dict[str, str]:
    """The sidecar's environment on Container Apps: the identity endpoint, no key, SAS or
    connection string, no other Azure credential source, and the emulator's CA trusted."""
    env = {k: v for k, v in sidecar_env().items()
           if not k.startswith(("AZURE_", "IDENTITY_", "MSI_", "IMDS_")) and k.upper() not in ("HTTPS_PROXY", "HTTP_PROXY")}
    env.update(IDENTITY_ENDPOINT=endpoint.url, IDENTITY_HEADER=IDENTITY_HEADER, AZURE_CLIENT_ID=CLIENT_ID,
               SSL_CERT_FILE=azurite.cert or "", REQUESTS_CA_BUNDLE=azurite.cert or "", SIDECAR_LOG_LEVEL="debug")
    env.update(extra)
    return env


async def _stored(azurite: Azurite, container: str) -> dict[str, bytes]:
    """What the container holds (read with the account key, which Azurite still accepts)."""
    from azure.core.credentials import AzureNamedKeyCredential
    from azure.storage.blob.aio import BlobServiceClient

    out: dict[str, bytes] = {}
    async with BlobServiceClient(azurite.url, credential=AzureNamedKeyCredential(DEV_ACCOUNT, DEV_KEY),
                                 connection_verify=azurite.cert) as svc:
        c = svc.get_container_client(container)
        if not await c.exists():
            return out
        async for b in c.list_blobs():
            out[b.name] = await (await c.download_blob(b.name)).readall()
    return out


def stored(azurite: Azurite, container: str, root: str = ".checkpoints") -> dict[str, bytes]:
    return {k[len(root) + 1:]: v for k, v in anyio.run(_stored, azurite, container).items() if k.startswith(root + "/")}


def assert_no_secret(text: str, endpoint: TokenEndpoint) -> None:
    for secret in (IDENTITY_HEADER, *endpoint.tokens, *(t.rsplit(".", 1)[1] for t in endpoint.tokens)):
        assert secret not in text, "a secret (the identity header or a token) was printed"


def test_sync_restore_and_run_with_a_managed_identity_over_tls(tls_azurite, identity, tmp_path):
    container = f"mi-{uuid.uuid4().hex[:12]}"
    store = f"{tls_azurite.url}/{container}"
    env = identity_env(tls_azurite, identity)
    work = tmp_path / "work"
    cps = work / ".checkpoints"
    cps.mkdir(parents=True)
    files = {f"ctx{i % 2}/{i}.json": os.urandom(200 + i) for i in range(6)}
    outputs: list[str] = []

    sc = Sidecar(work, "sync", "--store", store, env=env)
    try:
        sc.wait_event("ready", 60)
        for rel, data in files.items():
            write_atomic(cps / rel, data)
        wait_for(lambda: stored(tls_azurite, container) == files, 60, "the files in the TLS Azurite",
                 diagnostics=lambda: "\n" + sc.log()[-3000:], interval=0.2)
        assert sc.stop() == 0, sc.log()[-3000:]
    finally:
        sc.kill()
    outputs.append(sc.log())

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = run_cli("restore", "--store", store, cwd=fresh, env=env)
    outputs.append(r.stdout + r.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    assert disk_tree(fresh / ".checkpoints") == files

    again = tmp_path / "again"
    again.mkdir()
    child = ("import os; os.makedirs('.checkpoints/ctx9', exist_ok=True); "
             "open('.checkpoints/ctx9/new.json', 'w').write('from run')")
    r = run_cli("run", "--store", store, "--", "python3", "-c", child, cwd=again, env=env)
    outputs.append(r.stdout + r.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    assert disk_tree(again / ".checkpoints") == {**files, "ctx9/new.json": b"from run"}
    assert stored(tls_azurite, container) == {**files, "ctx9/new.json": b"from run"}

    # The token came from the managed identity endpoint, asked properly, for the chosen identity.
    assert identity.requests and all(ok for ok, _q in identity.requests)
    assert {q.get("client_id", [""])[0] for _ok, q in identity.requests} == {CLIENT_ID}
    assert all(q.get("api-version") == ["2019-08-01"] for _ok, q in identity.requests)
    for text in outputs:
        assert_no_secret(text, identity)
        assert "Traceback" not in text


@pytest.mark.parametrize("mode, words", [
    ("400", "ManagedIdentityCredential"),
    pytest.param("500", "ManagedIdentityCredential", marks=pytest.mark.slow),
    pytest.param("slow", "ManagedIdentityCredential", marks=pytest.mark.slow),  # waits out the SDK's timeout
    ("expired", "token is expired"),
])
def test_a_broken_token_endpoint_is_one_clear_line(tls_azurite, identity, tmp_path, mode, words):
    identity.mode = mode
    container = f"mi-bad-{uuid.uuid4().hex[:12]}"
    env = identity_env(tls_azurite, identity, SIDECAR_LOG_FORMAT="text")
    work = tmp_path / "work"
    work.mkdir()
    try:
        r = run_cli("restore", "--store", f"{tls_azurite.url}/{container}", cwd=work, env=env, timeout=120)
    finally:
        identity.release()
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "Traceback" not in out
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, out[-3000:]
    line = errors[0]
    assert "cannot reach the store" in line and words in line, line
    assert f"account {DEV_ACCOUNT!r}" in line and f"container {container!r}" in line, line
    assert identity.requests, "the token endpoint was never asked"
    assert_no_secret(out, identity)
    assert not (work / ".checkpoints").exists() or not any((work / ".checkpoints").iterdir())
