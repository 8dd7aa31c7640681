"""The start-up path stays light: the restore (what ``run`` does before it starts its child, with
its health listener up), and a ``/readyz`` answered while it runs, load neither the watcher, the uploader nor the metrics
library (prometheus-client): those come with mirroring, after the host has started. With an account
key the Azure restore loads no azure-identity (nor msal); the command line adds only the flags of
the command being run; building the settings model parses no builtin's signature text (the
tokenizer: bench/RESULTS.md, "Start path")."""

from __future__ import annotations

import json
import subprocess
import sys

from support import REPO, sidecar_env, write_atomic

HEAVY = ("sidecar.watcher", "sidecar.uploader", "watchfiles", "prometheus_client")

SCRIPT = r"""
import json, sys, threading, urllib.request
from sidecar.restore import latest

seen = {}
real = latest._Restore.work

async def work(self, receive):  # a /readyz while the restore runs, from another thread
    if not seen:
        seen["readyz"] = None
        def ask():
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            try:
                seen["readyz"] = opener.open("http://" + sys.argv[1] + "/readyz", timeout=5).status
            except Exception as e:
                seen["readyz"] = getattr(e, "code", repr(e))
        t = threading.Thread(target=ask)
        t.start()
        import anyio
        await anyio.to_thread.run_sync(t.join)
    return await real(self, receive)

latest._Restore.work = work

import anyio
from sidecar.config import load
from sidecar.daemon import Daemon
from sidecar.http import serve
from sidecar.store import make_store

settings, roots = load({"http_addr": sys.argv[1]})
store = make_store(settings.store, settings.namespace.path)

async def main():  # what sync and run do up to the restore's end, the health listener up
    daemon = Daemon(settings, roots, store)
    async with anyio.create_task_group() as tg:
        await tg.start(serve, settings, daemon.health)
        await daemon.prepare()
        tg.cancel_scope.cancel()
    await store.aclose()

anyio.run(main)
code = 0
print(json.dumps({"code": code, "readyz": seen.get("readyz"),
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("sidecar", "watchfiles", "prometheus_client"))}))
"""


def test_restore_and_a_readyz_during_it_load_nothing_of_mirroring(tmp_path):
    import socket

    store = tmp_path / "store"
    src = tmp_path / "src"
    write_atomic(src / ".checkpoints" / "c.json", b"x")
    env = sidecar_env(SIDECAR_STORE=str(store))
    assert subprocess.run([sys.executable, "-m", "sidecar", "run", "--", "true"], cwd=src, env=env).returncode == 0

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = subprocess.run([sys.executable, "-c", SCRIPT, addr], cwd=fresh, env={**env, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["code"] == 0 and out["readyz"] == 503, out  # 503: still restoring
    assert (fresh / ".checkpoints" / "c.json").read_bytes() == b"x"
    assert [m for m in out["loaded"] if m.startswith(HEAVY)] == [], out["loaded"]


KEY_SCRIPT = r"""
import json, sys, tokenize
from sidecar.cli import main

code = main(["restore"])
print(json.dumps({"code": code, "loaded": sorted(sys.modules),
                  # a builtin's signature parsed from its text compiles the tokenizer's patterns
                  "tokenized": tokenize._compile.cache_info().currsize if hasattr(tokenize, "_compile") else 0}))
"""

#: What a restore with an account key never needs: the token credential's packages, mirroring.
KEY_PATH_HEAVY = HEAVY + ("azure.identity", "msal", "sidecar.http")


def test_key_path_restore_loads_no_identity_library_and_tokenizes_nothing(tmp_path, azurite):
    from tests.azurite import unique_container

    store = azurite.container_url(unique_container("start"))
    env = sidecar_env(SIDECAR_STORE=store, **azurite.env())
    env = {k: v for k, v in env.items() if not k.startswith(("IDENTITY_", "MSI_"))}
    src = tmp_path / "src"
    write_atomic(src / ".checkpoints" / "c.json", b"x")
    r = subprocess.run([sys.executable, "-m", "sidecar", "run", "--", "true"], cwd=src, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    r = subprocess.run([sys.executable, "-c", KEY_SCRIPT], cwd=fresh, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["code"] == 0 and (fresh / ".checkpoints" / "c.json").read_bytes() == b"x"
    assert "azure.storage.blob.aio" in out["loaded"]  # the restore did go through the SDK
    assert [m for m in out["loaded"] if m.startswith(KEY_PATH_HEAVY)] == [], out["loaded"]
    assert out["tokenized"] == 0


def test_the_command_line_builds_only_the_flags_of_the_command_run():
    from sidecar.cli import COMMAND_SETTINGS, _command_in, build_parser

    def flags(p):
        return {o for a in p._actions for o in a.option_strings if o.startswith("--")}

    assert _command_in(["restore", "--store", "x"]) == "restore"
    assert _command_in(["--help"]) == _command_in([]) == _command_in(["bogus"]) == ""
    parser = build_parser("restore")
    assert "--store" in flags(parser.commands["restore"])
    assert [c for c, p in parser.commands.items() if c != "restore" and flags(p) & {"--store", "--log-level"}] == []
    full = build_parser()  # every command's flags: the docs and the tests read them
    assert all("--log-level" in flags(full.commands[c]) for c in COMMAND_SETTINGS)
