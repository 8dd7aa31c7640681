"""How an Azure Blob request is retried: the SDK's storage retry policy on a schedule of ours.

Reads the SDK's internals (``ExponentialRetry``'s settings dict, its ``increment`` and
``get_backoff_time`` hooks): ``pyproject.toml`` pins ``azure-storage-blob`` below 13 for that.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from azure.core.exceptions import AzureError, ClientAuthenticationError
from azure.storage.blob.aio import ExponentialRetry

from sidecar.store.azure.errors import failure_kind

#: The longest ``Retry-After`` a retry waits for; a longer one is the sidecar's own retry's business.
RETRY_AFTER_MAX = 30.0


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds the service asked to wait (``Retry-After``, or its millisecond forms), if any."""
    for name, scale in (("retry-after-ms", 0.001), ("x-ms-retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return max(float(value) * scale, 0.0)
            except ValueError:
                continue  # an HTTP date: the exponential schedule applies
    return None


class Retry(ExponentialRetry):
    """The SDK's storage retry policy (it retries connection errors, timeouts, 408 and 5xx;
    not 429, which the sidecar's own retry takes) with this schedule: the ``Retry-After`` of
    the failed answer when it has one (at most :data:`RETRY_AFTER_MAX`), else ``base * 2**(n-1)``
    seconds jittered by +-50 % and capped at 30 s; with 0.5 s and 4 retries a request gives up
    after about 7.5 s. Not retried: TLS failures, a proxy refusing the tunnel (401/403/407) and a
    credential that could not get a token (azure-identity retries its own requests).
    """

    def __init__(self, base: float, retry_total: int) -> None:
        super().__init__(initial_backoff=0, increment_base=2, retry_total=retry_total, random_jitter_range=0,
                         retry_connect=retry_total, retry_read=retry_total, retry_status=retry_total)
        self.base = base

    def get_backoff_time(self, settings: dict[str, Any]) -> float:
        history = settings.get("history") or []
        response = getattr(history[-1], "http_response", None) if history else None
        after = _retry_after(response.headers) if response is not None else None
        if after is not None:
            return min(after, RETRY_AFTER_MAX)
        nominal = min(self.base * 2 ** max(settings["count"] - 1, 0), 30.0)
        return random.uniform(nominal * 0.5, nominal * 1.5)

    def increment(self, settings: dict[str, Any], request: Any, response: Any = None,
                  error: AzureError | None = None) -> bool:
        if isinstance(error, ClientAuthenticationError):
            return False  # the credential could not get a token: it has retried on its own
        if error is not None:
            kind, status = failure_kind(error)
            if kind == "tls" or (kind == "proxy" and status in (401, 403, 407)):
                return False
        return super().increment(settings, request, response=response, error=error)
