"""Rehydrate: bring every stored file of every root back before the host starts.

Each file is downloaded, its sha256 verified, written to a temp file beside its target with the
stored mode and mtime, and renamed into place; directories are walked without following symlinks,
so a stored name can never land outside its root. The restored filesystem is flushed at the end
(``syncfs``; a large restore also as it fills) so a power loss cannot leave empty files that a
later ``sync`` would take for the truth. Which roots are restored follows :func:`sidecar.plan.decide_restore`.
"""

from __future__ import annotations

import errno
import re
import sys
import time
from dataclasses import dataclass, field

import anyio
import anyio.to_thread

from sidecar import log, metrics
from sidecar.localfs import (
    ChecksumMismatch, UnsafeTarget, clear_restoring, has_regular_files, mark_restoring, printable, remove_stale_restore_temps,
    restore_cut_short, syncfs, unmirrorable_reason, write_restored,
)
from sidecar.paths import Root, UnsafeKey, split_key
from sidecar.plan import RootDecision, decide_restore
from sidecar.snapshot import BUNDLE_DIR, Change, fetch_bundle
from sidecar.store.base import NotFound, ObjectInfo, Store, StoreError

GENERATED_NAME = re.compile(rb"WorkflowBuilder-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def generated_name(data: bytes) -> str | None:
    """The first workflow name ``WorkflowBuilder`` generated (``WorkflowBuilder-<uuid4>``) in a
    checkpoint, if any. ``bytes.find`` skips to candidates (a regex search over every byte of a
    100 KiB checkpoint cost 50 µs, a tenth of a restored file's CPU)."""
    start = data.find(b"WorkflowBuilder-")
    while start >= 0:
        m = GENERATED_NAME.match(data, start)
        if m:
            return m.group(0).decode()
        start = data.find(b"WorkflowBuilder-", start + 1)
    return None


PROGRESS_EVERY = 2.0


class RestoreError(Exception):
    """Restore cannot bring the state back; the host must not start."""


#: Restored files up to this size are written on the event loop (about 0.2 ms for 100 KiB);
#: larger ones in a worker thread. Thread hand-offs cost a 1,000-file restore 120,000 futex calls.
INLINE_WRITE_MAX = 256 * 1024

#: A large restore flushes what it has written so far in the background, each time this much more
#: has been written, so that the final flush (before the host may start) has little left to do.
FLUSH_EVERY_BYTES = 16 * 1024 * 1024


async def _flush_as_it_fills(progress: "_Progress", paths: list[str]) -> None:
    """Flush the restored filesystems in a worker thread whenever another FLUSH_EVERY_BYTES have
    been written, until cancelled when the downloads end: the disk writes while the network
    transfers. (Measured: the final flush of a 97 MiB restore went from 50-65 ms to about 10.)"""
    flushed = 0
    while True:
        if progress.bytes - flushed >= FLUSH_EVERY_BYTES:
            flushed = progress.bytes
            for path in paths:
                await anyio.to_thread.run_sync(syncfs, path)
        else:
            await anyio.sleep(0.02)


@dataclass
class Listing:
    """The store's content for the configured roots, with hostile names set aside."""

    objects: dict[str, ObjectInfo] = field(default_factory=dict)
    unsafe: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    bundles: set[str] = field(default_factory=set)  # roots with a snapshot bundle in the store


async def list_store(store: Store, roots: list[Root]) -> Listing:
    by_name = {r.name: r for r in roots}
    out = Listing()
    async for info in store.list():
        if info.key.startswith(BUNDLE_DIR + "/"):
            out.bundles.add(info.key[len(BUNDLE_DIR) + 1 :])
            continue
        first = info.key.split("/", 1)[0]
        if first and first not in by_name and first not in ("..", "."):
            continue  # another root's data, or not ours at all
        try:
            split_key(info.key, by_name)
        except UnsafeKey as e:
            out.unsafe.append((info.key, str(e)))
            continue
        if not info.key.isascii() and unmirrorable_reason(info.key):
            # a name no sync would store today (a directory store written by an older version)
            out.unsafe.append((printable(info.key), unmirrorable_reason(info.key) or "unsupported name"))
            continue
        out.objects[info.key] = info
    return out


@dataclass
class RestoreResult:
    decisions: list[RootDecision] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    refused: list[str] = field(default_factory=list)
    unverified: int = 0
    generated_names: set[str] = field(default_factory=set)

    def restored_roots(self) -> set[str]:
        return {d.name for d in self.decisions if d.restore}


class _Progress:
    def __init__(self, total_files: int, total_bytes: int) -> None:
        self.total_files, self.total_bytes = total_files, total_bytes
        self.files = self.bytes = 0
        self.tty = sys.stderr.isatty()
        self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.files += 1
        self.bytes += n
        now = time.monotonic()
        if self.tty:
            if now - self.last > 0.1 or self.files == self.total_files:
                self.last = now
                frac = self.bytes / self.total_bytes if self.total_bytes else 1.0
                bar = "#" * int(frac * 30)
                sys.stderr.write(
                    f"\rrestoring [{bar:<30}] {self.files}/{self.total_files} files "
                    f"{self.bytes / 1048576:.1f}/{self.total_bytes / 1048576:.1f} MiB"
                )
                if self.files == self.total_files:
                    sys.stderr.write("\n")
                sys.stderr.flush()
        elif now - self.last > PROGRESS_EVERY:
            self.last = now
            log.info("restore_progress", files=self.files, total_files=self.total_files,
                     bytes=self.bytes, total_bytes=self.total_bytes)


async def restore(
    store: Store,
    roots: list[Root],
    listing: Listing,
    *,
    mode: str = "auto",
    concurrency: int = 16,
) -> RestoreResult:
    t0 = time.monotonic()
    result = RestoreResult()
    for key, why in listing.unsafe:
        log.error("restore_refused_name", path=key, reason=why)
        result.refused.append(key)

    per_root: dict[str, list[ObjectInfo]] = {r.name: [] for r in roots}
    for info in listing.objects.values():
        per_root[info.key.split("/", 1)[0]].append(info)

    todo: list[tuple[Root, ObjectInfo]] = []
    overlay: dict[str, Change] = {}
    for root in roots:
        changes = await fetch_bundle(store, root.name) if root.name in listing.bundles else None
        if changes is not None:
            # a snapshot commit was cut short: its bundle holds the newer consistent state
            log.info("restore_bundle", root=root.path, changes=len(changes))
            stored = {i.key: i for i in per_root[root.name]}
            for c in changes:
                overlay[c.key] = c
                if c.data is None:
                    stored.pop(c.key, None)
                else:
                    stored[c.key] = ObjectInfo(c.key, c.meta.size, c.meta.sha256, c.meta.mtime_ns, c.meta.mode)
            per_root[root.name] = list(stored.values())
        local = await anyio.to_thread.run_sync(has_regular_files, root.path)
        cut_short = restore_cut_short(root)
        d = decide_restore(root.name, local, len(per_root[root.name]), mode, cut_short)
        result.decisions.append(d)
        log.info("restore_decision", root=root.path, restore=d.restore, reason=d.reason,
                 stored=len(per_root[root.name]))
        if d.restore:
            await anyio.to_thread.run_sync(remove_stale_restore_temps, root)
            try:  # before the first file lands: a restore cut short from here on is known as such
                mark_restoring(root)
            except OSError as e:
                raise RestoreError(f"cannot write into {root.path}: {e.strerror}") from None
            todo.extend((root, info) for info in per_root[root.name])
        elif cut_short and mode != "skip":  # nothing is stored any more: the disk is all there is
            clear_restoring(root)

    by_name = {r.name: r for r in roots}
    progress = _Progress(len(todo), sum(i.size for _, i in todo))
    limiter = anyio.Semaphore(concurrency)

    async def fetch(root: Root, info: ObjectInfo) -> None:
        async with limiter:
            _, parts = split_key(info.key, by_name)
            bundled = overlay.get(info.key)
            for attempt in (1, 2):
                if bundled is not None:  # verified when the bundle was decoded
                    data, got, expected = bundled.data, info, None
                else:
                    try:
                        data, got = await store.get(info.key)
                    except NotFound:
                        log.warning("restore_vanished", path=info.key)
                        return
                    expected = got.sha256 or info.sha256
                    if expected is None:
                        result.unverified += 1
                try:
                    # Verified, written and renamed: a large file in a worker thread (hashing
                    # 100 MiB in the event loop would stall the other downloads), a small one
                    # right here, where it costs less than the hand-off to a thread and back.
                    if len(data) > INLINE_WRITE_MAX:
                        await anyio.to_thread.run_sync(write_restored, root, parts, data, got.mtime_ns, got.mode, expected)
                    else:
                        write_restored(root, parts, data, got.mtime_ns, got.mode, expected)
                    break
                except ChecksumMismatch:
                    log.warning("restore_checksum_mismatch", path=info.key, attempt=attempt)
                except UnsafeTarget as e:
                    log.error("restore_refused_target", path=info.key, reason=str(e))
                    result.refused.append(info.key)
                    return
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise RestoreError(f"no space left on device while restoring into {root.path} "
                                           f"({progress.files} of {progress.total_files} files restored; no partial file left)") from None
                    raise RestoreError(f"cannot write {info.key} into {root.path}: {e.strerror}") from None
            else:
                raise RestoreError(f"{info.key}: stored bytes do not match their sha256 (corrupt object in {store.description})")
            if info.key.startswith(".checkpoints/") or info.key.endswith(".json"):
                name = generated_name(data)
                if name:
                    result.generated_names.add(name)
            progress.add(len(data))
            metrics.restored(len(data))

    try:
        async with anyio.create_task_group() as flushing:
            if progress.total_bytes > FLUSH_EVERY_BYTES:
                flushing.start_soon(_flush_as_it_fills, progress, [r.path for r in roots if r.name in result.restored_roots()])
            async with anyio.create_task_group() as tg:
                for root, info in todo:
                    tg.start_soon(fetch, root, info)
            flushing.cancel_scope.cancel()  # every download ended (a flush under way completes)
    except BaseExceptionGroup as eg:  # report the first real cause, one line
        for exc in leaves(eg):
            if isinstance(exc, (RestoreError, StoreError)):
                raise exc from None
        raise
    for root in roots:
        if root.name in result.restored_roots():
            await anyio.to_thread.run_sync(syncfs, root.path)
            clear_restoring(root)  # every file is in place and flushed

    result.files, result.bytes = progress.files, progress.bytes
    result.seconds = time.monotonic() - t0
    metrics.restore_finished(result.seconds)
    if result.generated_names:
        log.warning(
            "unresumable_checkpoints",
            detail=(
                f"stored checkpoints belong to workflows with generated names ({', '.join(sorted(result.generated_names)[:3])}); "
                "a WorkflowBuilder without name= gets a new random name in every process, so these can never be resumed. "
                "Fix: WorkflowBuilder(name=\"my-workflow\", ...)"
            ),
        )
    log.info("restore_done", files=result.files, bytes=result.bytes, seconds=round(result.seconds, 3),
             refused=len(result.refused), unverified=result.unverified)
    return result


def leaves(eg: BaseException):
    """The exceptions inside a (nested) exception group, in order; a plain exception is its own leaf."""
    if isinstance(eg, BaseExceptionGroup):
        for e in eg.exceptions:
            yield from leaves(e)
    else:
        yield eg
