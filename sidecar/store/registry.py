"""Which backend a ``SIDECAR_STORE`` value names: the URL's scheme picks one of :data:`BACKENDS`,
whose module parses the rest, once (:func:`parse_store`), and builds the store from what it parsed
(:func:`make_store`).

A backend is one module beside this one, with two functions, and one line in :data:`BACKENDS`::

    parse_url(url: str, env: Mapping[str, str]) -> Location
        the URL check, run with the configuration: ValueError, one line that never shows a secret
        of the URL (a SAS token), when the URL cannot name a store of this kind
    make(location, prefix: str, *, create: bool, concurrency: int, env: Mapping[str, str],
         writes: bool | None = None) -> Store
        the store at ``location`` with ``prefix`` below it, not yet opened (nothing sent yet);
        ``create=False``: opening it creates nothing; ``writes=False`` (default: ``create``): the
        caller only reads, so nothing is written, not even to read the store's clock;
        ``concurrency``: operations in flight (a backend sizes its connection pool from it);
        ValueError for unusable credentials

The configuration layer sees only :class:`StoreURL`; what a location holds is its backend's own.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, cast
from urllib.parse import urlsplit

from sidecar.store.base import Store

#: Operations in flight when the caller does not say (``SIDECAR_CONCURRENCY``'s default).
DEFAULT_CONCURRENCY = 16


class Location(Protocol):
    """What a backend's ``parse_url`` returns; the rest of it is the backend's own."""

    @property
    def local_path(self) -> str | None:
        """The directory on this machine the store is (maybe relative, to the working
        directory), or None for a store elsewhere: a store must not overlap a mirrored root."""

    def check_volume(self, platform: str, roots: list[str], cwd: str,
                     container_root: str = "/") -> list[tuple[str, dict[str, str]]]:
        """On a container platform (``platform``: the variable that tells it), whether the store
        is where it survives the container, checked before anything can make it: ValueError, one
        line, for one that must not be used; warnings (an event and its fields) for one that may.
        ``roots``: the mirrored roots' paths; ``cwd``: what a relative path is relative to;
        ``container_root``: the container's own root filesystem."""


class _BackendModule(Protocol):
    def parse_url(self, url: str, env: Mapping[str, str]) -> Location: ...

    def make(self, location: Any, prefix: str, *, create: bool, concurrency: int,
             env: Mapping[str, str], writes: bool | None = None) -> Store: ...


@dataclass(frozen=True)
class Backend:
    """One kind of store: the URL schemes that name it, its module (imported on first use) and
    the URL form messages show."""

    name: str
    schemes: tuple[str, ...]
    module: str
    form: str

    def load(self) -> _BackendModule:
        return cast(_BackendModule, importlib.import_module(self.module))


#: Every backend; adding one is one module and one line here (and a parameter of the contract
#: suite's fixture, tests/store/conftest.py). "" is a plain path.
BACKENDS: tuple[Backend, ...] = (
    Backend("directory", ("", "file"), "sidecar.store.directory", "file:///dir or a path"),
    Backend("azure", ("https", "http"), "sidecar.store.azure", "https://<account>.blob.core.windows.net/<container>"),
)


class StoreURL(str):
    """A ``SIDECAR_STORE`` value its backend has parsed: the text itself, its :class:`Backend` and
    the backend's parsed ``location``. Passed to :func:`make_store`, it is not parsed again."""

    backend: Backend
    location: Location

    def __new__(cls, text: str, backend: Backend, location: Location) -> "StoreURL":
        url = super().__new__(cls, text)
        url.backend = backend
        url.location = location
        return url

    def __reduce__(self) -> tuple[Any, ...]:
        return StoreURL, (str(self), self.backend, self.location)

    @property
    def local_path(self) -> str | None:
        return self.location.local_path


def backend_for(url: str) -> Backend:
    """The backend ``url``'s scheme names; ValueError naming the scheme only (the rest of a URL
    may be a secret)."""
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:  # e.g. an unclosed '[' in the host
        raise ValueError("not a valid URL (a bracketed host is not closed?)") from None
    for backend in BACKENDS:
        if scheme in backend.schemes:
            return backend
    forms = ", or ".join(b.form for b in BACKENDS)
    raise ValueError(f"unsupported store URL scheme {scheme!r}: use {forms}")


def parse_store(url: str, env: Mapping[str, str] | None = None) -> StoreURL:
    """``url`` (blanks around it dropped) parsed by its backend, with the environment ``env``
    (default ``os.environ``) for what the URL leaves to it. ValueError, one line, never showing
    a secret. A :class:`StoreURL` is returned as it is."""
    if isinstance(url, StoreURL):
        return url
    text = url.strip()
    if not text:
        raise ValueError("must not be empty")
    backend = backend_for(text)
    return StoreURL(text, backend, backend.load().parse_url(text, os.environ if env is None else env))


def store_kind(url: str) -> str:
    """The name of the backend ``url`` names (``"directory"``, ``"azure"``); ValueError otherwise."""
    return backend_for(url.strip()).name


def make_store(url: str, prefix: str = "", read_only: bool = False, concurrency: int = DEFAULT_CONCURRENCY,
               env: Mapping[str, str] | None = None, writes: bool | None = None) -> Store:
    """The store ``url`` names (a :class:`StoreURL`, or text parsed here), ``prefix`` below it, not
    yet opened. ``read_only``: opening it creates nothing. ``writes`` (default: not ``read_only``):
    False when the caller writes nothing at all, not even a probe of the store's clock
    (:meth:`Store.now` is then this machine's clock where the store tells its own only by a write,
    said in one warning line). ``concurrency``: the operations the
    caller runs at once (``SIDECAR_CONCURRENCY``), which sizes the backend's connection pool.
    ``env`` (default ``os.environ``): the credentials. ValueError, one line, for a URL or a
    credential that cannot be used."""
    env = os.environ if env is None else env
    parsed = parse_store(url, env)
    return parsed.backend.load().make(parsed.location, prefix, create=not read_only, concurrency=concurrency, env=env,
                                       writes=writes)
