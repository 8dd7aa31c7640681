"""The default store never mixes projects (issue #33, item 7): with no ``SIDECAR_STORE`` and no
``SIDECAR_PREFIX``, each project (the directory holding its roots) keeps its state in a namespace
of its own, ``local/<name>-<hash>``, of the shared ``$XDG_STATE_HOME/checkpoint-sidecar/store``;
state stored at the top before that is found (``legacy_state_found``) with the command that
adopts it. In process, but one process test for the ``store`` line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import anyio
import pytest

from sidecar import lifecycle
from sidecar.config import load
from sidecar.store import registry
from sidecar.store.base import ObjectMeta
from support import disk_tree, json_lines, run_cli, sidecar_env
from tests.inprocess import InProcess, run_sync

pytestmark = pytest.mark.anyio


def project(tmp_path: Path, name: str) -> Path:
    work = tmp_path / "projects" / name
    (work / ".checkpoints").mkdir(parents=True)
    return work


def env_of(tmp_path: Path, **variables: str) -> dict[str, str]:
    """A laptop's environment: no SIDECAR_STORE, the state directory in the test's."""
    env = sidecar_env(XDG_STATE_HOME=str(tmp_path / "state"), HOME=str(tmp_path / "home"), **variables)
    for k in ("SIDECAR_STORE", "SIDECAR_PREFIX", "FOUNDRY_AGENT_SESSION_ID", "FOUNDRY_AGENT_NAME",
              "KUBERNETES_SERVICE_HOST", "CONTAINER_APP_NAME", "FOUNDRY_HOSTING_ENVIRONMENT"):
        if k not in variables:
            env.pop(k, None)
    return env


def default_store(tmp_path: Path) -> Path:
    return tmp_path / "state" / "checkpoint-sidecar" / "store"


def test_each_project_has_a_namespace_of_its_own_on_the_default_store(tmp_path):
    a, b = project(tmp_path, "app"), project(tmp_path / "other", "app")  # two projects, one name
    (ns_a, ns_b) = (load({}, cwd=str(w), env=env_of(tmp_path))[0].namespace for w in (a, b))
    digest = hashlib.sha256(str(a).encode()).hexdigest()[:8]
    assert ns_a.path == f"local/app-{digest}" and ns_a.project == str(a) and ns_a.legacy == ""
    assert ns_b.path.startswith("local/app-") and ns_b.path != ns_a.path
    assert load({}, cwd=str(a), env=env_of(tmp_path))[0].namespace == ns_a  # stable
    assert not ns_a.identity
    assert ns_a.describe() == f"{ns_a.path} (the default store's namespace for {a})"

    # nothing changes when the store or the prefix is set (an empty prefix names the top)
    store = str(default_store(tmp_path))
    assert load({}, cwd=str(a), env=env_of(tmp_path, SIDECAR_STORE=store))[0].namespace.path == ""
    assert load({"store": store}, cwd=str(a), env=env_of(tmp_path))[0].namespace.path == ""
    assert load({}, cwd=str(a), env=env_of(tmp_path, SIDECAR_PREFIX=""))[0].namespace.path == ""
    assert load({}, cwd=str(a), env=env_of(tmp_path, SIDECAR_PREFIX="mine"))[0].namespace.path == "mine"
    assert load({"prefix": "mine"}, cwd=str(a), env=env_of(tmp_path))[0].namespace.path == "mine"
    # nor where a session names its namespace (the store must be set there anyway)
    sess = load({}, cwd=str(a), env=env_of(tmp_path, SIDECAR_STORE=store, FOUNDRY_AGENT_SESSION_ID="s1"))[0]
    assert sess.namespace.path == "_/s1" and not sess.namespace.project


async def test_run_in_another_project_restores_nothing_of_the_first(tmp_path):
    """The issue's case: ``run`` in project A stores ``ctxA/a.json``; ``run`` in an unrelated
    project B (empty ``.checkpoints``) must not restore it."""
    a, b = project(tmp_path, "a"), project(tmp_path, "b")
    settings, roots = load({}, cwd=str(a), env=env_of(tmp_path))
    store = registry.make_store(settings.store_url, settings.namespace.path)

    async def write(life: InProcess) -> None:
        (a / ".checkpoints" / "ctxA").mkdir()
        (a / ".checkpoints" / "ctxA" / "a.json").write_text("A's checkpoint")
        with anyio.fail_after(20):
            while not [i async for i in life.store.list(".checkpoints/")]:
                await anyio.sleep(0.01)  # a poll's pace: until mirrored

    assert await run_sync(InProcess(settings, roots, store), write) == 0
    assert (default_store(tmp_path) / settings.namespace.path / ".checkpoints" / "ctxA" / "a.json").exists()

    settings_b, roots_b = load({}, cwd=str(b), env=env_of(tmp_path))
    assert await lifecycle.restore(settings_b, roots_b) == 0
    assert disk_tree(b / ".checkpoints") == {}
    # and A, recreated, gets its own back
    (a / ".checkpoints" / "ctxA" / "a.json").unlink()
    (a / ".checkpoints" / "ctxA").rmdir()
    assert await lifecycle.restore(settings, roots) == 0
    assert disk_tree(a / ".checkpoints") == {"ctxA/a.json": b"A's checkpoint"}


async def test_state_at_the_top_of_the_default_store_is_found_and_adopted(tmp_path, caplog):
    """An upgrade: the state a release without project namespaces stored at the top of the default
    store is not restored unasked (it may be any project's), but found, with the command that
    adopts it; that command restores it."""
    top = registry.make_store(str(default_store(tmp_path)), "")
    await top.open()
    data = b"before the upgrade"
    await top.put(".checkpoints/r/x.json", data, ObjectMeta.of(data, 1, 0o600, version=1))
    await top.aclose()
    work = project(tmp_path, "app")
    settings, roots = load({}, cwd=str(work), env=env_of(tmp_path))

    assert await lifecycle.restore(settings, roots) == 0
    assert disk_tree(work / ".checkpoints") == {}
    [found] = [r.fields for r in caplog.records if r.getMessage() == "legacy_state_found"]  # type: ignore[attr-defined]
    assert found["namespace"] == settings.namespace.path and found["roots"] == ".checkpoints"
    hint = f"SIDECAR_STORE={default_store(tmp_path)} checkpoint-sidecar restore"
    assert hint in found["detail"], found

    adopt, adopt_roots = load({}, cwd=str(work), env=env_of(tmp_path, SIDECAR_STORE=str(default_store(tmp_path))))
    assert await lifecycle.restore(adopt, adopt_roots) == 0
    assert disk_tree(work / ".checkpoints") == {"r/x.json": data}


def test_the_store_line_names_the_projects_namespace(tmp_path):
    work = project(tmp_path, "app")
    r = run_cli("restore", cwd=work, env=env_of(tmp_path))
    assert r.returncode == 0, r.stderr
    [line] = [e for e in json_lines(r.stderr) if e.get("event") == "store"]
    assert line["namespace"].startswith("local/app-") and f"the default store's namespace for {work}" in line["namespace"]
