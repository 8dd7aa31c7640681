"""Azure Blob store specifics: URLs, credentials, errors, redaction, conditional writes, MD5."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import socket
from urllib.parse import quote

import pytest

from sidecar.log import redact
from sidecar.store import make_store
from sidecar.store.azure import AzureBlobStore, parse_store_url
from sidecar.store.base import NotFound, ObjectMeta, StoreError, TransientStoreError
from tests.azurite import DEV_KEY, Azurite, AzuriteUnavailable, azure_store, find_azurite_command, free_port

pytestmark = pytest.mark.anyio

SIG = "s3cr3tS1gnatureVALUE%2Bq%3D"
SAS = f"sv=2022-11-02&ss=b&srt=co&sp=rwdlac&se=2030-01-01T00:00:00Z&sig={SIG}"
FAKE_KEY = base64.b64encode(b"not the real key, but 64 bytes long, like a real one is...!!!!!!").decode()
assert len(FAKE_KEY) == 88 and FAKE_KEY.endswith("==")


def meta(data: bytes, mtime_ns: int, mode: int = 0o600) -> ObjectMeta:
    """The test's stamps order writes: each is the object's version and, for reading, its mtime."""
    return ObjectMeta.of(data, mtime_ns, mode, version=mtime_ns)


def secrets_absent(text: str, *secrets: str) -> bool:
    from urllib.parse import unquote

    return not any(s and (s in text or unquote(s) in text) for s in secrets)


# -- URL parsing ---------------------------------------------------------------------------------

def test_host_style_url():
    loc = parse_store_url("https://myacct.blob.core.windows.net/ckpt")
    assert (loc.account, loc.container, loc.prefix, loc.path_style) == ("myacct", "ckpt", "", False)
    assert loc.endpoint == "https://myacct.blob.core.windows.net"
    loc = parse_store_url("https://myacct.blob.core.windows.net/ckpt/team/a/", "pod-1/x")
    assert (loc.container, loc.prefix) == ("ckpt", "team/a/pod-1/x")
    loc = parse_store_url("https://myacct.privatelink.blob.core.windows.net/ckpt", "/p/")
    assert (loc.account, loc.prefix) == ("myacct", "p")
    assert parse_store_url("https://myacct.blob.core.chinacloudapi.cn/c-1").account == "myacct"


def test_path_style_url():
    loc = parse_store_url("http://127.0.0.1:10000/devstoreaccount1/ckpt/base", "pfx")
    assert (loc.account, loc.container, loc.prefix, loc.path_style) == ("devstoreaccount1", "ckpt", "base/pfx", True)
    assert loc.endpoint == "http://127.0.0.1:10000/devstoreaccount1"
    assert parse_store_url("http://localhost:10000/devstoreaccount1/ckpt").path_style
    assert parse_store_url("http://[::1]:10000/devstoreaccount1/ckpt").endpoint == "http://[::1]:10000/devstoreaccount1"
    # A custom host (a compose service name) is path style when the first segment is the account
    # named by the connection string or AZURE_STORAGE_ACCOUNT.
    loc = parse_store_url("http://azurite:10000/devstoreaccount1/ckpt", known_account="devstoreaccount1")
    assert (loc.account, loc.container, loc.endpoint) == ("devstoreaccount1", "ckpt", "http://azurite:10000/devstoreaccount1")
    # Percent-encoded prefixes are decoded: the prefix is a blob-name prefix, not a URL path.
    assert parse_store_url("http://127.0.0.1:10000/devstoreaccount1/ckpt/my%20dir").prefix == "my dir"


@pytest.mark.parametrize("url, prefix, words", [
    ("ftp://acct.blob.core.windows.net/ckpt", "", "scheme"),
    ("https://acct.blob.core.windows.net", "", "no container"),
    ("https://acct.blob.core.windows.net/", "", "no container"),
    ("http://127.0.0.1:10000/devstoreaccount1", "", "no container"),
    ("http://127.0.0.1:10000/", "", "no account"),
    ("https://acct.blob.core.windows.net/Bad_Name", "", "container name"),
    ("https://acct.blob.core.windows.net/ab", "", "container name"),
    ("https://acct.blob.core.windows.net/a--b", "", "container name"),
    ("http://127.0.0.1:10000/Dev_Account/ckpt", "", "account name"),
    ("https://acct.blob.core.windows.net/ckpt/../x", "", "prefix"),
    ("https://acct.blob.core.windows.net/ckpt", "../up", "SIDECAR_PREFIX"),
    ("https://acct.blob.core.windows.net/ckpt", "a\\b", "SIDECAR_PREFIX"),
    ("https://acct.blob.core.windows.net/ckpt?foo=bar", "", "not a SAS"),
    ("https://acct.blob.core.windows.net/ckpt#frag", "", "fragment"),
    ("https://user:pw@acct.blob.core.windows.net/ckpt", "", "user name"),
    ("https://storage.example.com/ckpt", "", "cannot tell the storage account"),
    ("https://acct.blob.core.windows.net:notaport/ckpt", "", "not a valid URL"),
])
def test_bad_urls_are_clear_value_errors(url, prefix, words):
    with pytest.raises(ValueError) as e:
        azure_store(url, prefix, env={"AZURE_STORAGE_KEY": FAKE_KEY})
    msg = str(e.value)
    assert words in msg and "\n" not in msg
    # no chained exception is shown with it (raised from None, or from no other)
    assert e.value.__cause__ is None and (e.value.__suppress_context__ or e.value.__context__ is None)


def test_bad_url_error_never_echoes_a_sas():
    with pytest.raises(ValueError) as e:
        azure_store(f"https://acct.blob.core.windows.net/Bad_Name?{SAS}", env={})
    assert "container name" in str(e.value) and secrets_absent(str(e.value), SIG)


async def test_description_has_no_secret_and_names_the_place():
    store = azure_store(f"https://acct.blob.core.windows.net/ckpt/base?{SAS}", "pfx", env={})
    try:
        assert store.description == "https://acct.blob.core.windows.net/ckpt/base/pfx"
        assert secrets_absent(repr(store) + store.description, SIG)
    finally:
        await store.aclose()


async def test_make_store_builds_an_azure_store(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    store = make_store("https://acct.blob.core.windows.net/ckpt", "p")
    try:
        assert isinstance(store, AzureBlobStore)
        assert (store.account, store.container_name, store.prefix) == ("acct", "ckpt", "p")
        assert store.credential_source == "account key"
    finally:
        await store.aclose()


# -- credential order ----------------------------------------------------------------------------

CONN = ("DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
        f"AccountKey={DEV_KEY};BlobEndpoint=http://127.0.0.1:10999/devstoreaccount1;")


@pytest.mark.parametrize("env, url_sas, source", [
    ({"AZURE_STORAGE_CONNECTION_STRING": CONN, "AZURE_STORAGE_KEY": FAKE_KEY, "AZURE_STORAGE_SAS_TOKEN": SAS}, True,
     "connection string"),
    ({"AZURE_STORAGE_KEY": FAKE_KEY, "AZURE_STORAGE_SAS_TOKEN": SAS}, True, "account key"),
    ({"AZURE_STORAGE_SAS_TOKEN": "?" + SAS}, False, "SAS token"),
    ({}, True, "SAS token"),
    ({"AZURE_CLIENT_ID": "00000000-0000-0000-0000-000000000001"}, False, "DefaultAzureCredential"),
    ({}, False, "DefaultAzureCredential"),
])
async def test_credential_order(env, url_sas, source):
    from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
    from azure.identity.aio import DefaultAzureCredential

    url = "https://acct.blob.core.windows.net/ckpt/base" + (f"?{SAS}" if url_sas else "")
    store = azure_store(url, "p", env=env)
    try:
        assert store.credential_source == source
        cred = store._creds.credential
        if source == "connection string":
            # The endpoint comes from the connection string; container and prefix from the URL.
            assert store.endpoint == "http://127.0.0.1:10999/devstoreaccount1"
            assert (store.account, store.container_name, store.prefix) == ("devstoreaccount1", "ckpt", "base/p")
            assert isinstance(cred, AzureNamedKeyCredential) and cred.named_key == ("devstoreaccount1", DEV_KEY)
        elif source == "account key":
            assert isinstance(cred, AzureNamedKeyCredential) and cred.named_key.name == "acct"
            assert store.endpoint == "https://acct.blob.core.windows.net"
        elif source == "SAS token":
            assert isinstance(cred, AzureSasCredential) and cred.signature == SAS
        else:
            # Checked by type here; tests/store/test_managed_identity.py gets a real token.
            assert isinstance(cred, DefaultAzureCredential)
        assert secrets_absent(store.description + repr(store), SIG, FAKE_KEY, DEV_KEY)
    finally:
        await store.aclose()


@pytest.mark.parametrize("conn", [
    CONN,
    "UseDevelopmentStorage=true",
    f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={FAKE_KEY};EndpointSuffix=core.chinacloudapi.cn",
    f"AccountName=acct;AccountKey={FAKE_KEY}",
    f"BlobEndpoint=https://acct.blob.core.windows.net;SharedAccessSignature={SAS}",
])
async def test_a_connection_string_names_the_endpoint_and_account_the_sdk_reads_from_it(conn):
    """Ours is read by sidecar.store.azure.credentials (the SDK's parser is private; its public
    route builds a client): both must agree on where the requests go and for which account."""
    from azure.storage.blob.aio import BlobServiceClient

    sdk = BlobServiceClient.from_connection_string(conn)
    store = azure_store("https://acct.blob.core.windows.net/ckpt", env={"AZURE_STORAGE_CONNECTION_STRING": conn})
    try:
        assert store._endpoint_url.rstrip("/") == sdk.primary_endpoint.split("?")[0].rstrip("/")
        assert store.account == sdk.account_name
    finally:
        await store.aclose()
        await sdk.close()


def test_token_credential_needs_https():
    with pytest.raises(ValueError, match="https"):
        azure_store("http://127.0.0.1:10000/devstoreaccount1/ckpt", env={})


def test_bad_credentials_are_value_errors_without_secrets():
    with pytest.raises(ValueError) as e:
        azure_store("https://acct.blob.core.windows.net/ckpt",
                    env={"AZURE_STORAGE_SAS_TOKEN": "sv=2022&se=2030&nosignature=" + SIG})
    assert "SAS" in str(e.value) and secrets_absent(str(e.value), SIG)
    with pytest.raises(ValueError) as e:
        azure_store("https://acct.blob.core.windows.net/ckpt",
                    env={"AZURE_STORAGE_CONNECTION_STRING": f"garbage;AccountKey={FAKE_KEY}"})
    assert "connection string" in str(e.value) and secrets_absent(str(e.value), FAKE_KEY)
    with pytest.raises(ValueError) as e:  # a password in the endpoint URL is refused, never echoed
        azure_store("https://acct.blob.core.windows.net/ckpt", env={
            "AZURE_STORAGE_CONNECTION_STRING": f"AccountName=acct;AccountKey={FAKE_KEY};BlobEndpoint=http://me:pw-s3cret@host:1/acct"})
    assert "user name or password" in str(e.value) and secrets_absent(str(e.value), "pw-s3cret", FAKE_KEY)


# -- redaction -----------------------------------------------------------------------------------

def test_redact_patterns():
    jwt = "eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOiJodHRwczovL3N0b3JhZ2UifQ.c2lnbmF0dXJlLXBhcnQ"
    text = (
        f"conn DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={FAKE_KEY};EndpointSuffix=x "
        f"url https://acct.blob.core.windows.net/c/b?{SAS} "
        f"SharedAccessSignature=sv=2022&sig=abcDEF123 "
        f"Authorization: Bearer {jwt} header SharedKey acct:c2lnbmF0dXJl= "
        f"bare {FAKE_KEY} token={jwt} client_secret=hunter2hunter2"
    )
    out = redact(text)
    for secret in (FAKE_KEY, SIG, "abcDEF123", jwt, "c2lnbmF0dXJl=", "hunter2hunter2"):
        assert secret not in out, secret
    # What is not secret survives, so the message stays useful.
    for keep in ("AccountName=acct", "acct.blob.core.windows.net/c/b", "sv=2022-11-02", "se=2030-01-01",
                 "SharedKey acct:***", "Bearer ***", "AccountKey=***", "sig=***"):
        assert keep in out, keep


def test_redact_known_secrets_in_any_form():
    key = "plain-secret-value/with+chars=="
    out = redact(f"a {key} b {quote(key, safe='')} c", secrets=[quote(key, safe=''), key])
    assert key not in out and quote(key, safe="") not in out and out.startswith("a *** b")
    assert redact("nothing secret here: account 'acct' container 'ckpt'") == \
        "nothing secret here: account 'acct' container 'ckpt'"


# -- error classification (synthetic failures: throttling and DNS cannot be produced here) -------

def _http_error(status: int, code: str):
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError, ResourceNotFoundError

    classes = {401: ClientAuthenticationError, 403: ClientAuthenticationError, 404: ResourceNotFoundError}
    cls = classes.get(status, HttpResponseError)
    err = cls(message=f"{status} {code}")
    err.status_code, err.error_code = status, code
    return err


def _unreachable(cause: BaseException):
    from azure.core.exceptions import ServiceRequestError

    return ServiceRequestError("request failed", error=cause)


def _credential_failure():
    from azure.core.exceptions import ClientAuthenticationError

    return ClientAuthenticationError(
        "DefaultAzureCredential failed to retrieve a token from the included credentials.\nAttempted credentials:\n"
        "\tEnvironmentCredential: EnvironmentCredential authentication unavailable.\n"
        "\tManagedIdentityCredential: App Service managed identity endpoint answered 500")


@pytest.mark.parametrize("make_error, opened, transient, words", [
    (lambda: _http_error(429, "TooManyRequests"), True, True, "throttled"),
    (lambda: _http_error(503, "ServerBusy"), True, True, "throttled"),
    (lambda: _http_error(500, "InternalError"), True, True, "service error"),
    (lambda: _http_error(403, "AuthenticationFailed"), True, False, "authentication failed"),
    (lambda: _http_error(403, "AuthorizationPermissionMismatch"), True, False, "Storage Blob Data Contributor"),
    (lambda: _http_error(404, "ContainerNotFound"), True, False, "container does not exist"),
    (lambda: _http_error(400, "Md5Mismatch"), True, True, "corrupted in transit"),
    (lambda: _http_error(400, "InvalidHeaderValue"), True, False, "InvalidHeaderValue"),
    (_credential_failure, True, False, "no usable Azure credential via DefaultAzureCredential (ManagedIdentityCredential: "),
    (lambda: _unreachable(socket.gaierror(-2, "Name or service not known")), False, False, "cannot resolve"),
    (lambda: _unreachable(socket.gaierror(-2, "Name or service not known")), True, True, "cannot resolve"),
    (lambda: _unreachable(ConnectionRefusedError(111, "Connection refused")), False, False, "connection refused"),
    (lambda: _unreachable(ConnectionRefusedError(111, "Connection refused")), True, True, "connection refused"),
    (lambda: _unreachable(TimeoutError("no data within the read timeout")), True, True, "timed out"),
    (lambda: _unreachable(__import__("ssl").SSLCertVerificationError("bad cert")), True, False, "TLS"),
])
async def test_error_classification(make_error, opened, transient, words):
    store = azure_store("https://acct.blob.core.windows.net/ckpt",
                        env={"AZURE_CLIENT_ID": "x"})
    try:
        store._opened = opened
        err = store._error(make_error(), "uploading 'k'")
        assert isinstance(err, StoreError)
        assert isinstance(err, TransientStoreError) is transient
        msg = str(err)
        assert words in msg and "\n" not in msg
        assert "'acct'" in msg and "'ckpt'" in msg
    finally:
        await store.aclose()


def _chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize("make, kind", [  # what aiohttp and asyncio raise, as the SDK wraps them
    (lambda: _unreachable(OSError("connection closed")), "failed"),
    (lambda: _unreachable(socket.gaierror(-2, "Name or service not known")), "dns"),
    (lambda: _unreachable(_chained(OSError("wrapped"), ConnectionRefusedError(111, "Connection refused"))), "refused"),
    (lambda: _unreachable(TimeoutError()), "timeout"),
    (lambda: _unreachable(_chained(OSError("wrapped"), __import__("ssl").SSLCertVerificationError("bad cert"))), "tls"),
    (lambda: _unreachable(__import__("aiohttp").ClientHttpProxyError(None, (), status=407)), "proxy"),
])
def test_connection_failures_are_told_apart(make, kind):
    from sidecar.store.azure.errors import failure_kind

    assert failure_kind(make())[0] == kind


def test_retry_backoff_is_exponential_with_jitter_and_honours_retry_after():
    from types import SimpleNamespace

    from sidecar.store.azure.retry import RETRY_AFTER_MAX, Retry

    policy = Retry(0.5, 4)
    for n, nominal in ((1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (10, 30.0)):
        waits = {policy.get_backoff_time({"count": n, "history": []}) for _ in range(50)}
        assert all(nominal * 0.5 <= w <= nominal * 1.5 for w in waits), (n, waits)
        assert len(waits) > 1  # jittered

    def after(headers: dict[str, str]) -> float:
        answered = SimpleNamespace(http_response=SimpleNamespace(headers=headers))
        return policy.get_backoff_time({"count": 1, "history": [answered]})

    assert after({"retry-after": "3"}) == 3.0
    assert after({"retry-after-ms": "250"}) == 0.25
    assert after({"retry-after": "3600"}) == RETRY_AFTER_MAX
    assert 0.25 <= after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) <= 0.75  # a date: the schedule


async def test_credential_failure_is_one_clear_line_and_not_retried():
    from azure.core.exceptions import ClientAuthenticationError

    class NoIdentity:
        calls = 0

        async def get_token(self, *scopes, **kwargs):
            NoIdentity.calls += 1
            raise ClientAuthenticationError("DefaultAzureCredential failed to retrieve a token from the included "
                                            "credentials.\nAttempted credentials:\n\tManagedIdentityCredential: no endpoint")

        async def close(self):
            pass

    store = azure_store("https://acct.blob.core.windows.net/ckpt", env={"AZURE_CLIENT_ID": "x"},
                        retry_backoff=5.0)  # a retry would make this test take seconds
    await store._creds.credential.close()
    store._creds.credential = NoIdentity()
    try:
        with pytest.raises(StoreError) as e:
            await store.open()
        assert not isinstance(e.value, TransientStoreError)
        assert "no usable Azure credential" in str(e.value) and "\n" not in str(e.value)
        assert "ManagedIdentityCredential: no endpoint" in str(e.value)
        assert NoIdentity.calls == 1  # the credential retries itself; the store does not again
    finally:
        await store.aclose()


# -- against Azurite -----------------------------------------------------------------------------

@pytest.mark.azure
async def test_missing_container_is_created(azure_stores):
    async with azure_stores.raw() as svc:
        container = svc.get_container_client(azure_stores.container)
        assert not await container.exists()
        store = await azure_stores("p")
        assert await container.exists()
        await store.open()  # opening again (container present) is fine
        again = await azure_stores("p")  # and so is a second store object on it
        assert [i async for i in again.list()] == []


@pytest.mark.azure
async def test_wrong_account_key_is_one_clear_permanent_line(azure_stores, azurite):
    bad = base64.b64encode(os.urandom(64)).decode()
    store = await azure_stores("p", env={"AZURE_STORAGE_KEY": bad}, url=azure_stores.url, open=False)
    with pytest.raises(StoreError) as e:
        await store.open()
    err = e.value
    assert not isinstance(err, TransientStoreError)  # exit-worthy: retrying will not fix it
    msg = str(err)
    assert "\n" not in msg
    assert azurite.account in msg and azure_stores.container in msg and "AZURE_STORAGE_KEY" in msg
    assert secrets_absent(msg, bad, quote(bad, safe=""), DEV_KEY)
    assert err.__cause__ is None and err.__suppress_context__


@pytest.mark.azure
async def test_wrong_key_in_connection_string(azure_stores, azurite):
    bad = base64.b64encode(os.urandom(64)).decode()
    conn = azurite.connection_string.replace(azurite.key, bad)
    store = await azure_stores(env={"AZURE_STORAGE_CONNECTION_STRING": conn}, open=False)
    with pytest.raises(StoreError) as e:
        await store.open()
    assert not isinstance(e.value, TransientStoreError)
    assert "AZURE_STORAGE_CONNECTION_STRING" in str(e.value)
    assert secrets_absent(str(e.value), bad)


async def test_unreachable_endpoint_at_open_is_permanent():
    # Decision: connection refused (or DNS failure) before the store was ever reached is a
    # configuration error -> StoreError, exit-worthy. The same failure after a successful
    # open() is an outage -> TransientStoreError (see test_outage_after_open_is_transient).
    port = free_port()  # nothing listens there
    store = azure_store(f"http://127.0.0.1:{port}/devstoreaccount1/ckpt", env={"AZURE_STORAGE_KEY": FAKE_KEY},
                        retry_total=1, retry_backoff=0.05)
    try:
        with pytest.raises(StoreError) as e:
            await store.open()
        assert not isinstance(e.value, TransientStoreError)
        msg = str(e.value)
        assert "connection refused" in msg and f"127.0.0.1:{port}" in msg
        assert "devstoreaccount1" in msg and "ckpt" in msg and "\n" not in msg
        assert secrets_absent(msg, FAKE_KEY)
    finally:
        await store.aclose()


@pytest.mark.azure
async def test_an_untrusted_certificate_is_one_permanent_tls_line_not_retried(tls_azurite):
    """This process does not trust the TLS Azurite's self-signed certificate."""
    counter = RequestCounter()
    store = azure_store(f"{tls_azurite.url}/ckpt", env={"AZURE_STORAGE_KEY": DEV_KEY},
                        retry_backoff=5.0, request_hook=counter)  # a retry would take seconds
    try:
        with pytest.raises(StoreError) as e:
            await store.open()
    finally:
        await store.aclose()
    assert not isinstance(e.value, TransientStoreError)
    msg = str(e.value)
    assert "TLS failure" in msg and "SSL_CERT_FILE" in msg and "'devstoreaccount1'" in msg and "\n" not in msg
    assert len(counter.requests) == 1


@pytest.mark.azure
@pytest.mark.faults
async def test_outage_after_open_is_transient(tmp_path):
    try:
        find_azurite_command()
    except AzuriteUnavailable as e:
        pytest.skip(str(e))
    server = Azurite(str(tmp_path / "azurite")).start()
    store = None
    try:
        store = azure_store(server.url + "/outage", env={"AZURE_STORAGE_CONNECTION_STRING": server.connection_string},
                            retry_total=1, retry_backoff=0.05)
        await store.open()
        await store.put("k", b"before", meta(b"before", 1))
        server.stop()
        for op in (lambda: store.put("k", b"during", meta(b"during", 2)), lambda: store.get("k")):
            with pytest.raises(TransientStoreError) as e:
                await op()
            assert "connection refused" in str(e.value) and "will retry" in str(e.value)
        server.start()  # same port and location: the data survived
        assert (await store.get("k"))[0] == b"before"
        assert (await store.put("k", b"after", meta(b"after", 3))).mtime_ns == 3
    finally:
        if store is not None:
            await store.aclose()
        server.stop()


@pytest.mark.azure
async def test_content_md5_and_metadata_on_uploaded_blobs(azure_stores):
    small = await azure_stores("md5")
    blocky = await azure_stores("md5", concurrency=3)
    one = b"checkpoint bytes" * 100
    many = os.urandom(20 * 1024 * 1024 + 123)  # one Put Blob (up to 5,000 MiB since API 2019-12-12)
    await small.put("r/one", one, meta(one, 11, 0o640))
    await blocky.put("r/many", many, meta(many, 12, 0o600))
    async with azure_stores.raw() as svc:
        container = svc.get_container_client(azure_stores.container)
        for name, data, mtime, mode in (("md5/r/one", one, 11, "640"), ("md5/r/many", many, 12, "600")):
            props = await container.get_blob_client(name).get_blob_properties()
            assert props.content_settings.content_md5 == hashlib.md5(data).digest(), name
            assert props.metadata == {"sidecar_sha256": hashlib.sha256(data).hexdigest(),
                                      "sidecar_mtime_ns": str(mtime), "sidecar_mode": mode,
                                      "sidecar_version": str(mtime)}
            assert props.blob_type == "BlockBlob" and props.size == len(data)
    assert (await small.get("r/many"))[0] == many


@pytest.mark.azure
async def test_service_checks_the_content_md5(azure_stores):
    store = await azure_stores("corrupt")
    data = b"the bytes we meant to send"
    wrong = hashlib.md5(b"something else").digest()
    from azure.core.exceptions import HttpResponseError

    from sidecar.store.azure.errors import error_code as _code

    with pytest.raises(HttpResponseError) as e:
        await store._put_blob("corrupt/r/k", data, wrong, {}, None)
    # Azure answers 400 Md5Mismatch (classified transient, see test_error_classification);
    # Azurite answers 400 InvalidOperation. Either way nothing was stored.
    assert e.value.status_code == 400 and _code(e.value) in ("Md5Mismatch", "InvalidOperation")
    with pytest.raises(NotFound):
        await store.get("r/k")


@pytest.mark.azure
async def test_foreign_blob_without_metadata(azure_stores):
    store = await azure_stores("f")
    async with azure_stores.raw() as svc:
        await svc.get_container_client(azure_stores.container).upload_blob("f/r/foreign", b"abc")
    [info] = [i async for i in store.list()]
    assert info.key == "r/foreign" and info.sha256 is None and info.size == 3 and info.etag
    data, ginfo = await store.get("r/foreign")
    assert data == b"abc" and ginfo.sha256 is None
    # Our upload replaces it (a blob without our stamp counts as oldest).
    new = await azure_stores("f")
    assert (await new.put("r/foreign", b"ours", meta(b"ours", 5))).mtime_ns == 5
    assert (await store.get("r/foreign"))[1].sha256 == hashlib.sha256(b"ours").hexdigest()


class RequestCounter:
    def __init__(self) -> None:
        self.requests: list[str] = []

    def __call__(self, method: str, path: str) -> None:
        self.requests.append(f"{method} {path.rsplit('/', 1)[-1]}")


@pytest.mark.azure
async def test_steady_state_costs_one_request(azure_stores):
    """A caller that passes what it last saw (``expected``: StoreState's job) pays one request
    per write; the store itself remembers nothing."""
    counter = RequestCounter()
    store = await azure_stores("steady", request_hook=counter)
    for i in range(3):
        await store.put(f"r/f{i}", b"x", meta(b"x", 1))
    counter.requests.clear()
    infos = {i.key: i async for i in store.list()}  # one paged pass, metadata included, no HEADs
    assert len(infos) == 3 and all(i.sha256 for i in infos.values())
    assert counter.requests == [f"GET {azure_stores.container}"]
    counter.requests.clear()
    for i in range(3):  # updates of known blobs: one conditional PUT each
        infos[f"r/f{i}"] = await store.put(f"r/f{i}", b"y", meta(b"y", 2), expected=infos[f"r/f{i}"])
    await store.put("r/new", b"n", meta(b"n", 2))  # a new blob: one PUT (If-None-Match: *)
    assert counter.requests == ["PUT f0", "PUT f1", "PUT f2", "PUT new"]
    counter.requests.clear()
    # A blob changed behind our back: one failed PUT, one HEAD, one PUT.
    other = await azure_stores("steady")
    await other.put("r/f0", b"z", meta(b"z", 3))
    await store.put("r/f0", b"w", meta(b"w", 4), expected=infos["r/f0"])
    assert counter.requests == ["PUT f0", "HEAD f0", "PUT f0"]
    assert (await other.get("r/f0"))[0] == b"w"
    counter.requests.clear()
    # Nothing expected of a blob that is there: the same three (the absence it assumed was wrong).
    await store.put("r/f1", b"v", meta(b"v", 5))
    assert counter.requests == ["PUT f1", "HEAD f1", "PUT f1"]


@pytest.mark.azure
async def test_an_expected_newer_version_is_checked_with_one_read_and_nothing_written(azure_stores):
    """``expected`` settles nothing by itself: a stored version it says is newer is read once
    (a HEAD, no write) and decides; a swap against an object not known reads first too."""
    counter = RequestCounter()
    store = await azure_stores("newer", request_hook=counter)
    newer = await store.put("r/k", b"new", meta(b"new", 10))
    counter.requests.clear()
    info = await store.put("r/k", b"old", meta(b"old", 5), expected=newer)
    assert info.version == 10 and counter.requests == ["HEAD k"]
    assert (await store.get("r/k"))[0] == b"new"
    counter.requests.clear()
    taken = await store.put("r/k", b"swap", meta(b"swap", 11), if_version=10)
    assert taken.version == 11 and counter.requests == ["HEAD k", "PUT k"]


@pytest.mark.azure
async def test_start_up_lists_once_and_never_serves_a_listing_older_than_our_writes(azure_stores):
    """open() checks the container with the listing's first page, which the next list() uses
    instead of asking again; any write of ours in between makes list() ask again."""
    seed = await azure_stores("p")
    for i in range(3):
        await seed.put(f"r/f{i}", b"x", meta(b"x", 1))
    counter = RequestCounter()
    store = await azure_stores("p", request_hook=counter)  # opened
    assert [i.key async for i in store.list()] == ["r/f0", "r/f1", "r/f2"]
    assert counter.requests == [f"GET {azure_stores.container}"]  # the open; list() asked nothing
    assert len([i async for i in store.list()]) == 3 and len(counter.requests) == 2  # later lists ask

    fresh = await azure_stores("p", request_hook=counter)
    await fresh.put("r/new", b"n", meta(b"n", 2))
    await fresh.delete("r/f0")
    assert [i.key async for i in fresh.list()] == ["r/f1", "r/f2", "r/new"]
    assert [i.key async for i in fresh.list("r/f")] == ["r/f1", "r/f2"]  # a prefix is its own listing


@pytest.mark.azure
async def test_blob_deleted_behind_our_back_is_written_again(azure_stores):
    store = await azure_stores("del")
    other = await azure_stores("del")
    await store.put("r/k", b"1", meta(b"1", 1))
    await other.delete("r/k")
    assert (await store.put("r/k", b"2", meta(b"2", 2))).mtime_ns == 2
    assert (await other.get("r/k"))[0] == b"2"
    with pytest.raises(NotFound):
        await other.get("r/gone")


# -- the race: the newer version always wins ------------------------------------------------------

OLD, NEW = b"older version" * 50, b"newer version" * 60
OLD_META, NEW_META = meta(OLD, 1_000), meta(NEW, 2_000)


async def _assert_newer_won(store: AzureBlobStore, key: str) -> None:
    data, info = await store.get(key)
    assert data == NEW and info.mtime_ns == NEW_META.mtime_ns and info.sha256 == NEW_META.sha256, key


@pytest.mark.azure
async def test_race_newer_always_wins(azure_stores):
    counter = RequestCounter()
    a = await azure_stores("race", request_hook=counter)
    b = await azure_stores("race", request_hook=counter)

    # 1. Sequential, both orders, same store object and two store objects.
    for first, second, tag in ((a, a, "aa"), (a, b, "ab"), (b, a, "ba")):
        for order in ("old-new", "new-old"):
            key = f"seq/{tag}/{order}"
            steps = [(OLD, OLD_META), (NEW, NEW_META)]
            if order == "new-old":
                steps.reverse()
            r1 = await first.put(key, *steps[0])
            r2 = await second.put(key, *steps[1])
            assert r1.mtime_ns == steps[0][1].mtime_ns
            assert r2.mtime_ns == NEW_META.mtime_ns  # the stale one reports the newer, stored one
            await _assert_newer_won(a, key)

    # 2. Both stores hold a stale ETag for an existing blob, then write in either order.
    for order in ("old-first", "new-first"):
        key = f"stale/{order}"
        await a.put(key, b"v0", meta(b"v0", 500))
        assert [i.key async for i in b.list(key)] == [key]  # b caches the same ETag as a
        if order == "old-first":
            await a.put(key, OLD, OLD_META)
            assert (await b.put(key, NEW, NEW_META)).mtime_ns == NEW_META.mtime_ns
        else:
            await b.put(key, NEW, NEW_META)
            assert (await a.put(key, OLD, OLD_META)).mtime_ns == NEW_META.mtime_ns
        await _assert_newer_won(a, key)

    # 3. Truly concurrent uploads, from two store objects and from one, in both start orders,
    #    on fresh keys (both believe it absent) and on existing keys (both hold an ETag).
    rounds = 8
    counter.requests.clear()
    for i in range(rounds):
        for existing in (False, True):
            for tag, (s_old, s_new) in (("two", (a, b)), ("two-rev", (b, a)), ("one", (a, a))):
                key = f"conc/{existing}/{tag}/{i}"
                if existing:
                    await a.put(key, b"v0", meta(b"v0", 1))
                    [_ async for _ in b.list(key)]
                jobs = [s_old.put(key, OLD, OLD_META), s_new.put(key, NEW, NEW_META)]
                if i % 2:
                    jobs.reverse()
                await asyncio.gather(*jobs)
                await _assert_newer_won(a, key)
                await _assert_newer_won(b, key)
    # The conditional path really ran: writers collided and read the blob to decide.
    assert any(r.startswith("HEAD") for r in counter.requests)


@pytest.mark.azure
async def test_zero_byte_blob_and_odd_names_round_trip_with_the_sdk(azure_stores):
    """Objects the store writes are what the SDK reads, and the other way round."""
    store = await azure_stores("interop")
    names = ["r/empty", "r/sp ace/ü.json", "r/semi;colon,comma=eq+plus&amp", "r/%41literal-percent", "r/~tilde'q"]
    for i, name in enumerate(names):
        data = b"" if name == "r/empty" else name.encode() * 3
        await store.put(name, data, meta(data, 10 + i))
    async with azure_stores.raw() as svc:
        container = svc.get_container_client(azure_stores.container)
        listed = sorted([b.name async for b in container.list_blobs(name_starts_with="interop/")])
        assert listed == sorted(f"interop/{n}" for n in names)
        for name in names:
            body = await (await container.download_blob(f"interop/{name}")).readall()
            assert body == (b"" if name == "r/empty" else name.encode() * 3)
        await container.upload_blob("interop/r/from sdk é", b"sdk", metadata={"other": "x"})
    assert sorted([i.key async for i in store.list()]) == sorted(names + ["r/from sdk é"])
    data, info = await store.get("r/from sdk é")
    assert data == b"sdk" and info.sha256 is None
    await store.delete("r/sp ace/ü.json")
    with pytest.raises(NotFound):
        await store.get("r/sp ace/ü.json")


@pytest.mark.azure
async def test_the_small_first_page_is_only_open_s_and_the_listing_goes_on_after_it(azure_stores, monkeypatch):
    """open() asks for a small first page (a restore downloads from it while the rest comes);
    list() follows its NextMarker with full pages, and any later listing asks for full pages."""
    from sidecar.store.azure import store as azure_store

    monkeypatch.setattr(azure_store, "FIRST_PAGE_RESULTS", 5)
    seed = await azure_stores("pages")
    keys = sorted(f"r/f{i:02d}" for i in range(12))
    for k in keys:
        await seed.put(k, b"x", meta(b"x", 1))
    counter = RequestCounter()
    store = await azure_stores("pages", request_hook=counter)  # opened: the first 5
    assert [i.key async for i in store.list()] == keys
    assert len(counter.requests) == 2  # open()'s page of 5, then one page with the other 7
    counter.requests.clear()
    assert [i.key async for i in store.list()] == keys
    assert len(counter.requests) == 1  # a full page


@pytest.mark.parametrize("url", ["https://acct.blob.core.windows.net/ckpt/.checkpoints",
                                 "https://acct.blob.core.windows.net/ckpt/team/.sidecar",
                                 "https://acct.blob.core.windows.net/ckpt/a//b"])
def test_a_url_prefix_never_names_a_root_or_the_sidecars_own(url):
    from sidecar.store.azure import parse_store_url

    with pytest.raises(ValueError, match="bad"):
        parse_store_url(url)


# -- a dead upload's uncommitted blocks -----------------------------------------------------------

async def _leave_uncommitted_blocks(azure_stores, name: str, block_ids: list[str]) -> None:
    """What a sidecar killed in the middle of a streamed upload leaves: staged blocks, no commit."""
    async with azure_stores.raw() as svc:
        blob = svc.get_container_client(azure_stores.container).get_blob_client(name)
        for block_id in block_ids:
            await blob.stage_block(block_id, os.urandom(1024))
        props = await blob.get_block_list("uncommitted")
        assert len(props[1]) == len(block_ids)  # staged, not committed: the blob does not exist
        assert not await blob.exists()


def _sdk_block_id() -> str:
    """The shape of the block ids ``upload_blob`` stages (as a crashed streamed put left them)."""
    import uuid

    return base64.b64encode(f"{uuid.uuid4().int:048d}".encode()).decode()


@pytest.mark.azure
@pytest.mark.parametrize("ids", [
    pytest.param([_sdk_block_id(), _sdk_block_id()], id="sdk-ids"),
    pytest.param([base64.b64encode(os.urandom(9)).decode()], id="short-ids"),  # another writer's length
])
@pytest.mark.parametrize("size", [0, 1000, 5 * 1024 * 1024])  # Put Blob sizes (up to MAX_SINGLE_PUT_SIZE)
async def test_a_small_put_succeeds_over_a_dead_uploads_uncommitted_blocks(azure_stores, ids, size):
    """Azurite answers Put Blob with If-None-Match: * on a blob that holds only uncommitted
    blocks with 409 BlobAlreadyExists, though no blob exists (Get Blob Properties: 404). The put
    then commits its bytes as staged blocks (Put Block List honours the condition), and the dead
    upload's blocks are gone with that commit."""
    store = await azure_stores("dead")
    await _leave_uncommitted_blocks(azure_stores, "dead/r/k", ids)
    data = os.urandom(size)
    info = await store.put("r/k", data, meta(data, 7, 0o640))
    assert info.version == 7 and info.etag
    got, ginfo = await (await azure_stores("dead")).get("r/k")
    assert got == data and ginfo.sha256 == hashlib.sha256(data).hexdigest() and ginfo.mode == 0o640
    async with azure_stores.raw() as svc:
        blob = svc.get_container_client(azure_stores.container).get_blob_client("dead/r/k")
        props = await blob.get_blob_properties()
        assert props.content_settings.content_md5 == hashlib.md5(data).digest()
        assert props.metadata["sidecar_version"] == "7"
        committed, uncommitted = await blob.get_block_list("all")
        assert uncommitted == []  # the dead upload's blocks went with the commit
    # and the next write of the key is the usual one conditional Put Blob
    again = b"next"
    assert (await store.put("r/k", again, meta(again, 8))).version == 8
    assert (await store.get("r/k"))[0] == again



async def test_a_blob_rewritten_while_streamed_ahead_fails_the_read_never_mixes_bytes(azure_stores):
    """The ranges fetched ahead are pinned to the first answer's ETag: a rewrite in between is a
    failed read (to retry), never the old blob's start joined to the new one's end."""
    from sidecar.store.base import CHUNK_BYTES

    store = await azure_stores()
    old, new = os.urandom(CHUNK_BYTES * 3), os.urandom(CHUNK_BYTES * 3)
    await store.put("r/big.bin", old, ObjectMeta.of(old, 1, 0o600))
    async with await store.get_stream("r/big.bin", 1) as (_, chunks):
        got = [await chunks.__anext__()]  # one range is in flight now, the last one not yet asked for
        async with azure_stores.raw() as svc:
            await svc.get_blob_client(azure_stores.container, "r/big.bin").upload_blob(new, overwrite=True)
        with pytest.raises(StoreError):
            async for c in chunks:
                got.append(c)
    assert b"".join(got) == old[: len(b"".join(got))]
