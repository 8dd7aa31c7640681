"""The owner marker is claimed by compare-and-swap, on both stores: of two sidecars that read the
same (absent) marker and claim together, exactly one lands, and the other is fenced before any
write of its own, naming both identities when they differ."""

from __future__ import annotations

import pytest

from sidecar.fence import Fence, Fenced
from sidecar.marker import read_marker
from sidecar.store.base import ObjectMeta

pytestmark = pytest.mark.anyio


async def test_two_identities_claiming_an_empty_namespace_at_once_leave_one_owner(make_store):
    a_store, b_store = await make_store("shared"), await make_store("shared")
    a = Fence(a_store, identity={"FOUNDRY_AGENT_SESSION_ID": "s1"}, namespace="shared")
    b = Fence(b_store, identity={"FOUNDRY_AGENT_SESSION_ID": "s2"}, namespace="shared")
    # both read the namespace empty first, as two computes starting at the same moment do
    seen_a, seen_b = await read_marker(a_store), await read_marker(b_store)
    assert seen_a == seen_b == {}
    a._read, b._read = _once(seen_a, a), _once(seen_b, b)  # their claims start from that read
    await a.claim()
    with pytest.raises(Fenced) as e:
        await b.claim()
    assert "FOUNDRY_AGENT_SESSION_ID=s1" in str(e.value) and "FOUNDRY_AGENT_SESSION_ID=s2" in str(e.value)
    marker = await read_marker(a_store)
    assert marker["identity"] == {"FOUNDRY_AGENT_SESSION_ID": "s1"}
    await a.before_write()  # the owner goes on writing
    with pytest.raises(Fenced):
        await b.before_write()


async def test_a_swap_against_a_changed_object_writes_nothing(make_store):
    store = await make_store()
    first = await store.put("r/x", b"one", ObjectMeta.of(b"one", 1, 0o600, version=5))
    assert first.version == 5
    refused = await store.put("r/x", b"two", ObjectMeta.of(b"two", 1, 0o600, version=9), if_version=4)
    assert refused.version == 5 and (await store.get("r/x"))[0] == b"one"
    taken = await store.put("r/x", b"two", ObjectMeta.of(b"two", 1, 0o600, version=9), if_version=5)
    assert taken.version == 9 and (await store.get("r/x"))[0] == b"two"
    absent = await store.put("r/y", b"new", ObjectMeta.of(b"new", 1, 0o600, version=3), if_version=1)
    assert absent.version != 3
    assert (await store.put("r/y", b"new", ObjectMeta.of(b"new", 1, 0o600, version=3), if_version=0)).version == 3


def _once(marker: dict, fence: Fence):
    """The fence's first read returns ``marker``; later reads look at the store again."""
    real = type(fence)._read
    calls = []

    async def read() -> dict:
        calls.append(1)
        return dict(marker) if len(calls) == 1 else await real(fence)

    return read
