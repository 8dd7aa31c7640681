"""The two credential paths bench/run.py measures, as one interface (``--credential``).

``key``       a plain-http Azurite; the sidecar gets ``AZURE_STORAGE_CONNECTION_STRING`` (account
              key, shared-key signing).
``identity``  the production path of Container Apps / App Service: an Azurite serving https with
              ``--oauth basic`` (tests/azurite.py's TLS and oauth options) and the emulated managed
              identity endpoint of tests/store/test_managed_identity.py (its ``TokenEndpoint``,
              which mints Entra-shaped JWTs). The sidecar gets ``IDENTITY_ENDPOINT`` +
              ``IDENTITY_HEADER`` + ``AZURE_CLIENT_ID``, ``SSL_CERT_FILE`` / ``REQUESTS_CA_BUNDLE``
              trusting the test certificate, an https store URL and no key, SAS or connection
              string, so the real ``DefaultAzureCredential`` -> ``ManagedIdentityCredential`` ->
              bearer-token path runs in every measured process.

The bench itself seeds the store and checks stored bytes with the account key, which the
TLS/oauth Azurite still accepts; only the measured processes (and the raw SDK floors, which use a
``ManagedIdentityCredential`` on the same endpoint) take the identity path.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, AsyncIterator

from tests.azurite import Azurite, self_signed_cert
from tests.store.test_managed_identity import CLIENT_ID, IDENTITY_HEADER, TokenEndpoint, identity_env

#: Variables the sidecar tests add for their own runs (tests/support.py's sidecar_env,
#: test_managed_identity's identity_env) that would change what is measured: the checkout on
#: PYTHONPATH instead of the installed program, a shorter fence margin, debug logging.
_TEST_ONLY = ("PYTHONPATH", "SIDECAR_FENCE_MARGIN", "SIDECAR_LOG_LEVEL")


class Target:
    """One fresh Azurite (and, for ``identity``, its token endpoint) for one figure."""

    def __init__(self, credential: str, location: Path, pki: Path) -> None:
        """``pki``: where the test certificate is made once and reused by every Target of the
        run. (Trusting a second self-signed certificate with the same subject in this process
        breaks verification: OpenSSL finds the first one by name and its signature does not
        match.)"""
        self.credential = credential
        self.endpoint: TokenEndpoint | None = None
        if credential == "identity":
            if not (pki / "cert.pem").exists():
                pki.mkdir(parents=True, exist_ok=True)
                self_signed_cert(str(pki))
            cert, key = str(pki / "cert.pem"), str(pki / "key.pem")
            self.az = Azurite(location=str(location), cert=cert, key=key, oauth="basic")
        elif credential == "key":
            self.az = Azurite(location=str(location))
        else:
            raise ValueError(f"unknown credential path {credential!r}")

    def __enter__(self) -> "Target":
        self.az.start()
        if self.credential == "identity":
            trust_in_process(self.az.cert)
            self.endpoint = TokenEndpoint()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.endpoint is not None:
            self.endpoint.stop()
        self.az.stop()

    @property
    def url(self) -> str:
        return self.az.url

    @property
    def cert(self) -> str | None:
        return self.az.cert

    @property
    def connection_string(self) -> str:
        """The account key's connection string: for the bench's own seeding and checks."""
        return self.az.connection_string

    def key_env(self) -> dict[str, str]:
        """For an in-process ``AzureBlobStore`` that seeds the store (account key)."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def sidecar_env(self) -> dict[str, str]:
        """The complete environment of a measured sidecar process on this credential path."""
        if self.credential == "identity":
            env = identity_env(self.az, self.endpoint)
        else:
            env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
            env["AZURE_STORAGE_CONNECTION_STRING"] = self.connection_string
        for k in _TEST_ONLY:
            env.pop(k, None)
        env.update(SIDECAR_LOG_FORMAT="json", SIDECAR_HTTP_ADDR="")
        return env

    def overlay_env(self) -> dict[str, str | None]:
        """:meth:`sidecar_env` as an overlay on ``os.environ`` (None removes), for AgentHost."""
        env: dict[str, str | None] = dict(self.sidecar_env())
        env.update({k: None for k in os.environ if k not in env})
        return env

    @contextlib.asynccontextmanager
    async def service(self) -> AsyncIterator[Any]:
        """``async with t.service() as svc``: a raw async SDK ``BlobServiceClient`` on this path's
        credential, the floors' client.

        ``identity``: ``ManagedIdentityCredential`` (azure-identity, the class the sidecar's chain
        ends in) on the emulated endpoint, bearer tokens over the same TLS."""
        from azure.storage.blob.aio import BlobServiceClient

        if self.credential == "key":
            async with BlobServiceClient.from_connection_string(self.connection_string) as svc:
                yield svc
            return
        from azure.identity.aio import ManagedIdentityCredential

        # The App Service source reads its endpoint from the process environment when it is made.
        os.environ.update(IDENTITY_ENDPOINT=self.endpoint.url, IDENTITY_HEADER=IDENTITY_HEADER)
        try:
            credential = ManagedIdentityCredential(client_id=CLIENT_ID)
        finally:
            os.environ.pop("IDENTITY_ENDPOINT", None)
            os.environ.pop("IDENTITY_HEADER", None)
        async with credential, BlobServiceClient(self.url, credential=credential, connection_verify=self.cert) as svc:
            yield svc

    def rclone_flags(self) -> list[str]:
        """rclone 1.60's MSI support asks only the instance metadata service (169.254.169.254)
        and ignores ``IDENTITY_ENDPOINT``, so it cannot use the emulated identity: on the identity
        path it gets an account SAS over the same TLS endpoint, trusting the test certificate."""
        return ["--ca-cert", self.cert] if self.cert else []


_TRUSTED: set[str] = set()


def trust_in_process(cafile: str) -> None:
    """Let this process's aiohttp sessions (the seeding ``AzureBlobStore``) trust ``cafile``.

    aiohttp builds its default verifying SSL context once, when it is imported, so setting
    ``SSL_CERT_FILE`` now would come too late for this process; the measured processes get it in
    their environment instead."""
    import aiohttp.connector

    if cafile not in _TRUSTED:
        aiohttp.connector._SSL_CONTEXT_VERIFIED.load_verify_locations(cafile=cafile)
        _TRUSTED.add(cafile)
