"""Helpers shared by the fault suite: Azure containers as trees, metrics, sidecars with HTTP."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import shutil
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import anyio
from azure.storage.blob.aio import BlobServiceClient

from support import Sidecar, disk_tree, metric_values, sidecar_env, wait_for, write_atomic
from tests.azurite import AzuriteEndpoint, connection_string, unique_container

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# -- Azure -----------------------------------------------------------------------------------

async def _blobs(conn: str, container: str, prefix: str, with_data: bool) -> dict[str, tuple[dict, bytes | None]]:
    out: dict[str, tuple[dict, bytes | None]] = {}
    async with BlobServiceClient.from_connection_string(conn) as svc:
        c = svc.get_container_client(container)
        if not await c.exists():
            return out
        names = []
        async for b in c.list_blobs(name_starts_with=prefix or None, include=["metadata"]):
            out[b.name] = (dict(b.metadata or {}), None)
            names.append(b.name)
        if with_data:
            limiter = anyio.Semaphore(16)

            async def fetch(name: str) -> None:
                async with limiter:
                    data = await (await c.get_blob_client(name).download_blob()).readall()
                    out[name] = (out[name][0], data)

            async with anyio.create_task_group() as tg:
                for name in names:
                    tg.start_soon(fetch, name)
    return out


def blobs(conn: str, container: str, prefix: str = "", with_data: bool = True) -> dict[str, tuple[dict, bytes | None]]:
    """Every blob of ``container`` (under ``prefix``) listed with the SDK: name → (metadata, bytes)."""
    return anyio.run(_blobs, conn, container, prefix, with_data)


@dataclass
class AzureTarget:
    """A fresh container on an Azurite endpoint, used as a sidecar's store."""

    endpoint_url: str  # http://127.0.0.1:PORT/devstoreaccount1 (the real Azurite)
    container: str
    prefix: str = ""

    @property
    def conn(self) -> str:
        return connection_string(self.endpoint_url)

    @property
    def store_url(self) -> str:
        return f"{self.endpoint_url}/{self.container}"

    def env(self, endpoint_url: str | None = None, **extra: str) -> dict[str, str]:
        """A sidecar environment whose credentials point at ``endpoint_url`` (default: Azurite)."""
        env = {k: v for k, v in sidecar_env(**extra).items() if not k.startswith("AZURE_")}
        env["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(endpoint_url or self.endpoint_url)
        return env

    def all_blobs(self, with_data: bool = True) -> dict[str, tuple[dict, bytes | None]]:
        return blobs(self.conn, self.container, "", with_data)

    def tree(self, root_name: str = ".checkpoints") -> dict[str, bytes]:
        """What the container holds for one root, shaped like :func:`support.disk_tree`."""
        head = (f"{self.prefix}/" if self.prefix else "") + root_name + "/"
        return {name[len(head):]: data for name, (_md, data) in self.all_blobs().items() if name.startswith(head)}

    def digests(self, root_name: str = ".checkpoints") -> dict[str, str]:
        """Cheap form for polling: relative name → the sidecar's recorded sha256 (no downloads)."""
        head = (f"{self.prefix}/" if self.prefix else "") + root_name + "/"
        return {name[len(head):]: {k.lower(): v for k, v in md.items()}.get("sidecar_sha256", "")
                for name, (md, _d) in self.all_blobs(with_data=False).items() if name.startswith(head)}

    def drop(self) -> None:
        async def go() -> None:
            async with BlobServiceClient.from_connection_string(self.conn) as svc:
                with contextlib.suppress(Exception):
                    await svc.delete_container(self.container)

        anyio.run(go)


def new_target(endpoint: AzuriteEndpoint | str, stem: str = "f") -> AzureTarget:
    url = endpoint if isinstance(endpoint, str) else endpoint.url
    return AzureTarget(url.rstrip("/"), unique_container(stem))


def disk_digests(root: Path) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in disk_tree(root).items()}


def wait_converged_azure(target: AzureTarget, root: Path, timeout: float, what: str = "Azure store to match the disk") -> None:
    """Poll cheaply (names + recorded sha256), then compare every blob byte for byte."""
    wait_for(lambda: target.digests(root.name) == disk_digests(root), timeout, what, interval=0.2)
    assert target.tree(root.name) == disk_tree(root)


# -- sidecar with the HTTP endpoints -----------------------------------------------------------

def start_with_http(work: Path, *args: str, env: dict[str, str] | None = None, wait: str | None = "ready",
                    timeout: float = 30.0) -> tuple[Sidecar, str]:
    """``sync`` (args after it) with /metrics on a kernel-chosen port; (process, base URL)."""
    sc = Sidecar(work, "sync", "--http-addr", "127.0.0.1:0", *args, env=env)
    addr = sc.wait_event("http_listening", timeout)["addr"]
    if wait:
        sc.wait_event(wait, timeout)
    return sc, f"http://{addr}"


def http_get(base: str, path: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with _DIRECT.open(base + path, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics, labels folded into the name: ``name{k=v}``."""
    _status, text = http_get(base, "/metrics")
    return metric_values(text)


def events(sc: Sidecar, name: str) -> list[dict]:
    return [e for e in sc.events() if e.get("event") == name]


# -- workloads -----------------------------------------------------------------------------------

class Workload:
    """A seeded random workload on one root: writes, atomic replaces, deletes, renames of files and
    of context directories, across ``users`` × ``contexts`` nested directories.

    ``step()`` does one operation; the sequence of operations depends only on the seed (the disk
    state after ``n`` steps is reproducible). ``progress`` counts steps done (thread-safe read).
    """

    def __init__(self, root: Path, seed: int, *, users: int = 4, contexts: int = 6, max_files: int = 400,
                 max_size: int = 6000) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.users = [f"user{u}" for u in range(users)]
        self.contexts = contexts
        self.max_files = max_files
        self.max_size = max_size
        self.files: list[Path] = []
        self.progress = 0
        self.counts: dict[str, int] = {}
        self._serial = 0

    def _ctx_dir(self) -> Path:
        return self.root / self.rng.choice(self.users) / f"ctx{self.rng.randrange(self.contexts)}"

    def _data(self) -> bytes:
        self._serial += 1
        n = self.rng.randint(0, self.max_size)
        return f"{self._serial}:".encode() + self.rng.randbytes(n)

    def _new_name(self) -> str:
        self._serial += 1
        return f"{self._serial:06d}-{self.rng.getrandbits(32):08x}.json"

    def step(self) -> str:
        rng = self.rng
        ops = ["write"] * 5 + ["replace"] * 4 + ["delete"] * 3 + ["rename"] * 2 + ["move_dir", "inplace"]
        op = rng.choice(ops) if self.files else "write"
        if op == "write" and len(self.files) >= self.max_files:
            op = "delete"
        if op == "write":
            p = self._ctx_dir() / self._new_name()
            write_atomic(p, self._data())
            self.files.append(p)
        if op == "replace":
            p = rng.choice(self.files)
            write_atomic(p, self._data())
        elif op == "inplace":  # not how the hosts write, but a tool might: open, truncate, write
            p = rng.choice(self.files)
            p.write_bytes(self._data())
        elif op == "delete":
            p = self.files.pop(rng.randrange(len(self.files)))
            p.unlink()
        elif op == "rename":
            i = rng.randrange(len(self.files))
            dst = self._ctx_dir() / self._new_name()
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.rename(self.files[i], dst)
            self.files[i] = dst
        elif op == "move_dir":  # a whole context directory changes place (or is dropped)
            src = self._ctx_dir()
            if src.is_dir():
                if rng.random() < 0.3:
                    shutil.rmtree(src)
                    self.files = [f for f in self.files if src not in f.parents]
                else:
                    dst = self.root / rng.choice(self.users) / f"moved{self._serial}-{rng.getrandbits(16):04x}"
                    self._serial += 1
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(src, dst)
                    self.files = [dst / f.relative_to(src) if src in f.parents else f for f in self.files]
        self.counts[op] = self.counts.get(op, 0) + 1
        self.progress += 1
        return op


class Background(threading.Thread):
    """Run ``fn()`` repeatedly on a thread until ``stop()``; exceptions are re-raised by ``stop()``."""

    def __init__(self, fn, until: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.halt = until or threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                if self.fn() is False:
                    return
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> None:
        self.halt.set()
        self.join(60)
        if self.error is not None:
            raise self.error


def escape(name: str) -> str:
    """A log-safe form of a path for messages: non-printables as escapes."""
    return re.sub(r"[^\x20-\x7e]", lambda m: repr(m.group(0))[1:-1], name)
