"""The first listing, asked for while Python is still importing.

Every start (``restore``, ``sync``, ``run``) of an Azure store begins with one List Blobs request:
:meth:`AzureBlobStore.open` checks the container with the listing's first page. The emulator
takes 75-110 ms to build that page for 1,000 blobs. Against Azure the page costs a TLS handshake
and a round trip. Either way the sidecar would otherwise spend that time idle, after about
100 ms of importing the event loop and the rest of itself.

So the command line calls :func:`start` as soon as the configuration is valid. :func:`start`
sends exactly that request from a thread, using the standard library's blocking ``http.client``:
the same location and credential rules (:mod:`.azure_location`), the same signing
(:mod:`.sign`), the same query. :meth:`AzureBlobStore.open` then calls :func:`take`.

The page is used only when all of these hold:
* it answered ``200``;
* it is for the same endpoint, container and prefix;
* it arrived within :data:`WAIT`.

Anything else (an error status, a connection failure, a different store, a credential that needs
an Azure AD token) is dropped without a word, and ``open()`` sends its request as it always did,
so errors are still reported and retried by the one path that reports and retries them.
Nothing here logs; secrets stay in the request headers.
"""

from __future__ import annotations

import threading
from typing import Mapping

from sidecar.store.azure_location import endpoint_of, list_query, resolve
from sidecar.store.sign import request_target, standard_headers

#: How long ``open()`` waits for a request still under way before sending its own.
WAIT = 3.0
#: Connect and read timeout of the early request.
TIMEOUT = 10.0


class _Page:
    def __init__(self, key: tuple[str, str, str]) -> None:
        self.key = key  # (scheme://host:port, container path, name prefix)
        self.body: bytes | None = None
        self.done = threading.Event()


_pending: _Page | None = None


def start(url: str, prefix: str = "", env: Mapping[str, str] | None = None) -> None:
    """Ask for the first listing page of the Azure store ``url`` in a thread, if a key or SAS
    signs it (an Azure AD token needs the event loop: nothing is started then)."""
    global _pending
    try:
        location, credentials = resolve(url, prefix, env, allow_token=False)
    except ValueError:
        return  # the store reports it, the usual way
    if credentials is None:
        return
    base_url, base_path = endpoint_of(location, credentials)
    container_path = f"{base_path}/{location.container}"
    name_prefix = f"{location.prefix}/" if location.prefix else ""
    query = list_query(name_prefix)
    headers = standard_headers({})
    credentials.auth.sign("GET", container_path, query, headers)
    page = _Page((base_url, container_path, name_prefix))
    _pending = page
    threading.Thread(target=_fetch, args=(page, base_url, request_target(container_path, query), headers),
                     name="first-listing", daemon=True).start()


def _fetch(page: _Page, base_url: str, target: str, headers: dict[str, str]) -> None:
    try:
        import http.client

        scheme, _, netloc = base_url.partition("://")
        if scheme == "https":
            import ssl

            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                netloc, timeout=TIMEOUT, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(netloc, timeout=TIMEOUT)
        try:
            conn.request("GET", target, headers=headers)
            response = conn.getresponse()
            body = response.read()
            if response.status == 200:
                page.body = body
        finally:
            conn.close()
    except Exception:  # dropped: open() asks again and reports whatever is wrong
        pass
    finally:
        page.done.set()


def take(key: tuple[str, str, str]) -> _Page | None:
    """The early page for ``key``, at most once per process; ``None`` when there is none (or it is
    for another store). The caller waits on ``page.done`` (at most :data:`WAIT`) and uses
    ``page.body`` if it is set."""
    global _pending
    page, _pending = _pending, None
    return page if page is not None and page.key == key else None
