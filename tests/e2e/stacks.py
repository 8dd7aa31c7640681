"""What the e2e tests parametrize: the agent stack a host runs on and the store its sidecar uses.

* :class:`Stack`: an agent stack (``tests/agent_stacks/constraints-<name>.txt``) and where its host
  keeps the state the sidecar mirrors. The issue stack writes ``./.checkpoints/`` (one file per
  checkpoint); the newer ones keep everything under ``$AGENTSERVER_STATE_ROOT`` (here the relative
  ``.agentserver``, so a compute's working directory holds all of it), mirrored with
  ``SIDECAR_LAYOUT=agentserver``.
* :class:`StoreView`: a store (a directory or an Azure container on Azurite) read through the
  sidecar's own store API, to see what it holds without trusting the sidecar under test.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio

from sidecar.store.base import NotFound
from sidecar.store.registry import make_store

AGENTSERVER_ROOT = ".agentserver"
AGENT_FRAMEWORK_ROOTS = (".checkpoints", ".function_approvals")


def store_file_name(store_name: str) -> str:
    """The file a hosting ≥ b260813 host keeps one state store in: ``<base64url(name)>.json``."""
    return base64.urlsafe_b64encode(store_name.encode()).decode().rstrip("=") + ".json"


@dataclass(frozen=True)
class Stack:
    name: str  # "issue", "latest", "today"
    python: str

    @property
    def agentserver(self) -> bool:
        return self.name != "issue"

    @property
    def roots(self) -> tuple[str, ...]:
        """The trees (relative to the host's working directory) the host keeps its state in."""
        return (AGENTSERVER_ROOT,) if self.agentserver else AGENT_FRAMEWORK_ROOTS

    @property
    def env(self) -> dict[str, str]:
        """What host and sidecar need to agree on where the state is."""
        if not self.agentserver:
            return {}
        return {"SIDECAR_LAYOUT": "agentserver", "AGENTSERVER_STATE_ROOT": AGENTSERVER_ROOT}

    def checkpoint_keys(self, files: Mapping[str, bytes], response_id: str, user: str | None) -> list[str]:
        """The keys of ``files`` (a tree: on disk or in a store) holding the turn's checkpoints."""
        if self.agentserver:  # one store file per turn, whoever the user
            key = f"{AGENTSERVER_ROOT}/state_stores/{store_file_name(f'checkpoints/{response_id}')}"
            return [key] if key in files else []
        directory = f".checkpoints/{user}/{response_id}/" if user else f".checkpoints/{response_id}/"
        return sorted(k for k in files if k.startswith(directory) and k.endswith(".json") and "/" not in k[len(directory):])

    def holds_pause(self, files: Mapping[str, bytes], response_id: str, call_id: str, user: str | None = None) -> bool:
        """Whether the tree holds the turn's checkpoint pending ``call_id``."""
        for key in self.checkpoint_keys(files, response_id, user):
            try:
                data = json.loads(files[key])
            except ValueError:
                continue  # damaged, or caught being replaced
            values = [item.get("value", {}) for item in data.get("items", {}).values()] if self.agentserver else [data]
            if any(call_id in (v.get("pending_request_info_events") or {}) for v in values):
                return True
        return False

    def recreate_compute(self, workdir: Path) -> None:
        """What a new compute sees: none of the host's state trees."""
        for name in self.roots:
            shutil.rmtree(workdir / name, ignore_errors=True)


def disk_files(workdir: Path, roots: tuple[str, ...]) -> dict[str, bytes]:
    """The files under ``roots`` of a working directory, by path relative to it."""
    out = {}
    for root in roots:
        for p in sorted((workdir / root).rglob("*")):
            if p.is_file():
                try:
                    out[str(p.relative_to(workdir))] = p.read_bytes()
                except FileNotFoundError:
                    continue  # replaced meanwhile
    return out


class StoreView:
    """A store as the tests see it: its URL and credentials, and what it holds."""

    def __init__(self, kind: str, url: str, env: dict[str, str]) -> None:
        self.kind, self.url, self.env = kind, url, env

    async def _files(self, prefix: str) -> dict[str, bytes]:
        store = make_store(self.url, env=self.env)
        try:
            await store.open()
            keys = [i.key async for i in store.list(prefix)
                    if not any(part.startswith(".sidecar") for part in i.key.split("/"))]
            out = {}
            for key in keys:
                with contextlib.suppress(NotFound):  # replaced or deleted since the listing
                    out[key] = (await store.get(key))[0]
            return out
        finally:
            await store.aclose()

    def files(self, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix`` (the sidecar's own bookkeeping left out), by key; one
        deleted between the listing and its read is left out too (the callers poll)."""
        return anyio.run(self._files, prefix)

    def stored(self, roots: tuple[str, ...] = AGENT_FRAMEWORK_ROOTS) -> dict[str, str]:
        """The sha256 of every stored file of the host's roots, by key."""
        return {k: hashlib.sha256(v).hexdigest() for k, v in self.files().items()
                if k.startswith(tuple(f"{r}/" for r in roots)) and not k.endswith(".tmp")}

    def create(self) -> StoreView:
        """Make the store exist (a mounted volume; where a platform names sessions a missing
        store is refused)."""
        async def go() -> None:
            store = make_store(self.url, env=self.env)
            try:
                await store.open()
            finally:
                await store.aclose()

        anyio.run(go)
        return self
