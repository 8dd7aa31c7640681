"""localfs's restore writes against real directories: symlinks, evicted descriptors."""

from __future__ import annotations

import contextlib
import os

import pytest

from sidecar.localfs import UnsafeTarget
from sidecar.paths import Root
from sidecar.restorefs import OpenDirs, write_restored
from support import checkpoints_root_with_a_link_out, disk_tree


def test_open_dirs_writes_where_the_uncached_walk_does_and_bounds_its_descriptors(tmp_path):
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    dirs = OpenDirs(limit=3)

    def open_here() -> int:
        """Descriptors of this process open on something under tmp_path (other threads' own
        descriptors, left by earlier tests, come and go on their own)."""
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
        return n

    try:
        for i in range(12):
            write_restored(root, [f"c{i % 5}", "deep", f"{i}.json"], b"%d" % i, 1, 0o600, None, dirs)
            assert len(dirs._fds) <= 3
            assert open_here() <= 3
    finally:
        dirs.close()
    assert open_here() == 0
    assert disk_tree(tmp_path) == {f"w/.checkpoints/c{i % 5}/deep/{i}.json": b"%d" % i for i in range(12)}


def test_open_dirs_never_walks_through_a_symlink(tmp_path):
    root, outside = checkpoints_root_with_a_link_out(tmp_path)
    dirs = OpenDirs()
    try:
        with pytest.raises(UnsafeTarget):
            write_restored(root, ["ctx", "x.json"], b"x", 1, 0o600, None, dirs)
        write_restored(root, ["ok", "y.json"], b"y", 1, 0o600, None, dirs)
    finally:
        dirs.close()
    assert list(outside.iterdir()) == []
    assert (tmp_path / "w/.checkpoints/ok/y.json").read_bytes() == b"y"


def test_a_directory_where_a_restored_file_goes_is_refused_and_left_as_it_was(tmp_path):
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    (tmp_path / "w/.checkpoints/ctx/x.json").mkdir(parents=True)
    (tmp_path / "w/.checkpoints/ctx/x.json/kept").write_bytes(b"k")
    for dirs in (None, OpenDirs()):
        with pytest.raises(UnsafeTarget, match="ctx/x.json is a directory on disk"):
            write_restored(root, ["ctx", "x.json"], b"x", 1, 0o600, None, dirs)
        if dirs is not None:
            dirs.close()
    # no temp file left behind, the directory and its content untouched
    assert os.listdir(tmp_path / "w/.checkpoints/ctx") == ["x.json"]
    assert os.listdir(tmp_path / "w/.checkpoints/ctx/x.json") == ["kept"]
    assert (tmp_path / "w/.checkpoints/ctx/x.json/kept").read_bytes() == b"k"


def test_a_symlink_where_a_restored_file_goes_is_replaced_not_followed(tmp_path):
    root = Root(".checkpoints", str(tmp_path / "w" / ".checkpoints"))
    (tmp_path / "w/.checkpoints/ctx").mkdir(parents=True)
    outside = tmp_path / "outside.json"
    outside.write_bytes(b"outside")
    (tmp_path / "w/.checkpoints/ctx/x.json").symlink_to(outside)
    write_restored(root, ["ctx", "x.json"], b"restored", 1, 0o600)
    assert outside.read_bytes() == b"outside"
    assert not (tmp_path / "w/.checkpoints/ctx/x.json").is_symlink()
    assert (tmp_path / "w/.checkpoints/ctx/x.json").read_bytes() == b"restored"
