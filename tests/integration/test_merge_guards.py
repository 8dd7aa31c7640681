"""What a merge (a disk with files but no record of this namespace) must leave alone.

Real ``run`` / ``sync`` processes against real files and the directory store:

* a stored object the restore refuses (too large) or sets aside (corrupt) is never overwritten
  by the local file found at its path (an image's stale copy): only once the host writes that
  file is it mirrored;
* a root named like a session namespace nested in this one never reads, writes or deletes that
  namespace's own records (``.sidecar/``, ``.sidecar-meta/``);
* a disk recorded by another namespace is merged with a warning naming both.
"""

from __future__ import annotations

from support import run_cli, sidecar_env, write_atomic


def test_a_disk_recorded_by_another_namespace_is_merged_with_a_warning(tmp_path):
    work = tmp_path / "work"
    write_atomic(work / ".checkpoints" / "mine.json", b"ns1's")
    env1 = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_PREFIX="ns1")
    assert run_cli("run", "--", "true", cwd=work, env=env1).returncode == 0
    env2 = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), SIDECAR_PREFIX="ns2")
    r = run_cli("run", "--", "true", cwd=work, env=env2)
    assert r.returncode == 0, r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if '"lineage_other"' in ln]
    assert '"recorded_namespace": "ns1"' in line and '"namespace": "ns2"' in line, line
    assert f'"recorded_store": "file://{tmp_path / "store" / "ns1"}"' in line, line
    # text logs escape what the record names (it is read from a disk, untrusted)
    (work / ".checkpoints" / ".sidecar-lineage").write_text('{"store": "evil\\nforged", "namespace": "x\\u001b[2J"}')
    r = run_cli("restore", cwd=work, env={**env2, "SIDECAR_LOG_FORMAT": "text"})
    assert r.returncode == 0, r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if "lineage_other" in ln]
    assert "evil\\nforged" in line and "x\\x1b[2J" in line and "\x1b" not in line, line
