"""A clean exit releases the namespace, even when the command ends before its claim has landed:
the next compute's sidecar then starts mirroring without waiting out a write window."""

from __future__ import annotations

import json

from support import json_lines, run_cli, sidecar_env


def test_a_command_that_ends_at_once_still_releases_the_namespace(tmp_path):
    store = tmp_path / "store"
    for attempt in range(3):  # the child's exit races the claim: try it a few times
        work = tmp_path / f"work{attempt}"
        work.mkdir()  # no roots yet: nothing to restore or upload, the child ends at once
        r = run_cli("run", "--store", str(store), "--", "true", cwd=work, env=sidecar_env())
        assert r.returncode == 0, r.stderr
        events = [e.get("event") for e in json_lines(r.stderr)]
        assert "fence_wait" not in events, f"start {attempt}: the previous sidecar left the namespace held"
        marker = json.loads((store / ".sidecar" / "owner").read_text())
        assert marker["heartbeat"] == 0, f"start {attempt}: not released: {marker}"
