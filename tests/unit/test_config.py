from pathlib import Path

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


def test_types_bounds_and_choices_one_line_each(tmp_path):
    env = {
        "sidecar_restore_optional": "Yes",  # names in any case, as before
        "SIDECAR_LOG_LEVEL": "DEBUG",
        "SIDECAR_IGNORE": " *.swp , ,x* ",
        "SIDECAR_DRAIN_TIMEOUT": "2.5",
        "SIDECAR_STORE": str(tmp_path / "s"),
    }
    s, _ = load({"concurrency": 3}, cwd=str(tmp_path), env=env)
    assert s.restore_optional is True and s.log_level == "debug" and s.ignore == ["*.swp", "x*"]
    assert s.drain_timeout == 2.5 and s.concurrency == 3 and s.fence_window == 2.0
    bad = {
        "SIDECAR_CONCURRENCY": "0", "SIDECAR_DEBOUNCE_MS": "1.5", "SIDECAR_FENCE_WINDOW": "0",
        "SIDECAR_RESTORE_OPTIONAL": "maybe", "SIDECAR_COMMIT": "sometimes", "SIDECAR_DRAIN_TIMEOUT": "nan",
        "SIDECAR_STORE": "  ",
    }
    with pytest.raises(ConfigError) as e:
        load({}, cwd=str(tmp_path), env=bad)
    lines = dict(p.split(": ", 1) for p in e.value.problems)
    assert lines == {
        "SIDECAR_CONCURRENCY": "must be at least 1; got 0",
        "SIDECAR_DEBOUNCE_MS": "must be a whole number, got '1.5'",
        "SIDECAR_FENCE_WINDOW": "must be more than 0; got 0",
        "SIDECAR_RESTORE_OPTIONAL": "must be true or false, got 'maybe'",
        "SIDECAR_COMMIT": "must be one of auto, per-file, snapshot; got 'sometimes'",
        "SIDECAR_DRAIN_TIMEOUT": "must be a finite number, got 'nan'",
        "SIDECAR_STORE": "must not be empty",
    }


def _readme_defaults() -> dict[str, str]:
    """``SIDECAR_X`` -> its default cell, from the settings table of docs/CONFIGURATION.md (a row
    may document two variables: `A` / `B` with defaults `1` / `2`)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md").read_text()
    table = doc.split("## Settings", 1)[1].split("\n\n| variable |", 1)[1].split("\n\n", 1)[0]
    out = {}
    for row in table.splitlines()[2:]:
        variables, default, _meaning = [c.strip() for c in row.strip("|").split(" | ", 2)]
        names = [v.strip(" `") for v in variables.split(" / ")]
        defaults = default.split(" / ") if len(names) > 1 else [default]
        out.update(zip(names, defaults, strict=True))
    return out


def test_every_setting_has_a_flag_and_a_documented_variable():
    """The model is the one declaration: every setting has a flag (in the commands that use it)
    whose help names its variable and default, and a row of docs/CONFIGURATION.md with the same
    default."""
    from sidecar.cli import COMMAND_SETTINGS, build_parser
    from sidecar.config import SETTING_NAMES, setting_docs

    docs = {d.name: d for d in setting_docs()}
    assert set(docs) == set(SETTING_NAMES) and all(d.help for d in docs.values())
    parser = build_parser()
    for command, sub in parser.commands.items():
        assert {a.dest for a in sub._actions if a.dest in docs} == set(COMMAND_SETTINGS[command]), command
        for name in COMMAND_SETTINGS[command]:
            action = sub._option_string_actions[docs[name].flag]
            assert f"({docs[name].variable}; default: {docs[name].default})" in action.help % {}
    from sidecar.config import OPERATOR_SETTINGS

    # the mirroring commands take every setting but the operator commands' own (prune's --older-than...)
    assert set(COMMAND_SETTINGS["sync"]) == set(docs) - set(OPERATOR_SETTINGS)
    assert set(OPERATOR_SETTINGS) == {"live_within", "older_than", "pushgateway"}
    documented = _readme_defaults()
    assert set(documented) == {d.variable for d in docs.values()}
    for d in docs.values():
        cell = documented[d.variable]
        shown = cell.split("`")[1] if cell.startswith("`") else cell
        assert shown == d.default, (d.variable, cell)


def test_unknown_sidecar_variables_are_named():
    from sidecar.config import unknown_variables

    env = {"SIDECAR_STOR": "x", "sidecar_prefix": "p", "SIDECAR_STORE": "y", "OTHER": "z"}
    assert unknown_variables(env) == ["SIDECAR_STOR"]


def test_whole_numbers_written_as_floats_and_huge_numbers(tmp_path):
    s, _ = load({}, cwd=str(tmp_path), env={"SIDECAR_CONCURRENCY": "8.0", "SIDECAR_STORE": str(tmp_path / "s"),
                                             "SIDECAR_MAX_FILE_SIZE": "1e9"})
    assert s.concurrency == 8 and s.max_file_size == 1_000_000_000
    with pytest.raises(ConfigError) as e:  # one line, never a traceback
        load({}, cwd=str(tmp_path), env={"SIDECAR_CONCURRENCY": "9" * 400, "SIDECAR_STORE": str(tmp_path / "s")})
    assert e.value.problems == ["SIDECAR_CONCURRENCY: must be at most 256; got 99999999...(400 digits)"]


def test_deploy_files_name_only_known_variables():
    """An unknown SIDECAR_* variable is a config error, so no manifest or image may set one; and
    the sidecar containers of the platform manifests set the store (no default store there)."""
    import re

    from sidecar.config import VARIABLES

    repo = Path(__file__).resolve().parents[2]
    files = [*repo.glob("deploy/**/*.yaml"), repo / "Dockerfile", *repo.glob("examples/**/Dockerfile")]
    used = {}
    for f in files:
        text = f.read_text()
        for m in re.finditer(r"(?<![{\w])SIDECAR_[A-Z_]+", text):  # not ${SIDECAR_IMAGE}: compose's own
            used.setdefault(m.group(0), f.relative_to(repo))
    assert {"SIDECAR_STORE", "SIDECAR_HTTP_ADDR", "SIDECAR_RESTORE"} <= set(used)
    assert {v: f for v, f in used.items() if v not in VARIABLES} == {}
    for manifest in ("deploy/kubernetes/base/kustomization.yaml", "deploy/azure-container-apps/containerapp.yaml",
                     "deploy/compose/compose.yaml"):
        assert "SIDECAR_STORE" in (repo / manifest).read_text(), manifest


#: What kubelet sets for a Service named ``sidecar`` (ports http 80/TCP, metrics 9100/UDP) and one
#: named ``sidecar-store`` (enableServiceLinks, on by default).
SERVICE_LINKS = {
    "SIDECAR_SERVICE_HOST": "10.0.0.7", "SIDECAR_SERVICE_PORT": "80", "SIDECAR_SERVICE_PORT_HTTP": "80",
    "SIDECAR_SERVICE_PORT_METRICS_PORT": "9100", "SIDECAR_PORT": "tcp://10.0.0.7:80",
    "SIDECAR_PORT_80_TCP": "tcp://10.0.0.7:80", "SIDECAR_PORT_80_TCP_PROTO": "tcp",
    "SIDECAR_PORT_80_TCP_PORT": "80", "SIDECAR_PORT_80_TCP_ADDR": "10.0.0.7",
    "SIDECAR_PORT_9100_UDP_ADDR": "10.0.0.7", "SIDECAR_PORT_9100_SCTP": "sctp://10.0.0.7:9100",
    "SIDECAR_STORE_SERVICE_HOST": "10.0.0.8", "SIDECAR_STORE_PORT_443_TCP": "tcp://10.0.0.8:443",
}


def test_kubelet_service_links_are_not_settings(tmp_path):
    """A Service named ``sidecar`` puts SIDECAR_SERVICE_HOST, SIDECAR_PORT... into every
    container of its namespace: the typo check exited 2 in every pod."""
    from sidecar.config import VARIABLES, unknown_variables
    from sidecar.platformenv import is_service_link

    env = {**SERVICE_LINKS, "SIDECAR_STORE": str(tmp_path / "s"), "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert unknown_variables(env) == []
    settings, _ = load({}, cwd=str(tmp_path), env=env)
    assert settings.store == str(tmp_path / "s")
    assert not [v for v in VARIABLES if is_service_link(v)]  # no setting of ours has such a shape
    # the typo check stays for everything else, and for shapes kubelet never writes
    for typo in ("SIDECAR_STOR", "SIDECAR_PORTS", "SIDECAR_PORT_80", "SIDECAR_PORT_80_TCP_HOST", "SIDECAR_PORT_X_TCP",
                 "sidecar_service_host", "SIDECAR_HTTP_PORT_ADDR", "SIDECAR_SERVICE_HOSTS"):
        assert unknown_variables({typo: "x"}) == [typo], typo


@pytest.mark.parametrize("variable,value", [
    ("SIDECAR_HTTP_PORT", "9090"),  # the likely typo (SIDECAR_HTTP_ADDR): kubelet's <NAME>_PORT is tcp://
    ("SIDECAR_METRICS_PORT", "9100"), ("SIDECAR_PORT", "80"), ("SIDECAR_PORT", "http://10.0.0.7:80"),
    ("SIDECAR_PORT", "tcp://host:80"), ("SIDECAR_PORT", "tcp://10.0.0.7"), ("SIDECAR_PORT", "tcp://10.0.0.7:0"),
    ("SIDECAR_SERVICE_HOST", "sidecar.default.svc"), ("SIDECAR_SERVICE_HOST", "10.0.0.300"),
    ("SIDECAR_SERVICE_PORT", "http"), ("SIDECAR_SERVICE_PORT_HTTP", "70000"), ("SIDECAR_SERVICE_PORT", ""),
    ("SIDECAR_PORT_80_TCP", "tcp://10.0.0.7:81"), ("SIDECAR_PORT_80_TCP", "udp://10.0.0.7:80"),
    ("SIDECAR_PORT_80_TCP_PROTO", "udp"), ("SIDECAR_PORT_80_TCP_PROTO", "TCP"), ("SIDECAR_PORT_80_TCP_PORT", "81"),
    ("SIDECAR_PORT_80_TCP_ADDR", "/mnt/store"), ("SIDECAR_STORE_PORT", "/mnt/store"),
])
def test_a_service_link_name_with_a_value_kubelet_never_writes_is_a_typo(variable, value):
    """The name alone let ``SIDECAR_HTTP_PORT=9090`` be silently ignored; the value decides."""
    from sidecar.config import unknown_variables

    assert unknown_variables({variable: value}) == [variable]


def test_service_links_of_every_kubelet_shape_are_accepted_by_value():
    from sidecar.platformenv import is_service_link

    links = {**SERVICE_LINKS, "SIDECAR_PORT_53_UDP": "udp://10.0.0.7:53", "SIDECAR_PORT_53_UDP_PROTO": "udp",
             "SIDECAR_HTTP_PORT": "tcp://10.0.0.9:8080",  # a Service named sidecar-http
             "SIDECAR_V6_SERVICE_HOST": "fd00::7", "SIDECAR_V6_PORT": "tcp://[fd00::7]:80",
             "SIDECAR_V6_PORT_80_TCP_ADDR": "fd00::7"}
    assert [k for k, v in links.items() if not is_service_link(k, v)] == []


def test_no_setting_under_the_prefixes_foundry_reserves():
    from sidecar.config import VARIABLES
    from sidecar.platformenv import RESERVED_PREFIXES

    assert RESERVED_PREFIXES == ("FOUNDRY_", "AGENT_")
    assert [v for v in VARIABLES if v.startswith(RESERVED_PREFIXES) or not v.startswith("SIDECAR_")] == []


@pytest.mark.parametrize("other", ["sidecar_store", "Sidecar_Store", "SIDECAR_store"])
def test_a_setting_named_twice_in_different_cases_is_one_error_line(other, tmp_path):
    """Which of the two the model read depended on the environment's order."""
    env = {"SIDECAR_STORE": str(tmp_path / "a"), other: str(tmp_path / "b")}
    with pytest.raises(ConfigError) as e:
        load({}, cwd=str(tmp_path), env=env)
    assert e.value.problems == [
        f"SIDECAR_STORE: set 2 times, as {' and '.join(sorted(['SIDECAR_STORE', other]))} (names differing only "
        "in case): keep one"]
    # one line per variable, even when a value is also bad; other problems are still reported
    env = {"SIDECAR_CONCURRENCY": "0", "sidecar_concurrency": "1", "SIDECAR_LOG_LEVEL": "loud",
           "SIDECAR_STORE": str(tmp_path / "a")}
    with pytest.raises(ConfigError) as e:
        load({}, cwd=str(tmp_path), env=env)
    assert [p.split(":")[0] for p in e.value.problems] == ["SIDECAR_CONCURRENCY", "SIDECAR_LOG_LEVEL"]
    assert "set 2 times" in e.value.problems[0]


def _settings(tmp_path, store, **env):
    settings, roots = load({}, cwd=str(tmp_path / "work"), env={"SIDECAR_STORE": str(store), **env})
    return settings, roots


@pytest.mark.parametrize("platform", ["KUBERNETES_SERVICE_HOST", "CONTAINER_APP_NAME", "FOUNDRY_HOSTING_ENVIRONMENT",
                                      "FOUNDRY_AGENT_SESSION_ID"])
def test_a_missing_directory_store_on_a_platform_is_refused_and_never_made(platform, tmp_path):
    from sidecar.storeclient import check_store_volume

    store = tmp_path / "mnt" / "durabel"
    settings, roots = _settings(tmp_path, store, **{platform: "x"})
    assert settings.platform == platform
    with pytest.raises(ValueError) as e:
        check_store_volume(settings, roots)
    line = str(e.value)
    assert line.startswith(f"SIDECAR_STORE: the directory store {store} does not exist, and {platform} says")
    assert "must be a mounted volume" in line and "\n" not in line
    assert not (tmp_path / "mnt").exists()
    settings, roots = _settings(tmp_path, f"file://{store}", **{platform: "x"})  # a file: URL alike
    with pytest.raises(ValueError, match="does not exist"):
        check_store_volume(settings, roots)


def test_off_platform_or_azure_the_store_is_not_checked(tmp_path):
    from sidecar.storeclient import check_store_volume

    settings, roots = _settings(tmp_path, tmp_path / "missing")
    assert settings.platform is None and check_store_volume(settings, roots) == []
    settings, roots = load({}, cwd=str(tmp_path), env={
        "SIDECAR_STORE": "https://acct.blob.core.windows.net/ckpt", "KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert check_store_volume(settings, roots) == []


def test_a_store_on_the_roots_filesystem_on_a_platform_is_a_warning(tmp_path):
    """A mounted volume is another filesystem; the same one as the roots is likely the compute's disk."""
    import os

    from sidecar.storeclient import check_store_volume

    store = tmp_path / "store"
    store.mkdir()
    settings, roots = _settings(tmp_path, store, KUBERNETES_SERVICE_HOST="10.0.0.1")
    # the roots do not exist yet: their parent counts
    warnings = dict(check_store_volume(settings, roots, container_root="/proc"))
    warning = warnings["store_on_root_filesystem"]
    assert warning["store"] == str(store) and warning["platform"] == "KUBERNETES_SERVICE_HOST"
    assert warning["roots"] == ",".join(r.path for r in roots)
    assert "store_on_container_disk" not in warnings  # /proc: not the store's filesystem
    if os.stat("/proc").st_dev != os.stat(tmp_path).st_dev:  # another filesystem: no warning
        settings, roots = _settings(tmp_path, "/proc", KUBERNETES_SERVICE_HOST="10.0.0.1")
        assert check_store_volume(settings, roots, container_root=str(tmp_path)) == []


def test_a_store_on_the_containers_own_filesystem_on_a_platform_is_a_warning(tmp_path):
    """A store that exists (an image's mkdir'd mount point) on the container's root filesystem,
    with the roots elsewhere: the platform did not mount the volume. One warning, not an error."""
    import os

    from sidecar.storeclient import check_store_volume

    other = "/proc"  # another filesystem than the store's, for the roots
    if os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/proc is on the test directory's filesystem")
    store = tmp_path / "mnt" / "durable"
    store.mkdir(parents=True)
    settings, _ = _settings(tmp_path, store, KUBERNETES_SERVICE_HOST="10.0.0.1")
    roots: list = []  # none on the store's filesystem: only the container's disk counts
    [(event, fields)] = check_store_volume(settings, roots, container_root=str(tmp_path))
    assert event == "store_on_container_disk" and fields["store"] == str(store)
    assert "a mounted volume is expected" in fields["detail"] and "\n" not in fields["detail"]
    assert check_store_volume(settings, roots, container_root=other) == []  # the volume is mounted
    settings, _ = _settings(tmp_path, store)  # off a platform: no check
    assert check_store_volume(settings, roots, container_root=str(tmp_path)) == []


def test_the_operator_commands_durations_are_settings_with_variables():
    """``SIDECAR_LIVE_WITHIN`` was refused as unknown, with "did you mean SIDECAR_FENCE_WINDOW?"
    (following it changes fencing); prune's flags had no variables though the help said every
    flag has one. A plain number is refused: it would be seconds."""
    from sidecar.config import ConfigError, load, unknown_variables

    env = {"SIDECAR_LIVE_WITHIN": "2h", "SIDECAR_OLDER_THAN": "7d", "SIDECAR_PUSHGATEWAY": "http://gw:9091",
           "SIDECAR_STORE": "/s", "HOME": "/tmp"}
    assert unknown_variables(env) == []
    settings, _ = load({}, env=env)
    assert (settings.live_within, settings.older_than, settings.pushgateway) == (7200, 7 * 86400, "http://gw:9091")
    for variable in ("SIDECAR_LIVE_WITHIN", "SIDECAR_OLDER_THAN"):
        with pytest.raises(ConfigError) as e:
            load({}, env={**env, variable: "7"})
        [problem] = e.value.problems
        assert problem.startswith(f"{variable}: '7' has no unit"), problem
        assert "FENCE_WINDOW" not in problem
    with pytest.raises(ConfigError) as e:
        load({}, env={**env, "SIDECAR_PUSHGATEWAY": "ftp://ops:HUNTER2@gw/"})
    assert "HUNTER2" not in str(e.value.problems)
