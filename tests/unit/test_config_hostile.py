"""Every setting against hostile values: a clean load or one line naming the variable, in-process
(values an environment cannot carry, such as NUL, included). The CLI's side is in
tests/integration/test_cli_config.py."""

from __future__ import annotations

import pytest

from sidecar.config import SETTING_NAMES, ConfigError, load

HOSTILE = {
    "empty": "",
    "blank": "   ",
    "huge": "9" * 400,
    "nan": "nan",
    "inf": "inf",
    "negative": "-1",
    "words": "yes please",
    "newline": "a\nb",
    "nul": "a\x00b",
    "long": "x" * 10_000,
    "unicode": "é✓日本",
    "surrogate": "\udcff",  # an environment that is not UTF-8
}

#: (setting, value) pairs that are valid: text settings take many strings
ACCEPTED = {
    "empty": {"roots", "prefix", "ignore", "http_addr", "pushgateway"},  # pushgateway: no push
    "blank": {"roots", "prefix", "ignore", "pushgateway"},
    "huge": {"ignore"},
    "nan": {"store", "roots", "prefix", "ignore", "pushgateway"},  # a host named nan
    "inf": {"store", "roots", "prefix", "ignore", "pushgateway"},
    "negative": {"store", "roots", "prefix", "ignore"},
    "words": {"store", "roots", "prefix", "ignore"},
    "newline": set(),
    "nul": set(),
    "long": set(),
    "unicode": {"store", "roots", "prefix", "ignore"},
    "surrogate": set(),
}


@pytest.mark.parametrize("kind", HOSTILE)
def test_every_setting_loads_or_fails_with_one_line(kind, tmp_path):
    value = HOSTILE[kind]
    for name in SETTING_NAMES:
        variable = f"SIDECAR_{name.upper()}"
        env = {"SIDECAR_STORE": str(tmp_path / "store"), variable: value}
        try:
            load({}, cwd=str(tmp_path / "work"), env=env)
        except ConfigError as e:
            assert name not in ACCEPTED[kind], f"{variable}={value[:20]!r} refused: {e.problems}"
            assert len(e.problems) == 1 and e.problems[0].startswith(f"{variable}: "), e.problems
            line = e.problems[0]
            assert line.isprintable(), line  # escaped
            assert len(line) < 400, line
            assert "\n" not in line and "\x00" not in line and "Input should" not in line
        else:
            assert name in ACCEPTED[kind], f"{variable}={value[:20]!r} was accepted"


def test_flags_get_the_same_checks_as_the_environment(tmp_path):
    """A flag's value reaches the same validation (argparse passes text), named by the variable."""
    with pytest.raises(ConfigError) as e:
        load({"concurrency": "lots", "http_addr": "[::1", "store": str(tmp_path / "s")}, cwd=str(tmp_path))
    assert e.value.problems == [
        "SIDECAR_CONCURRENCY: must be a whole number, got 'lots'",
        "SIDECAR_HTTP_ADDR: expected host:port, [IPv6]:port or '' (disabled), e.g. 127.0.0.1:7479; got '[::1'",
    ]


@pytest.mark.parametrize("store", [
    "https://acct.blob.core.windows.net/c?sv=2024&sig=SECRETSIG",
    "https://[acct.blob.core.windows.net/c?sig=SECRETSIG",
    "https:///c?sig=SECRETSIG",
    "ftp://acct/c?sig=SECRETSIG",
    "https://acct.blob.core.windows.net/c?sig=SECRETSIG\n",
    "https://acct.blob.core.windows.net/c?sig=SECRETSIG" + "x" * 5000,
    "file://SECRETSIG/x",
])
def test_a_refused_store_url_is_never_shown(store, tmp_path):
    try:
        load({}, cwd=str(tmp_path), env={"SIDECAR_STORE": store, "SIDECAR_CONCURRENCY": "0"})
    except ConfigError as e:
        assert all("SECRETSIG" not in p for p in e.problems if p.startswith("SIDECAR_STORE")), e.problems
        assert "sig=" not in str(e)
    else:
        raise AssertionError("SIDECAR_CONCURRENCY=0 was accepted")


@pytest.mark.parametrize("store, why", [
    ("file://relative/x", "names the host 'relative'"),
    ("file://host/x", "names the host 'host'"),
    ("file:relative", "file:///absolute/path"),
    ("file:///%00x", "must not contain NUL"),
    ("/tmp/a\x00b", "control characters"),
    ("/tmp/" + "x" * 300, "component longer than 255 bytes"),
])
def test_store_paths_that_cannot_be_a_directory(store, why, tmp_path):
    with pytest.raises(ConfigError) as e:
        load({}, cwd=str(tmp_path), env={"SIDECAR_STORE": store})
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("SIDECAR_STORE: ")
    assert why in e.value.problems[0]


@pytest.mark.parametrize("addr, parsed", [
    ("127.0.0.1:7479", ("127.0.0.1", 7479)), (":80", ("127.0.0.1", 80)), ("[::1]:0", ("::1", 0)),
    ("[::]:7479", ("::", 7479)), ("0.0.0.0:7479", ("0.0.0.0", 7479)), ("localhost:1", ("localhost", 1)), ("", None),
])
def test_http_addresses(addr, parsed, tmp_path):
    s, _ = load({"http_addr": addr, "store": str(tmp_path / "s")}, cwd=str(tmp_path))
    assert s.http_host_port() == parsed


@pytest.mark.parametrize("addr", [":99999", "host:", "[::1", "::1:80", "[::1]", "[nope]:80", "a b:1", "h:+80",
                                  "h:８０", "h:-1", "h:0x50", ":" + "9" * 400])
def test_malformed_http_addresses(addr, tmp_path):
    with pytest.raises(ConfigError) as e:
        load({"http_addr": addr, "store": str(tmp_path / "s")}, cwd=str(tmp_path))
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("SIDECAR_HTTP_ADDR: ")
    assert len(e.value.problems[0]) < 200
