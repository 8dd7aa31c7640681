import pytest

from sidecar.config import ConfigError, load


def test_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    s, roots = load({}, cwd=str(tmp_path))
    assert [r.path for r in roots] == [str(tmp_path / ".checkpoints"), str(tmp_path / ".function_approvals")]
    assert s.store.startswith(str(tmp_path / "home"))
    assert s.prefix == ""


def test_env_and_flags_flags_win(monkeypatch, tmp_path):
    monkeypatch.setenv("SIDECAR_ROOTS", "a, b")
    monkeypatch.setenv("SIDECAR_PREFIX", "from-env")
    monkeypatch.setenv("SIDECAR_STORE", str(tmp_path / "store"))
    s, roots = load({"prefix": "from-flag"}, cwd=str(tmp_path))
    assert [r.name for r in roots] == ["a", "b"]
    assert s.prefix == "from-flag"


def test_every_problem_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("SIDECAR_CONCURRENCY", "zero")
    monkeypatch.setenv("SIDECAR_STORE", "ftp://nope")
    with pytest.raises(ConfigError) as e:
        load({}, cwd=str(tmp_path))
    assert len(e.value.problems) == 2
    assert all("\n" not in p for p in e.value.problems)
    assert any(p.startswith("SIDECAR_CONCURRENCY") for p in e.value.problems)
    assert any(p.startswith("SIDECAR_STORE") for p in e.value.problems)


def test_store_inside_a_root_refused(tmp_path):
    with pytest.raises(ConfigError, match="overlaps"):
        load({"store": str(tmp_path / ".checkpoints" / "backup")}, cwd=str(tmp_path))
    with pytest.raises(ConfigError, match="overlaps"):  # a root inside the store is refused too
        load({"store": f"file://{tmp_path}", "roots": str(tmp_path / "x" / ".checkpoints")}, cwd=str(tmp_path))


def test_bad_prefix(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="SIDECAR_PREFIX"):
        load({"prefix": "a/../b", "store": str(tmp_path / "s")}, cwd=str(tmp_path))


def test_layouts(monkeypatch, tmp_path):
    monkeypatch.setenv("SIDECAR_STORE", str(tmp_path / "s"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AGENTSERVER_STATE_ROOT", raising=False)
    monkeypatch.delenv("FOUNDRY_HOSTING_ENVIRONMENT", raising=False)
    _, roots = load({"layout": "agentserver"}, cwd=str(tmp_path))
    assert [r.path for r in roots] == [str(tmp_path / "home" / ".agentserver")]
    monkeypatch.setenv("AGENTSERVER_STATE_ROOT", str(tmp_path / "state"))
    _, roots = load({"layout": "agentserver"}, cwd=str(tmp_path))
    assert [(r.name, r.path) for r in roots] == [("state", str(tmp_path / "state"))]
    monkeypatch.setenv("FOUNDRY_HOSTING_ENVIRONMENT", "1")
    _, roots = load({}, cwd=str(tmp_path))
    assert [r.path for r in roots] == ["/.checkpoints", "/.function_approvals"]
    _, roots = load({"layout": "agentserver", "roots": "x"}, cwd=str(tmp_path))  # explicit roots win
    assert [r.path for r in roots] == [str(tmp_path / "x")]
