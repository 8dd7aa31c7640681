"""Where a directory store is: its ``SIDECAR_STORE`` (a path, or ``file:///absolute/path``),
parsed once, and the check that on a container platform it is a mounted volume
(:meth:`DirectoryLocation.check_volume`). No I/O but the ``stat`` calls of that check."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import unquote, urlsplit

from sidecar import log
from sidecar.paths import check_local_path
from sidecar.store.dirfs import device_of


@dataclass(frozen=True)
class DirectoryLocation:
    """A directory store's ``SIDECAR_STORE``: the directory (``~`` expanded; relative to the
    working directory unless absolute)."""

    path: str

    @property
    def local_path(self) -> str:
        return self.path

    def check_volume(self, platform: str, roots: list[str], cwd: str,
                     container_root: str = "/") -> list[tuple[str, dict[str, str]]]:
        """On a container platform (``platform``) the directory must be a mounted volume: one that
        does not exist is never created (it would be on the container's own disk, gone with it,
        and a restore from it would look like a first boot): ValueError, one line. One that
        exists yet lies on the container's own disk is a warning (an event and its fields): on
        the filesystem of ``container_root`` (the root/overlay filesystem: the platform did not
        mount the volume over the image's directory), ``store_on_container_disk``; on that of a
        root, ``store_on_root_filesystem``. What cannot be inspected is left to the store's own
        open, which says what is wrong."""
        path = os.path.normpath(os.path.join(cwd, self.path))
        try:
            store_dev = os.stat(path).st_dev
        except FileNotFoundError:
            shown = log.printable(path[:200], ascii=True) + (f"...({len(path)} characters)" if len(path) > 200 else "")
            raise ValueError(
                f"SIDECAR_STORE: the directory store {shown} does not exist, and {platform} says this runs on a "
                "container platform, where the store must be a mounted volume: it is never created on the container's "
                "own disk; mount the volume there or fix the path (SIDECAR_PREFIX names a directory inside it)") from None
        except OSError:
            return []
        warnings: list[tuple[str, dict[str, str]]] = []
        if device_of(container_root) == store_dev:
            warnings.append(("store_on_container_disk", {
                "store": path, "platform": platform,
                "detail": "the directory store is on the container's own root filesystem, lost with the container: "
                          "a mounted volume is expected there (was it mounted?)"}))
        shared = [r for r in roots if device_of(r) == store_dev]
        if shared:
            warnings.append(("store_on_root_filesystem", {
                "store": path, "roots": ",".join(shared), "platform": platform,
                "detail": "the directory store is on the same filesystem as the mirrored roots: on a container "
                          "platform that is likely the compute's own disk, lost with it; mount a volume for "
                          "SIDECAR_STORE"}))
        return warnings


def parse_url(url: str, env: Mapping[str, str]) -> DirectoryLocation:
    """A path, or ``file:///absolute/path``; ValueError, one line, for anything else."""
    parts = urlsplit(url)
    if parts.scheme:
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"a file: URL must be file:///absolute/path; this one names the host "
                             f"{ascii(parts.hostname or '')[:62]} (file://relative/x is not a relative path)")
        if not parts.path.startswith("/"):
            raise ValueError("a file: URL must be file:///absolute/path")
        path = unquote(parts.path)
    else:
        path = os.path.expanduser(url)
    check_local_path(path, "the store")
    return DirectoryLocation(path)
