"""The watcher when inotify is scarce or the tree is unkind: limits used up (instances, watches,
shared by every process of a uid on a node), symlinks out of a root, a bind mount looping into it.

The watcher stays on ``watchfiles``: it watches each real directory non-recursively and degrades
to polling when a limit is used up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import Sidecar, disk_tree, json_lines, sidecar_cmd, sidecar_env, store_tree, wait_for, write_atomic
from tests.faults.faultkit import events, http_get, metrics

pytestmark = pytest.mark.faults


# -- inotify limits -------------------------------------------------------------------------------

def _userns_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                        "echo 1 > /proc/sys/user/max_inotify_instances"], capture_output=True)
    return r.returncode == 0


needs_userns = pytest.mark.skipif(not _userns_ok(), reason="needs unshare --user and a writable "
                                  "/proc/sys/user/max_inotify_* in the new user namespace")


class Limited(Sidecar):
    """The sidecar in a user namespace of its own with inotify ``limits`` (``/proc/sys/user``)."""

    def __init__(self, cwd: Path, limits: dict[str, int], *args: str, env: dict[str, str] | None = None,
                 unshare: tuple[str, ...] = ("--user", "--map-root-user"), setup: str = ""):
        self.cwd = Path(cwd)
        self.log_path = self.cwd.parent / f"sidecar-{time.monotonic_ns()}.log"
        self.logf = open(self.log_path, "wb")  # noqa: SIM115  (the child's log while it runs)
        script = setup + "".join(f"echo {v} > /proc/sys/user/{k} && " for k, v in limits.items()) + 'exec "$@"'
        self.proc = subprocess.Popen(
            ["unshare", *unshare, "sh", "-c", script, "sh", *sidecar_cmd(*args)],
            cwd=cwd, env=env or sidecar_env(), stdout=self.logf, stderr=subprocess.STDOUT, start_new_session=True)


def _assert_polling_said_so(sc: Sidecar, base: str) -> None:
    warned = wait_for(lambda: events(sc, "watch_polling"), 15, "the watch_polling warning")
    assert len(warned) == 1, warned
    status, body = http_get(base, "/readyz")
    assert status == 200 and "watch degraded" in body and "polling" in body, body
    assert metrics(base)["checkpoint_sidecar_watch_polling"] == 1


@needs_userns
@pytest.mark.parametrize("limits", [{"max_inotify_instances": 0}, {"max_inotify_watches": 3}],
                         ids=["instances", "watches"])
def test_used_up_inotify_limits_degrade_to_polling(work, limits):
    """No instance at all, or fewer watches than directories: the sidecar keeps mirroring by
    rescanning, says so once, in /readyz and in a gauge, and never fails."""
    work, store = work
    cps = work / ".checkpoints"
    for i in range(6):  # six directories: more than three watches
        write_atomic(cps / f"ctx{i}" / "a.json", b"before")
    sc = Limited(work, limits, "sync", "--store", str(store), "--http-addr", "127.0.0.1:0",
                 "--reconcile-interval", "0")
    try:
        base = "http://" + sc.wait_event("http_listening")["addr"]
        sc.wait_event("ready")
        _assert_polling_said_so(sc, base)
        write_atomic(cps / "ctx9" / "new.json", b"written while polling")
        write_atomic(cps / "ctx0" / "a.json", b"rewritten")
        (cps / "ctx1" / "a.json").unlink()
        wait_for(lambda: disk_tree(cps) == store_tree(store), 15, "changes mirrored by polling",
                 lambda: sc.log()[-2000:])
        assert sc.stop() == 0, sc.log()[-3000:]
        assert "Traceback" not in sc.log()
    finally:
        sc.kill()


@needs_userns
def test_run_keeps_its_host_when_inotify_is_used_up(work):
    """``run`` with no inotify instance left: the host runs, its exit code comes back, and what
    it wrote is flushed."""
    work, store = work
    code = ("import os, time\nos.makedirs('.checkpoints/c', exist_ok=True)\n"
            "while not os.path.exists('go'): time.sleep(0.02)\n"
            "open('.checkpoints/c/last.json', 'w').write('last')\nraise SystemExit(7)\n")
    sc = Limited(work, {"max_inotify_instances": 0}, "run", "--store", str(store), "--http-addr", "127.0.0.1:0",
                 "--", sys.executable, "-c", code)
    try:
        base = "http://" + sc.wait_event("http_listening")["addr"]
        sc.wait_event("child_started")
        wait_for(lambda: http_get(base, "/readyz")[0] == 200, 15, "ready")
        _assert_polling_said_so(sc, base)
        (work / "go").write_text("")
        assert sc.proc.wait(30) == 7, sc.log()[-3000:]
        assert store_tree(store) == {"c/last.json": b"last"}
    finally:
        sc.kill()


_ENGINE_PROBE = """
import json, os, sys
from watchfiles._rust_notify import RustNotify
dirs = sys.argv[1:]
out = {}
for ignore in (True, False):
    try:
        n = RustNotify(dirs, False, False, 300, False, ignore)
        n.close()
        out[str(ignore)] = "ok"
    except Exception as e:
        out[str(ignore)] = [type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e)]
print(json.dumps(out))
"""


def _probe_engine(limits: dict[str, int], dirs: list[str]) -> dict:
    script = "".join(f"echo {v} > /proc/sys/user/{k} && " for k, v in limits.items()) + 'exec "$@"'
    r = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh", sys.executable, "-c",
                        _ENGINE_PROBE, *dirs], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json_lines(r.stdout)[0]


@needs_userns
def test_how_the_engine_reports_used_up_limits(tmp_path):
    """What the watcher's detection rests on (watchfiles 1.x, notify 8): no instance left is a
    RuntimeError naming os error 24; a watch refused is an OSError only with
    ``ignore_permission_denied`` off, and is skipped silently with it on."""
    dirs = [str(tmp_path)] + [str(tmp_path / f"d{i}") for i in range(5)]
    for d in dirs[1:]:
        os.mkdir(d)
    none = _probe_engine({"max_inotify_instances": 0}, dirs)
    for ignore in ("True", "False"):
        name, mro, text = none[ignore]
        assert "RuntimeError" in mro and "os error 24" in text, none
    few = _probe_engine({"max_inotify_watches": 3}, dirs)
    assert few["True"] == "ok", few  # six directories, three watches: nothing said
    name, mro, text = few["False"]
    assert name == "OSError" and "watch limit reached" in text, few


def test_polling_gives_way_to_inotify_when_it_is_back(tmp_path, monkeypatch):
    """Polling retries inotify: once an instance can be made again, the watcher leaves the
    degraded state (readiness note, gauge), rescans once and reports writes as events again."""
    from functools import partial

    import anyio
    from watchfiles._rust_notify import WatchfilesRustInternalError

    import sidecar.watcher as watcher_mod
    from sidecar import metrics as metrics_mod
    from sidecar.health import Health
    from sidecar.paths import make_roots

    cps = tmp_path / ".checkpoints"
    cps.mkdir()
    roots = make_roots([str(cps)], str(tmp_path))
    real_notify = watcher_mod.RustNotify
    calls = []

    def notify(*args):
        calls.append(args)
        if len(calls) == 1:  # as the engine says it when no instance is left
            raise WatchfilesRustInternalError("Error creating recommended watcher: Too many open files (os error 24)")
        return real_notify(*args)

    monkeypatch.setattr(watcher_mod, "RustNotify", notify)
    monkeypatch.setattr(watcher_mod, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(watcher_mod, "POLL_RETRY_SECONDS", 0.3)
    reported, rescans, states = [], [], []
    health = Health()

    async def on_paths(paths):
        reported.extend(os.path.basename(p) for p in paths)

    async def on_roots_changed(changed):
        rescans.append((health.polling and health.polling.reason, [r.name for r in changed]))

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(partial(watcher_mod.watch, on_polling=health.watch_polling), roots, on_paths, on_roots_changed)
            states.append((health.polling and health.polling.reason, metrics_mod.WATCH_POLLING._value.get()))
            with anyio.fail_after(10):
                while health.polling is not None or len(calls) < 2:
                    await anyio.sleep(0.01)
                states.append((health.polling, metrics_mod.WATCH_POLLING._value.get()))
                write_atomic(cps / "a.json", b"a")
                while "a.json" not in reported:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(main)
    (reason, gauge), (after, gauge_after) = states
    assert "max_user_instances" in reason and gauge == 1
    assert after is None and gauge_after == 0
    polled = [r for r in rescans if r[0] is not None]
    assert polled and all(names == [".checkpoints"] for _, names in polled)
    assert rescans[-1] == (None, [".checkpoints"])  # once, when inotify watched again


# -- symlinks out of a root -----------------------------------------------------------------------

def inotify_watches(pid: int) -> int:
    """The inotify watches process ``pid`` holds (``inotify wd:`` lines of its fdinfo)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                n += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            continue
    return n


def test_a_symlink_to_a_big_tree_outside_adds_no_watch(work, tmp_path):
    """``ln -s /usr .checkpoints/x`` used to add a watch per directory of /usr. The watches are
    the real directories of the roots only, and writes under the roots are still mirrored."""
    work, store = work
    cps = work / ".checkpoints"
    big = tmp_path / "big"
    for i in range(300):
        (big / f"d{i // 30}" / f"e{i}").mkdir(parents=True)
    write_atomic(cps / "ctx" / "a.json", b"a")
    os.symlink(big, cps / "x")
    os.symlink(big, cps / "ctx" / "y")
    sc = Sidecar(work, "sync", "--store", str(store))
    try:
        sc.wait_event("ready")
        # .checkpoints, .checkpoints/ctx; .function_approvals does not exist
        wait_for(lambda: inotify_watches(sc.proc.pid) == 2, 10, "two watches",
                 lambda: f": {inotify_watches(sc.proc.pid)}")
        write_atomic(cps / "ctx" / "new" / "b.json", b"b")  # a new real directory is watched
        wait_for(lambda: store_tree(store) == {"ctx/a.json": b"a", "ctx/new/b.json": b"b"}, 10, "mirrored")
        wait_for(lambda: inotify_watches(sc.proc.pid) == 3, 10, "three watches")
        (big / "d0" / "outside.json").write_bytes(b"o")  # through the link: nothing happens
        write_atomic(cps / "ctx" / "c.json", b"c")
        wait_for(lambda: "ctx/c.json" in store_tree(store), 10, "c mirrored")
        assert set(store_tree(store)) == {"ctx/a.json", "ctx/new/b.json", "ctx/c.json"}
        assert inotify_watches(sc.proc.pid) == 3
        assert sc.stop() == 0
    finally:
        sc.kill()


def _mountns_ok() -> bool:
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        "mount -t tmpfs none /mnt"], capture_output=True) if shutil.which("unshare") else None
    return r is not None and r.returncode == 0


@pytest.mark.skipif(not _mountns_ok(), reason="needs root and unshare --mount")
def test_a_bind_mount_looping_into_a_root_is_walked_once(work):
    """A root's parent bind-mounted inside the root (a loop no symlink check sees): the walk
    watches each directory once and ends, and writes are mirrored."""
    work, store = work
    cps = work / ".checkpoints"
    write_atomic(cps / "ctx" / "a.json", b"a")
    (cps / "loop").mkdir()
    sc = Limited(work, {}, "sync", "--store", str(store), "--ignore", "loop", unshare=("--mount", "--propagation",
                 "private"), setup=f"mount --bind {work} {cps / 'loop'} && ")
    try:
        sc.wait_event("ready", 30)
        wait_for(lambda: inotify_watches(sc.proc.pid) <= 4, 10, "each directory watched once",
                 lambda: f": {inotify_watches(sc.proc.pid)}")
        write_atomic(cps / "ctx" / "b.json", b"b")
        wait_for(lambda: store_tree(store).get("ctx/b.json") == b"b", 10, "b mirrored")
        assert sc.stop() == 0
    finally:
        sc.kill()


# -- closed stdio ---------------------------------------------------------------------------------

