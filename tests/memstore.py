"""A store in memory with the whole ``Store`` protocol, and one fake clock: rules tested in process.

Modelled on restic's ``mem`` backend and watchfiles' ``MockRustNotify``: an honest double that
passes the store contract (``tests/store/test_contract.py``, its ``memory`` parameter), plus hooks
a test of a rule needs and no real store gives deterministically::

    space = MemorySpace()                   # one container's worth of objects, its clock, its hooks
    store = space.store("agents/s1")        # a store on it (as many as wanted, any prefixes)
    gate = space.hooks.pause("put", key=OWNER_KEY)     # puts of the marker wait for gate.release
    space.hooks.fail("get", 2, TransientStoreError("throttled"))   # the 2nd get from now raises
    space.hooks.crash_after(3)              # 3 more mutations land; every later one raises Crashed
    space.log                               # the mutations that landed, in order

Nothing here waits on wall-clock time: the store's clock (``now()``, ``modified``) is the
space's :class:`FakeClock`, and it moves only when a test moves it.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import anyio
import anyio.lowlevel

from sidecar.paths import MAX_KEY_BYTES, UnsafeKey, validate_relpath
from sidecar.store.base import CHUNK_BYTES, NotFound, ObjectInfo, ObjectMeta, Source, StoreError, Stream, supersedes

#: The ops hooks see, as named in :class:`Hooks` calls (``list``'s key is its prefix; ``open``,
#: ``exists`` and ``now`` have the key ``""``).
OPS = ("open", "put", "get", "get_stream", "list", "delete", "delete_if", "exists", "now")
MUTATIONS = ("put", "delete", "delete_if")

#: Where a :class:`FakeClock`'s wall time starts (2023-11-14): fixed, so runs are alike.
EPOCH = 1_700_000_000.0


class FakeClock:
    """One fake time for a test. ``now`` (or calling the clock) is monotonic seconds from 0, as
    ``Fence(clock=...)`` takes it; :meth:`time` is the wall time, seconds since the epoch
    (``epoch + now``), as a store's clock gives it. It moves only by :meth:`advance` and
    :meth:`sleep`, never by itself."""

    def __init__(self, epoch: float = EPOCH) -> None:
        self.now = 0.0
        self.epoch = epoch

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.epoch + self.now

    def advance(self, seconds: float) -> None:
        """Move forward ``seconds`` (a negative amount does nothing: the clock never goes back)."""
        self.now += max(0.0, seconds)

    async def sleep(self, seconds: float) -> None:
        """``anyio.sleep`` on this clock: advance it, then let other tasks run once."""
        self.advance(seconds)
        await anyio.sleep(0)


class Crashed(Exception):
    """A mutation sent after the crash point (:meth:`Hooks.crash_after`): the sidecar that sent
    it is taken to be dead, so it never reaches the store; nothing changed."""


KeyMatch = Callable[[str], bool] | str | None


def _matcher(key: KeyMatch) -> Callable[[str], bool]:
    if key is None:
        return lambda _k: True
    if isinstance(key, str):
        return lambda k: k == key
    return key


@dataclass(eq=False)
class Gate:
    """Requests held by :meth:`Hooks.pause`: they wait until :attr:`release` is set.
    :attr:`reached` is set when the first one arrives; :attr:`waiting` counts those waiting now,
    :attr:`passed` those that went through."""

    op: str
    match: Callable[[str], bool]
    when: str
    release: anyio.Event
    reached: anyio.Event = field(default_factory=anyio.Event)
    waiting: int = 0
    passed: int = 0

    def open(self) -> None:
        """Let every held request, and every later one, through."""
        self.release.set()


@dataclass(eq=False)
class _Failure:
    op: str
    match: Callable[[str], bool]
    nth: int
    error: BaseException
    calls: int = 0


class Hooks:
    """What a test does to the requests of the stores that share these hooks (by default every
    store of a :class:`MemorySpace`): pause some, fail one, crash after a count of mutations."""

    def __init__(self) -> None:
        self.gates: list[Gate] = []
        self.failures: list[_Failure] = []
        self.landed = 0  # mutations landed through these hooks' stores
        self.crash_at: int | None = None

    def pause(self, op: str, key: KeyMatch = None, release: anyio.Event | None = None, *,
              when: str = "before") -> Gate:
        """Hold requests of ``op`` on a matching key (``key``: the key itself, a predicate of the
        store's key, or None for any) until ``release`` is set (a new event when not given: the
        gate's :attr:`Gate.release`). ``when="before"``: before the request does anything;
        ``"after"``: once it is done (a mutation has landed) and before its caller hears of it."""
        if op not in OPS or when not in ("before", "after"):
            raise ValueError(f"no op {op!r} or no point {when!r} to pause at")
        gate = Gate(op, _matcher(key), when, release or anyio.Event())
        self.gates.append(gate)
        return gate

    def fail(self, op: str, nth: int, error: BaseException, key: KeyMatch = None) -> None:
        """Make the ``nth`` call of ``op`` on a matching key (counted from now, 1 the next one)
        raise ``error`` before it does anything; the calls before and after it go through."""
        if op not in OPS or nth < 1:
            raise ValueError(f"no op {op!r}, or nth {nth} < 1")
        self.failures.append(_Failure(op, _matcher(key), nth, error))

    def crash_after(self, n: int) -> None:
        """Let ``n`` more mutations land (puts that write, deletes that remove); every mutation
        after them raises :class:`Crashed` and changes nothing, as if its sender had died."""
        self.crash_at = self.landed + n

    @property
    def crashed(self) -> bool:
        return self.crash_at is not None and self.landed >= self.crash_at

    def clear(self) -> None:
        """No gates (held requests are released), failures or crash point any more: a restart."""
        for gate in self.gates:
            gate.release.set()
        self.gates, self.failures, self.crash_at = [], [], None

    async def _at(self, op: str, key: str, when: str) -> None:
        for gate in list(self.gates):
            if gate.op == op and gate.when == when and gate.match(key):
                if not gate.release.is_set():
                    gate.waiting += 1
                    gate.reached.set()
                    try:
                        await gate.release.wait()
                    finally:
                        gate.waiting -= 1
                gate.passed += 1
        if when == "before":
            for failure in self.failures:
                if failure.op == op and failure.match(key):
                    failure.calls += 1
                    if failure.calls == failure.nth:
                        raise failure.error


@dataclass(frozen=True)
class Mutation:
    """One mutation that landed (as ``tests.inprocess.Mutation``, with the store's prefix)."""

    op: str  # put, delete, delete_if
    key: str  # as the store that made it names it
    data: bytes = b""
    meta: ObjectMeta | None = None
    if_version: int | None = None
    version: int = 0  # delete_if's
    prefix: str = ""

    def __str__(self) -> str:
        return f"{self.op} {self.key}" + (f" v{self.meta.version}" if self.meta else "")


class MemorySpace:
    """What memory stores hold: objects by full name (``prefix/key``), shared by every store made
    on it, as one container (or one directory) holds every prefix's; its clock, hooks and log."""

    _names = itertools.count(1)

    def __init__(self, clock: FakeClock | None = None, hooks: Hooks | None = None) -> None:
        self.clock = clock or FakeClock()
        self.hooks = hooks or Hooks()
        self.objects: dict[str, tuple[bytes, ObjectInfo]] = {}  # info.key: the full name
        self.log: list[Mutation] = []
        self.present = True  # the container itself (False: dropped; a store's open() makes it again)
        self.name = f"space{next(self._names)}"
        self._etags = itertools.count(1)

    def store(self, prefix: str = "", *, create: bool = True, hooks: Hooks | None = None) -> "MemoryStore":
        """A store on this space below ``prefix`` (its own ``hooks``, or the space's)."""
        return MemoryStore(self, prefix, create=create, hooks=hooks)

    def drop(self) -> None:
        """Remove the container and everything in it (as deleting an Azure container does)."""
        self.objects.clear()
        self.present = False

    def etag(self) -> str:
        return f'"0x{next(self._etags):08x}"'


class MemoryStore:
    """The ``Store`` protocol on a :class:`MemorySpace`. Each request is one atomic step (no await
    between its check and its write), so a put's supersede rule and swap, and ``delete_if``, hold
    among any number of stores and tasks. ``expected`` is never consulted: it only makes a remote
    write cheaper. ``create=False``: :meth:`open` never makes a dropped container."""

    #: Restored as the directory store is (each object as it is listed), though it could hold
    #: ``a`` and ``a/x`` at once: a test of Azure's rule sets it on its store.
    flat_namespace = False
    #: Its clock is the space's :class:`FakeClock`, never this machine's.
    clock_is_local = False

    def __init__(self, space: MemorySpace, prefix: str = "", *, create: bool = True, hooks: Hooks | None = None) -> None:
        self.space = space
        self.prefix = prefix.strip("/")
        if self.prefix:
            try:
                validate_relpath(self.prefix)
            except UnsafeKey as e:
                raise StoreError(f"memory store: refusing the prefix: {e}") from None
        self.create = create
        self.hooks = hooks or space.hooks
        self.description = f"memory://{space.name}/{self.prefix}"
        self._name_prefix = f"{self.prefix}/" if self.prefix else ""

    @property
    def clock(self) -> FakeClock:
        return self.space.clock

    def _name(self, key: str) -> str:
        """The full name of ``key``, refused as the other backends refuse it."""
        try:
            validate_relpath(key)
        except UnsafeKey as e:
            raise StoreError(f"refusing unsafe key: {e}") from None
        name = self._name_prefix + key
        if len(name.encode("utf-8", "surrogateescape")) > MAX_KEY_BYTES:
            raise StoreError(f"refusing key {key[:60]!r}...: name longer than {MAX_KEY_BYTES} bytes")
        return name

    def _held(self, name: str, key: str) -> tuple[bytes, ObjectInfo] | None:
        got = self.space.objects.get(name)
        return None if got is None else (got[0], dataclasses.replace(got[1], key=key))

    def _mutating(self) -> None:
        if self.hooks.crashed:
            raise Crashed(f"{self.description}: a mutation after the crash point")
        if not self.space.present:
            raise StoreError(f"{self.description}: the store is not there (its container was removed)")

    def _landed(self, mutation: Mutation) -> None:
        self.hooks.landed += 1
        self.space.log.append(mutation)

    async def open(self) -> None:
        await self.hooks._at("open", "", "before")
        if self.create:
            self.space.present = True
        await self.hooks._at("open", "", "after")

    async def put(self, key: str, data: bytes | Source, meta: ObjectMeta, if_version: int | None = None, *,
                  expected: ObjectInfo | None = None) -> ObjectInfo:
        name = self._name(key)
        await self.hooks._at("put", key, "before")
        if isinstance(data, (bytes, bytearray, memoryview)):
            body = bytes(data)
        else:  # a Source, read as a store streams it: when it raises, nothing has changed
            body = b"".join([chunk async for chunk in data.chunks()])
        # the check and the write: one step, no await between them
        self._mutating()
        held = self._held(name, key)
        if held is None:
            if if_version not in (None, 0):
                return ObjectInfo(key, 0, None, 0, 0)  # a swap against an object that is gone
        else:
            current = held[1]
            if supersedes(current, meta.version) or (if_version is not None and current.version != if_version):
                return current
        info = ObjectInfo(key, len(body), meta.sha256, meta.mtime_ns, meta.mode & 0o7777, self.space.etag(),
                          meta.version, self.clock.time())
        self.space.objects[name] = (body, dataclasses.replace(info, key=name))
        self._landed(Mutation("put", key, body, meta, if_version, prefix=self.prefix))
        await self.hooks._at("put", key, "after")
        return info

    async def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        name = self._name(key)
        await self.hooks._at("get", key, "before")
        held = self._held(name, key)
        if held is None:
            raise NotFound(key)
        await self.hooks._at("get", key, "after")
        return held

    async def get_stream(self, key: str, read_ahead: int = 0) -> Stream:
        """The bytes as they were when it was called (a later put does not change a read begun),
        in chunks of at most ``CHUNK_BYTES``; ``read_ahead`` has nothing to fetch ahead."""
        name = self._name(key)
        await self.hooks._at("get_stream", key, "before")
        held = self._held(name, key)
        if held is None:
            raise NotFound(key)
        data, info = held

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(data), CHUNK_BYTES):
                yield data[start:start + CHUNK_BYTES]

        await self.hooks._at("get_stream", key, "after")
        return Stream(info, chunks())

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """In name order, as the objects were when the listing began."""
        await self.hooks._at("list", prefix, "before")
        start, cut = self._name_prefix + prefix, len(self._name_prefix)
        found = sorted((name, info) for name, (_, info) in self.space.objects.items() if name.startswith(start))
        await self.hooks._at("list", prefix, "after")
        for name, info in found:
            yield dataclasses.replace(info, key=name[cut:])
            await anyio.lowlevel.checkpoint()  # others run between items, as between pages

    async def delete(self, key: str) -> None:
        name = self._name(key)
        await self.hooks._at("delete", key, "before")
        self._mutating()
        if self.space.objects.pop(name, None) is not None:
            self._landed(Mutation("delete", key, prefix=self.prefix))
        await self.hooks._at("delete", key, "after")

    async def delete_if(self, key: str, version: int) -> bool:
        name = self._name(key)
        await self.hooks._at("delete_if", key, "before")
        self._mutating()
        held = self.space.objects.get(name)
        removed = held is not None and held[1].version == version
        if removed:
            del self.space.objects[name]
            self._landed(Mutation("delete_if", key, version=version, prefix=self.prefix))
        await self.hooks._at("delete_if", key, "after")
        return removed

    async def exists(self) -> bool:
        await self.hooks._at("exists", "", "before")
        return self.space.present

    async def now(self) -> float:
        """The space's fake wall time (:meth:`FakeClock.time`)."""
        await self.hooks._at("now", "", "before")
        return self.clock.time()

    async def aclose(self) -> None:
        return None
