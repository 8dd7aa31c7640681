import pytest

from sidecar.snapshot import BundleError, Change, decode_bundle, encode_bundle
from sidecar.store.base import ObjectMeta


def test_bundle_round_trip():
    a = b"\x00binary\n" * 100
    changes = [Change("r/a", a, ObjectMeta.of(a, 5, 0o640)), Change("r/gone", None, None),
               Change("r/empty", b"", ObjectMeta.of(b"", 6, 0o600))]
    root, back = decode_bundle(encode_bundle("r", changes))
    assert root == "r" and back == changes


def test_corrupt_bundle_refused():
    a = b"abc"
    blob = encode_bundle("r", [Change("r/a", a, ObjectMeta.of(a, 1, 0o600))])
    with pytest.raises(BundleError):
        decode_bundle(blob[:-1] + b"x")
    with pytest.raises(BundleError):
        decode_bundle(b"not json\n")


@pytest.mark.parametrize("blob", [
    b"[]\n",  # a header that is not an object
    b'{"version": 1, "root": "r", "entries": [[]]}\n',  # an entry that is not an object
    b'{"version": 1, "root": "r", "entries": [{"key": 5, "deleted": true}]}\n',  # a key that is not a string
    b'{"version": 1, "root": ["r"], "entries": []}\n',
    b'{"version": 1, "root": "r", "entries": {}}\n',
    b'{"version": 1, "root": "r", "entries": [{"key": "r/a", "size": -1, "sha256": "x", "mtime_ns": 1, "mode": 384}]}\nabc',
    b'{"version": 1, "root": "r", "entries": [{"key": "r/a", "size": 9, "sha256": "x", "mtime_ns": 1, "mode": 384}]}\nabc',
    b'{"version": 1, "root": "r", "entries": [{"key": "r/a", "size": true, "sha256": "x", "mtime_ns": 1, "mode": 384}]}\na',
    b'{"version": 1, "root": "r", "entries": [{"key": "r/a", "size": 1, "sha256": 7, "mtime_ns": 1, "mode": 384}]}\na',
    b'{"version": 1, "root": "r", "entries": []}\ntrailing bytes no entry accounts for',
    b'{"version": 2, "root": "r", "entries": []}\n',
])
def test_hostile_bundles_are_refused_as_unreadable(blob):
    """A bundle is read from the store: whatever it holds is a BundleError (one line at restore),
    never an AttributeError or a half-decoded change."""
    with pytest.raises(BundleError):
        decode_bundle(blob)


def test_take_all_ignores_barriers():
    from sidecar.queue import DELETE, UPLOAD, PendingSet

    ps = PendingSet()
    ps.mark("b", UPLOAD)
    ps.mark("a", DELETE)
    ops = ps.take_all()
    assert {(o.kind, o.key) for o in ops} == {(UPLOAD, "b"), (DELETE, "a")}
    assert ps.take() is None
    for o in ops:
        ps.done(o)
    assert ps.idle()
