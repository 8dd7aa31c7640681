"""Namespaces: templating, the session default, safe values, identities (pure)."""

from __future__ import annotations

import pytest

from sidecar.config import ConfigError, load
from sidecar.marker import marker_identity
from sidecar.namespace import Namespace, NamespaceError, check_template, references, resolve
from sidecar.takeover import conflict

FOUNDRY = {"FOUNDRY_AGENT_NAME": "approvals", "FOUNDRY_AGENT_SESSION_ID": "sess-1"}


def test_without_a_session_the_prefix_is_the_namespace_as_before():
    assert resolve("", {}) == Namespace("")
    assert resolve("team/a", {}) == Namespace("team/a")
    assert resolve("/team/a/", {}).path == "team/a"


def test_a_platform_session_gets_its_own_namespace_by_default():
    ns = resolve("", FOUNDRY)
    assert ns.path == "approvals/sess-1"
    assert ns.identity == {"FOUNDRY_AGENT_SESSION_ID": "sess-1"}
    assert ns.legacy == ""  # where a release without namespaces stored this state
    assert resolve("prod", FOUNDRY).path == "prod/approvals/sess-1"
    assert resolve("", {"FOUNDRY_AGENT_SESSION_ID": "s"}).path == "_/s"  # an unnamed agent


def test_session_namespace_off_keeps_the_prefix_and_the_identity():
    ns = resolve("shared", FOUNDRY, "off")
    assert ns.path == "shared" and ns.identity == {"FOUNDRY_AGENT_SESSION_ID": "sess-1"} and ns.legacy is None


def test_a_template_expands_variables_and_names_the_identity():
    env = {"POD_NAME": "web-2", "REGION": "eu"}
    ns = resolve("agents/{REGION}/pod-{POD_NAME}", env)
    assert ns.path == "agents/eu/pod-web-2"
    assert ns.identity == {"REGION": "eu", "POD_NAME": "web-2"}
    assert ns.legacy == "agents"
    # a template that places the session decides the layout
    assert resolve("{FOUNDRY_AGENT_SESSION_ID}", FOUNDRY).identity == {"FOUNDRY_AGENT_SESSION_ID": "sess-1"}
    assert resolve("x/{SID}", {"SID": "sess-1", **FOUNDRY}) == Namespace("x/sess-1", {"SID": "sess-1"}, "x")


def test_a_template_without_the_session_is_made_per_session_where_the_platform_names_one():
    """``agents/{FOUNDRY_AGENT_NAME}`` would put every session of the agent in one namespace with
    one identity: session two would restore session one's files and fence it."""
    one = resolve("agents/{FOUNDRY_AGENT_NAME}", FOUNDRY)
    two = resolve("agents/{FOUNDRY_AGENT_NAME}", {**FOUNDRY, "FOUNDRY_AGENT_SESSION_ID": "sess-2"})
    assert one.path == "agents/approvals/sess-1" and two.path == "agents/approvals/sess-2"
    assert one.identity == {"FOUNDRY_AGENT_NAME": "approvals", "FOUNDRY_AGENT_SESSION_ID": "sess-1"}
    assert conflict({"identity": one.identity}, two.identity, one.path)  # never one owner for both
    assert resolve("{POD_NAME}", {"POD_NAME": "web-2", **FOUNDRY}).path == "web-2/sess-1"
    # off: the prefix as written, and the session in the identity: a second session is refused
    off_one = resolve("agents/{FOUNDRY_AGENT_NAME}", FOUNDRY, "off")
    off_two = resolve("agents/{FOUNDRY_AGENT_NAME}", {**FOUNDRY, "FOUNDRY_AGENT_SESSION_ID": "sess-2"}, "off")
    assert off_one.path == off_two.path == "agents/approvals"
    assert conflict({"identity": off_one.identity}, off_two.identity, off_one.path)
    with pytest.raises(NamespaceError) as e:  # the session id is checked whatever the template
        resolve("agents/{FOUNDRY_AGENT_NAME}", {**FOUNDRY, "FOUNDRY_AGENT_SESSION_ID": "../x"})
    assert e.value.variable == "FOUNDRY_AGENT_SESSION_ID"


SECRET = "c2VjcmV0LWtleS12YWx1ZQ+/="


@pytest.mark.parametrize("name", ["AZURE_STORAGE_KEY", "AZURE_CLIENT_SECRET", "DB_PASSWORD", "GITHUB_TOKEN",
                                  "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_SAS", "SAS_URL", "api_key",
                                  "SIDECAR_STORE", "AZURE_FEDERATED_TOKEN_FILE", "sidecar_store"])
def test_a_template_never_refers_to_a_credential(name):
    """Its value would be printed (an unsafe value is shown, 40 characters), or become store
    names, log lines, /readyz and the owner marker."""
    env = {name: SECRET, "POD_NAME": "p"}
    with pytest.raises(NamespaceError, match=r"a credential") as e:
        resolve(f"agents/{{POD_NAME}}/{{{name}}}", env)
    assert SECRET[:8] not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as c:
        load({"store": "/mnt/store"}, env={"SIDECAR_PREFIX": f"x/{{{name}}}", **env})
    assert len(c.value.problems) == 1 and c.value.problems[0].startswith(f"SIDECAR_PREFIX: refers to {{{name}}}")
    assert SECRET[:8] not in c.value.problems[0]


@pytest.mark.parametrize("name", ["POD_NAME", "FOUNDRY_AGENT_NAME", "FOUNDRY_AGENT_SESSION_ID", "HOSTNAME", "REGION"])
def test_names_of_computes_are_not_credentials(name):
    assert resolve(f"{{{name}}}", {name: "v"}).path == "v"


@pytest.mark.parametrize("value", ["s1\n", "s1\r", "s\x001", "s1\t", "\x7fs1", "s1\n\n"])
def test_a_control_character_anywhere_in_an_id_is_refused(value):
    """``$`` matched before a trailing newline: ``s1\n`` passed and became the namespace ``agent/s1\n``."""
    with pytest.raises(NamespaceError, match="not a safe name segment") as e:
        resolve("", {"FOUNDRY_AGENT_NAME": "agent", "FOUNDRY_AGENT_SESSION_ID": value})
    assert e.value.variable == "FOUNDRY_AGENT_SESSION_ID" and "\n" not in str(e.value)
    with pytest.raises(NamespaceError, match="not a safe name segment"):
        resolve("", {"FOUNDRY_AGENT_NAME": value, "FOUNDRY_AGENT_SESSION_ID": "s1"})
    with pytest.raises(NamespaceError, match="not a safe name segment"):
        resolve("{POD_NAME}", {"POD_NAME": value})


@pytest.mark.parametrize("env", [{}, {"POD_NAME": ""}])
def test_an_unset_or_empty_variable_is_an_error_naming_it(env):
    with pytest.raises(NamespaceError, match=r"\{POD_NAME\}, which is unset or empty"):
        resolve("x/{POD_NAME}", env)


@pytest.mark.parametrize("value", ["a/b", "..", ".hidden", "a b", "a\nb", "x" * 129, "a\\b", "%2e%2e", "é"])
def test_an_unsafe_value_never_escapes_its_segment(value):
    with pytest.raises(NamespaceError, match="not a safe name segment") as e:
        resolve("{POD_NAME}", {"POD_NAME": value})
    assert "\n" not in str(e.value)
    with pytest.raises(NamespaceError, match="not a safe name segment") as e:
        resolve("", {"FOUNDRY_AGENT_SESSION_ID": value})
    assert e.value.variable == "FOUNDRY_AGENT_SESSION_ID"


@pytest.mark.parametrize("template", ["{A{B}}", "{{A}}", "{A", "A}", "{}", "{1A}", "{A-B}", "a/{A}}"])
def test_stray_or_nested_braces_are_refused(template):
    with pytest.raises(NamespaceError, match="stray"):
        references(template)


@pytest.mark.parametrize("template", ["a//b", "../x", "a/./b", "a\\b", "x" * 300, "a\x01b"])
def test_a_template_must_be_a_plain_relative_name(template):
    with pytest.raises(NamespaceError):
        resolve(template, {})


def test_config_errors_are_one_line_naming_the_variable():
    with pytest.raises(ConfigError) as e:
        load({}, env={"SIDECAR_PREFIX": "a/{POD_NAME}"})
    assert e.value.problems == [
        "SIDECAR_PREFIX: refers to {POD_NAME}, which is unset or empty: set it, or remove the reference"]
    with pytest.raises(ConfigError) as e:
        load({}, env={"FOUNDRY_AGENT_SESSION_ID": "../x", "SIDECAR_STORE": "/mnt/store"})
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("FOUNDRY_AGENT_SESSION_ID: ")
    with pytest.raises(ConfigError) as e:
        load({}, env={"SIDECAR_PREFIX": "{A{B}}"})
    assert e.value.problems[0].startswith("SIDECAR_PREFIX: stray")
    settings, _roots = load({}, env={"SIDECAR_PREFIX": "p/{POD_NAME}", "POD_NAME": "web-0"})
    assert settings.namespace.path == "p/web-0"


def test_identity_conflict_rules():
    s1, s2 = {"FOUNDRY_AGENT_SESSION_ID": "s1"}, {"FOUNDRY_AGENT_SESSION_ID": "s2"}
    assert conflict({"identity": s1}, s1, "ns") is None  # the same session's next compute
    assert conflict({}, s2, "ns") is None  # nobody owns it yet
    assert conflict({"generation": 5, "heartbeat": 1}, s2, "ns") is None  # a marker of an older release
    assert conflict({}, {}, "ns") is None and conflict({"generation": 5}, {}, "ns") is None  # no identity on either side
    lone = conflict({"identity": s1}, {}, "agent/s1")  # no identity never takes a session's namespace
    assert lone and "has no identity" in lone and "checkpoint-sidecar release" in lone and "\n" not in lone
    why = conflict({"identity": s1}, s2, "ns")
    assert why and "FOUNDRY_AGENT_SESSION_ID=s1" in why and "FOUNDRY_AGENT_SESSION_ID=s2" in why and "\n" not in why
    assert marker_identity({"identity": "junk"}) == {} and marker_identity([]) == {}  # type: ignore[arg-type]


@pytest.mark.parametrize("template", ["team/.checkpoints", ".sidecar", "a/.sidecar-meta", ".x/{POD_NAME}"])
def test_a_fixed_segment_never_names_a_root_or_the_sidecars_own(template):
    """'team/.checkpoints' would make 'team's namespace hold another one's root keys: a sidecar
    on 'team' would reconcile (and delete) them."""
    with pytest.raises(NamespaceError, match="must not start with '.'"):
        resolve(template, {"POD_NAME": "p"})


@pytest.mark.parametrize("name", ["IDENTITY_HEADER", "MSI_SECRET", "HTTPS_PROXY", "http_proxy", "ALL_PROXY",
                                  "NO_PROXY", "PROXYURL", "AZURE_STORAGE_SASURL", "SASURL", "BASIC_AUTH",
                                  "AUTHORIZATION", "DB_PASS", "PASSPHRASE", "MY_CREDS", "CREDS"])
def test_more_secret_names_are_refused_by_name(name):
    """The managed identity's header secret was accepted; a proxy URL carries a user and password."""
    env = {name: "bob:Hunter2pass", "POD_NAME": "p"}
    with pytest.raises(NamespaceError, match=r"a credential") as e:
        resolve(f"agents/{{{name}}}", env)
    assert "Hunter2" not in str(e.value)


@pytest.mark.parametrize("value", ["http://bob:Hunter2pass@proxy:3128", "postgres://bob:Hunter2pass@db/app",
                                   "bob:Hunter2pass", "Hunter2pass\n", "x/Hunter2pass", "Hunter2pass" * 20])
def test_an_error_about_a_value_never_shows_the_value(value):
    """``{DATABASE_URL}`` and ``{HTTPS_PROXY}`` echoed the password in the error."""
    with pytest.raises(NamespaceError, match="the value of DATABASE_URL is not a safe name segment") as e:
        resolve("agents/{DATABASE_URL}", {"DATABASE_URL": value})
    assert "Hunter2" not in str(e.value) and "bob" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as c:
        load({"store": "/mnt/store"}, env={"SIDECAR_PREFIX": "x/{DATABASE_URL}", "DATABASE_URL": value})
    assert "Hunter2" not in "\n".join(c.value.problems)


def test_a_url_with_userinfo_says_so_and_an_id_error_is_escaped_once():
    with pytest.raises(NamespaceError, match="it is a URL with a user name or password"):
        resolve("{UPSTREAM}", {"UPSTREAM": "https://u:p@host/x"})
    with pytest.raises(NamespaceError) as e:
        resolve("", {"FOUNDRY_AGENT_SESSION_ID": "s1\n"})
    assert "\\" not in str(e.value) and "character 3 is a control" in str(e.value)


@pytest.mark.parametrize("char", ["\u0085", "\u2028", "\u2029", "\u202e", "\u200b", "\x1b", "\ufeff"])
def test_a_static_prefix_with_a_format_or_separator_character_is_refused(char):
    with pytest.raises(NamespaceError, match="control, format or separator"):
        check_template(f"agents{char}x/{{POD_NAME}}")
    with pytest.raises(ConfigError):
        load({"store": "/mnt/store"}, env={"SIDECAR_PREFIX": f"agents/a{char}b"})


def test_status_prints_a_namespace_through_the_one_escaper():
    from sidecar.ops.status import render

    text = render({"store": "directory store /s\u2028x", "roots": {}, "in_sync": True}, "a\u202eb\nc")
    assert text.splitlines()[0] == "store: directory store /s\\u2028x (namespace a\\u202eb\\nc)"


def test_a_hint_is_a_complete_command_safe_to_paste(tmp_path, monkeypatch):
    """Every hint that suggests ``release`` names the store and the namespace, quoted for a shell,
    with SIDECAR_SESSION_NAMESPACE=off (a session id where it is pasted changes nothing); a SAS
    token is never printed; a relative directory is made absolute."""
    import shlex

    from sidecar.namespace import command_for, variables_for

    sas = "https://acct.blob.core.windows.net/state/top?sv=2024&sig=S3CRET%2Bx"
    line = command_for("release", sas, "agents/approvals/s 3")
    assert "S3CRET" not in line and "sig=" not in line
    words = shlex.split(line.split(" (add the store's SAS token", 1)[0])
    assert words == ["SIDECAR_STORE=https://acct.blob.core.windows.net/state/top", "SIDECAR_PREFIX=agents/approvals/s 3",
                     "SIDECAR_SESSION_NAMESPACE=off", "checkpoint-sidecar", "release"]
    assert "add the store's SAS token" in line
    monkeypatch.chdir(tmp_path)
    assert shlex.split(command_for("release", "store", "ns"))[0] == f"SIDECAR_STORE={tmp_path / 'store'}"
    assert "\n" not in command_for("release", "/s", "a\nb")

    # the variables of an identity give back that namespace and identity under resolve()
    for namespace, identity in (("sessions/approvals/s3", {"FOUNDRY_AGENT_SESSION_ID": "s3"}),
                                ("agents/web-0", {"POD_NAME": "web-0"}),
                                ("agents/approvals/s3", {"FOUNDRY_AGENT_NAME": "approvals",
                                                         "FOUNDRY_AGENT_SESSION_ID": "s3"})):
        env = dict(w.split("=", 1) for w in shlex.split(variables_for("/s", namespace, identity)))
        got = resolve(env["SIDECAR_PREFIX"], env, env["SIDECAR_SESSION_NAMESPACE"])
        assert (got.path, got.identity) == (namespace, identity), env


def test_refusals_name_the_store_in_their_release_hint():
    s1 = {"FOUNDRY_AGENT_SESSION_ID": "s1"}
    lone = conflict({"identity": s1}, {}, "agent/s1", "/mnt/durable")
    assert lone and "SIDECAR_STORE=/mnt/durable SIDECAR_PREFIX=agent/s1 SIDECAR_SESSION_NAMESPACE=off " \
                    "checkpoint-sidecar release" in lone
    assert "FOUNDRY_AGENT_SESSION_ID=s1" in lone.split("with these variables: ", 1)[1]
    garbled = conflict({"_unreadable": "not a JSON object", "_stored_version": 3}, {}, "agent/s1", "/mnt/durable")
    assert garbled and "SIDECAR_STORE=/mnt/durable SIDECAR_PREFIX=agent/s1" in garbled
