"""Configuration mistakes through the real CLI (``python -m sidecar``): one stderr line per
problem, exit 2, never a traceback; flags per command; no abbreviations; help per command."""

from __future__ import annotations

import sys

import pytest

from sidecar.config import SETTING_NAMES
from tests.support import json_lines, run_cli, sidecar_env
from tests.unit.test_config_hostile import ACCEPTED, HOSTILE

PREFIX = "checkpoint-sidecar: config error: "


def config_errors(r) -> dict[str, str]:
    """``{variable: what is wrong}`` from a run that must have failed on its configuration."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert lines and all(line.startswith(PREFIX) for line in lines), r.stderr
    out = dict(line.removeprefix(PREFIX).split(": ", 1) for line in lines)
    assert len(out) == len(lines), r.stderr  # one line per problem, one problem per variable
    return out


def env_for(tmp_path, **variables: str) -> dict[str, str]:
    env = sidecar_env(SIDECAR_STORE=str(tmp_path / "store"), HOME=str(tmp_path / "home"),
                      XDG_STATE_HOME=str(tmp_path / "state"))
    env.update(variables)
    return env


# Values an environment can carry (NUL cannot: the unit sweep has it).
SWEEP = [k for k in HOSTILE if "\x00" not in HOSTILE[k] and not any(0xD800 <= ord(c) < 0xE000 for c in HOSTILE[k])]


@pytest.mark.parametrize("kind", SWEEP)
def test_every_setting_with_a_hostile_value_is_one_line_each(kind, tmp_path):
    """Every setting set to the same hostile value at once: every refused one is reported, one
    line each, in one run."""
    work = tmp_path / "work"
    work.mkdir()
    value = HOSTILE[kind]
    env = env_for(tmp_path, **{f"SIDECAR_{n.upper()}": value for n in SETTING_NAMES})
    errors = config_errors(run_cli("restore", cwd=work, env=env))
    assert set(errors) == {f"SIDECAR_{n.upper()}" for n in SETTING_NAMES if n not in ACCEPTED[kind]}
    assert all(len(why) < 300 for why in errors.values()), errors


@pytest.mark.parametrize("store, http_addr, prefix", [
    ("file://relative/x", ":99999", "p" * 2000),
    ("file://host/x", "host:", None),
    ("file:///%00x", "[::1", None),
])
def test_known_offenders_are_one_line_and_exit_2(store, http_addr, prefix, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = env_for(tmp_path, SIDECAR_STORE=store, SIDECAR_HTTP_ADDR=http_addr)
    if prefix is not None:
        env["SIDECAR_PREFIX"] = prefix
    errors = config_errors(run_cli("restore", cwd=work, env=env))
    assert set(errors) == {"SIDECAR_STORE", "SIDECAR_HTTP_ADDR"} | ({"SIDECAR_PREFIX"} if prefix else set())
    assert http_addr in errors["SIDECAR_HTTP_ADDR"]


def test_a_typo_in_a_variable_and_an_unset_store_on_a_platform_are_refused(tmp_path):
    """No silent default store: ``SIDECAR_STOR`` names no setting, and on a container platform
    the default store would sit on the container's own disk."""
    work = tmp_path / "work"
    work.mkdir()
    env = env_for(tmp_path, SIDECAR_STOR=str(tmp_path / "meant"), KUBERNETES_SERVICE_HOST="10.0.0.1")
    del env["SIDECAR_STORE"]
    errors = config_errors(run_cli("sync", cwd=work, env=env))
    assert errors["SIDECAR_STOR"] == "not a checkpoint-sidecar setting (did you mean SIDECAR_STORE?)"
    assert "KUBERNETES_SERVICE_HOST" in errors["SIDECAR_STORE"]
    assert len(errors) == 2
    assert not (tmp_path / "state").exists() and not (tmp_path / "meant").exists()


def test_flags_are_never_abbreviated_and_usage_errors_are_one_line(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = env_for(tmp_path)
    for args, hint in [
        (("restore", "--stor", str(tmp_path / "elsewhere")), "did you mean --store?"),
        (("status", "--drain-timeout", "3"), "--drain-timeout is not an option of status, only of run, sync"),
        (("probe", "ready", "--store", "x"), "--store is not an option of probe"),
        (("probe", "ready", "--timeout", "nan"), "argument --timeout"),
    ]:
        r = run_cli(*args, cwd=work, env=env)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and hint in lines[0] and "usage error" in lines[0], (args, r.stderr)
    assert not (tmp_path / "elsewhere").exists()


def test_each_command_lists_only_its_flags_with_variables_defaults_and_exit_codes(tmp_path):
    r = run_cli("probe", "--help", cwd=tmp_path, env=env_for(tmp_path))
    assert r.returncode == 0, r.stderr
    usage = r.stdout.split("\n\n", 1)[0]
    flags = {w.strip("[],") for w in usage.split() if w.startswith(("--", "[--"))}
    text = " ".join(r.stdout.split())
    assert {f.split("=")[0] for f in flags} == {"--http-addr", "--log-level", "--log-format", "--timeout"}
    assert "(SIDECAR_HTTP_ADDR; default: 127.0.0.1:7479)" in text
    assert "exit codes of probe: 0 ready/live; 1 not" in text
    assert "75" not in text and "run:" not in text  # the generic table, another command's codes: not here


def test_a_variable_of_another_command_is_fine_in_the_environment(tmp_path):
    """Flags are per command, the environment is shared: status ignores SIDECAR_DRAIN_TIMEOUT."""
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    env = env_for(tmp_path, SIDECAR_DRAIN_TIMEOUT="30", SIDECAR_CONCURRENCY="4")
    (tmp_path / "store").mkdir()
    r = run_cli("status", cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert "in sync" in r.stdout


def test_status_creates_no_store(tmp_path):
    """``status`` only reads: a store that does not exist is one line, exit 1, and is not made."""
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    env = env_for(tmp_path)
    del env["SIDECAR_STORE"]  # the default, under XDG_STATE_HOME
    (work / ".checkpoints" / "a.json").write_text("{}")
    for args in ((), ("--json",)):  # never "in sync", nor "a.json pending upload", with no store at all
        r = run_cli("status", *args, cwd=work, env=env)
        assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
        (line,) = r.stderr.splitlines()
        assert str(tmp_path / "state") in line and line.endswith(" is not there: check SIDECAR_STORE"), line
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("command", ["restore", "sync", "run"])
def test_a_directory_store_that_is_not_there_on_a_platform_is_refused_and_never_made(command, tmp_path):
    """A volume that was never mounted, or a typo (``/mnt/durabel``): the store would be made on
    the container's own disk, mirrored onto a disk that dies with the compute, and ``restore``
    would answer "nothing stored" like a first boot."""
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    (work / ".checkpoints" / "a.json").write_text("{}")
    store = tmp_path / "mnt" / "durabel"
    env = env_for(tmp_path, SIDECAR_STORE=str(store), KUBERNETES_SERVICE_HOST="10.0.0.1")
    args = ["run", "--", sys.executable, "-c", "open('child-ran', 'w')"] if command == "run" else [command]
    errors = config_errors(run_cli(*args, cwd=work, env=env, timeout=30))
    assert list(errors) == ["SIDECAR_STORE"]
    assert errors["SIDECAR_STORE"].startswith(f"the directory store {store} does not exist, and "
                                              "KUBERNETES_SERVICE_HOST says this runs on a container platform")
    assert "must be a mounted volume" in errors["SIDECAR_STORE"]
    assert not (tmp_path / "mnt").exists() and not (work / "child-ran").exists()


def test_off_a_platform_a_missing_store_is_made_and_on_one_a_mounted_store_warns_on_the_roots_disk(tmp_path):
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    (work / ".checkpoints" / "a.json").write_text("{}")
    env = env_for(tmp_path)
    r = run_cli("run", "--", sys.executable, "-c", "pass", cwd=work, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "store" / ".checkpoints" / "a.json").exists()  # made, and mirrored
    assert "store_on_root_filesystem" not in r.stderr
    r = run_cli("restore", cwd=work, env={**env, "CONTAINER_APP_NAME": "app"}, timeout=60)  # now it exists
    assert r.returncode == 0, r.stderr
    warned = [e for e in json_lines(r.stderr) if e.get("event") == "store_on_root_filesystem"]
    assert len(warned) == 1 and warned[0]["store"] == str(tmp_path / "store"), r.stderr
    assert warned[0]["roots"] == f"{work / '.checkpoints'},{work / '.function_approvals'}"


def test_on_a_platform_a_store_on_the_containers_own_disk_warns(tmp_path):
    """The image's mkdir'd mount point, not mounted over: the same filesystem as ``/``."""
    import os

    if os.stat("/").st_dev != os.stat(tmp_path).st_dev:
        pytest.skip("the test directory is not on the root filesystem")
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    (tmp_path / "store").mkdir()
    env = env_for(tmp_path, KUBERNETES_SERVICE_HOST="10.0.0.1")
    for command in ("restore", "status"):
        r = run_cli(command, cwd=work, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        warned = [e for e in json_lines(r.stderr) if e.get("event") == "store_on_container_disk"]
        assert len(warned) == 1 and warned[0]["store"] == str(tmp_path / "store"), r.stderr
        assert "a mounted volume is expected" in warned[0]["detail"]
    r = run_cli("restore", cwd=work, env=env_for(tmp_path), timeout=60)  # off a platform: no warning
    assert r.returncode == 0 and "store_on_container_disk" not in r.stderr, r.stderr


def test_kubelet_service_links_never_fail_the_start(tmp_path):
    """A Service named ``sidecar`` in the namespace puts SIDECAR_SERVICE_HOST, SIDECAR_PORT... into
    every container (enableServiceLinks defaults to true): each one is the platform's."""
    work = tmp_path / "work"
    (work / ".checkpoints").mkdir(parents=True)
    (tmp_path / "store").mkdir()
    links = {"SIDECAR_SERVICE_HOST": "10.0.0.7", "SIDECAR_SERVICE_PORT": "80", "SIDECAR_SERVICE_PORT_HTTP": "80",
             "SIDECAR_PORT": "tcp://10.0.0.7:80", "SIDECAR_PORT_80_TCP": "tcp://10.0.0.7:80",
             "SIDECAR_PORT_80_TCP_PROTO": "tcp", "SIDECAR_PORT_80_TCP_PORT": "80", "SIDECAR_PORT_80_TCP_ADDR": "10.0.0.7"}
    env = env_for(tmp_path, KUBERNETES_SERVICE_HOST="10.0.0.1", **links)
    r = run_cli("run", "--", sys.executable, "-c", "open('child-ran', 'w')", cwd=work, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (work / "child-ran").exists()
    errors = config_errors(run_cli("sync", cwd=work, env={**env, "SIDECAR_STOR": "x"}))  # typos still are
    assert list(errors) == ["SIDECAR_STOR"]
    # a link's name with a value kubelet never writes (its <NAME>_PORT is tcp://<ip>:<port>): a typo
    errors = config_errors(run_cli("sync", cwd=work, env={**env, "SIDECAR_HTTP_PORT": "9090"}))
    assert list(errors) == ["SIDECAR_HTTP_PORT"]


def test_one_setting_named_twice_in_different_cases_is_one_line(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = env_for(tmp_path, sidecar_store=str(tmp_path / "other"))
    errors = config_errors(run_cli("sync", cwd=work, env=env))
    assert errors == {"SIDECAR_STORE": "set 2 times, as SIDECAR_STORE and sidecar_store (names differing only in "
                                       "case): keep one"}
    assert not (tmp_path / "store").exists() and not (tmp_path / "other").exists()


def test_a_template_naming_a_credential_is_refused_without_its_value(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    secret = "Zm9vYmFyLXNlY3JldC1rZXk+/bGFzdA=="
    for name in ("AZURE_STORAGE_KEY", "AZURE_CLIENT_SECRET"):
        env = env_for(tmp_path, SIDECAR_PREFIX=f"agents/{{{name}}}", **{name: secret})
        r = run_cli("sync", cwd=work, env=env)
        errors = config_errors(r)
        assert list(errors) == ["SIDECAR_PREFIX"] and errors["SIDECAR_PREFIX"].startswith(f"refers to {{{name}}}, a cred")
        assert secret[:6] not in r.stderr + r.stdout
    assert not (tmp_path / "store").exists()


def test_a_session_id_ending_in_a_newline_is_refused(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "store").mkdir()
    env = env_for(tmp_path, FOUNDRY_AGENT_NAME="agent", FOUNDRY_AGENT_SESSION_ID="s1\n")
    errors = config_errors(run_cli("sync", cwd=work, env=env))
    assert list(errors) == ["FOUNDRY_AGENT_SESSION_ID"] and "not a safe name segment" in errors["FOUNDRY_AGENT_SESSION_ID"]
    assert list((tmp_path / "store").iterdir()) == []
