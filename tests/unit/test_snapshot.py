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
