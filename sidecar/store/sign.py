"""Signing Blob service requests without an event loop: Shared Key and SAS, the headers every
request carries, and the request target. :mod:`sidecar.store.blobapi` sends what this signs; the
first listing that :mod:`sidecar.store.early` asks for while Python is still importing is signed
here too, so both are the same request.

Shared Key follows "Authorize with Shared Key" in the Blob service REST reference (string to sign
for version 2015-02-21 and later), exactly as the SDK's ``SharedKeyCredentialPolicy`` builds it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from email.utils import formatdate
from typing import Sequence
from urllib.parse import quote, unquote

#: The REST API version every request asks for (supported by Azure and by Azurite 3.35).
API_VERSION = "2021-12-02"


def standard_headers(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with the version and date every request carries."""
    headers["x-ms-version"] = API_VERSION
    headers["x-ms-date"] = formatdate(usegmt=True)
    return headers


def request_target(path: str, query: Sequence[tuple[str, str]]) -> str:
    """``path?k=v&...`` with each value percent-encoded (``path`` is encoded already)."""
    return path + ("?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query) if query else "")


class SharedKey:
    """``Authorization: SharedKey <account>:<HMAC-SHA256 of the canonical request>``."""

    def __init__(self, account: str, key: str) -> None:
        try:
            self._key = base64.b64decode(key, validate=True)
        except ValueError:
            raise ValueError("the account key is not valid base64") from None
        self.account = account

    def string_to_sign(self, method: str, path: str, query: Sequence[tuple[str, str]], headers: dict[str, str]) -> str:
        h = {k.lower(): v for k, v in headers.items()}
        length = h.get("content-length", "")
        standard = [method, h.get("content-encoding", ""), h.get("content-language", ""),
                    "" if length == "0" else length, h.get("content-md5", ""), h.get("content-type", ""),
                    h.get("date", ""), h.get("if-modified-since", ""), h.get("if-match", ""),
                    h.get("if-none-match", ""), h.get("if-unmodified-since", ""), h.get("range", "")]
        canonical_headers = "".join(f"{k}:{h[k]}\n" for k in sorted(h) if k.startswith("x-ms-"))
        # Query values here are the decoded values (they are percent-encoded only on the wire).
        resource = f"/{self.account}{path}" + "".join(f"\n{k}:{v}" for k, v in sorted((k.lower(), v) for k, v in query))
        return "\n".join(standard) + "\n" + canonical_headers + resource

    def signature(self, text: str) -> str:
        return base64.b64encode(hmac.new(self._key, text.encode("utf-8"), hashlib.sha256).digest()).decode()

    def sign(self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str]) -> None:
        sig = self.signature(self.string_to_sign(method, path, query, headers))
        headers["Authorization"] = f"SharedKey {self.account}:{sig}"

    async def apply(self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str]) -> None:
        self.sign(method, path, query, headers)


class SasToken:
    """A shared access signature, sent as the query of every request."""

    def __init__(self, token: str) -> None:
        self.items = [(k, unquote(v)) for k, _, v in (p.partition("=") for p in token.lstrip("?").split("&") if p)]

    def sign(self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str]) -> None:
        query.extend(self.items)

    async def apply(self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str]) -> None:
        self.sign(method, path, query, headers)
