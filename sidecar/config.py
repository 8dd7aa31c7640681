"""One typed configuration, from ``SIDECAR_*`` environment variables and CLI flags (flags win).

Every setting is declared once, as a field of the pydantic-settings model :class:`Settings`: its
type, default, bounds, help and variable (``SIDECAR_<NAME>``, any case). The CLI's flags and
their help (:func:`setting_docs`) and the table in docs/CONFIGURATION.md are derived from it or checked against
it. :func:`load` reads the flags and the environment, validates everything, and reports every
problem at once, one line each, naming the variable (``SIDECAR_X: <what is wrong>``); a rejected
value is shown only where it cannot be a secret (never the store URL, which may carry a SAS
token), escaped and shortened.

Rules beyond a field's type: an unknown ``SIDECAR_*`` variable is an error (a typo such as
``SIDECAR_STOR`` would otherwise fall back to the default store silently), except kubelet's
service links (``SIDECAR_SERVICE_HOST``, ``SIDECAR_PORT_80_TCP``... for a Service named
``sidecar``), which are the platform's and never a setting (:mod:`sidecar.platformenv`): a name of
such a shape whose value has the shape kubelet gives it (``SIDECAR_HTTP_PORT=9090``, not
``tcp://…``, is a typo); two variables naming one setting in different cases (``SIDECAR_STORE``
and ``sidecar_store``) are an error; so is an unset ``SIDECAR_STORE`` on a container platform,
whose local disk goes with the container, and there a directory store that does not exist (the
backend's own check, when the store is opened: :func:`sidecar.storeclient.check_store_volume`).
No setting lies under the prefixes Foundry reserves for its own variables (``FOUNDRY_*``,
``AGENT_*``): every setting is ``SIDECAR_*``.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Mapping, get_args, get_origin

from pydantic import Field, PrivateAttr, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from sidecar.configtypes import (  # noqa: F401 (shown, the value types and bounds are part of this module's interface)
    MAX_SECONDS,
    MAX_VALUE_CHARS,
    Bool,
    Commit,
    CorruptRule,
    Int,
    LogFormat,
    LogLevel,
    PositiveSeconds,
    RestoreRule,
    Seconds,
    SessionNamespace,
    Text,
    UnitSeconds,
    Words,
    _choice,
    _num,
    _shortened,
    check_gateway,
    shown,
)
from sidecar.namespace import Namespace, NamespaceError, check_template, project_namespace, resolve
from sidecar.paths import DEFAULT_IGNORE, IgnoreRules, Root, check_local_path, is_within, make_roots
from sidecar.platformenv import is_service_link, platform_variable
from sidecar.store.registry import StoreURL, parse_store

DEFAULT_ROOTS = [".checkpoints", ".function_approvals"]
LAYOUTS = ("agent-framework", "agentserver")
ENV_PREFIX = "SIDECAR_"
DEFAULT_HTTP_PORT = 7479  # clear of the host (8088), Prometheus exporters (9100-9999) and common app ports


def layout_roots(layout: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Where a host keeps its state, resolved the way the host resolves it.

    * ``agent-framework`` (hosting 1.0.0a260709 … 1.0.0b260730): ``.checkpoints`` and
      ``.function_approvals`` in the working directory; hosted (``FOUNDRY_HOSTING_ENVIRONMENT``
      set) the absolute ``/.checkpoints`` and ``/.function_approvals``.
    * ``agentserver`` (hosting ≥ 1.0.0b260813 outside Foundry): the state root
      ``$AGENTSERVER_STATE_ROOT``, default ``~/.agentserver``.
    """
    env = os.environ if env is None else env
    if layout == "agentserver":
        return [env.get("AGENTSERVER_STATE_ROOT") or os.path.join(os.path.expanduser("~"), ".agentserver")]
    if env.get("FOUNDRY_HOSTING_ENVIRONMENT"):
        return ["/.checkpoints", "/.function_approvals"]
    return list(DEFAULT_ROOTS)


def default_store(env: Mapping[str, str] | None = None) -> str:
    """Outside the working directory and outside any root: ``$XDG_STATE_HOME/checkpoint-sidecar/store``.
    For a laptop: on a container platform this disk goes with the container (see :func:`load`)."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "checkpoint-sidecar", "store")


class ConfigError(ValueError):
    """Configuration problems, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


Layout = _choice(*LAYOUTS)


# -- the environment a load() reads ----------------------------------------------------------------

_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("sidecar_config_environ", default=None)


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over the mapping :func:`load` was given."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        environ = _ENVIRON.get()
        environ = os.environ if environ is None else environ
        return {k if self.case_sensitive else k.lower(): v for k, v in environ.items()}


#: The commands that mirror take every setting; each of the others takes the settings whose field
#: names it (:func:`_uses`): its flags, and what it applies.
MIRRORING_COMMANDS = ("sync", "run")
ONE_SHOT_COMMANDS = ("restore", "status", "probe", "release", "sessions", "prune", "history", "verify")
#: Commands that take exactly the settings of another: history reads what release reads (the
#: store, the namespace), but for what release alone applies (:data:`OPERATOR_SETTINGS`); verify
#: what sessions reads (the store, the prefix every namespace lies below), but for its own.
SAME_SETTINGS = {"history": "release", "verify": "sessions"}


def _uses(*commands: str, default: str | None = None, mirroring: bool = True, metavar: str = "") -> dict[str, Any]:
    """``json_schema_extra``: the one-shot commands that use the setting (besides sync and run,
    unless ``mirroring`` is False: an operator command's own setting), and a computed default
    named the way the help and docs/CONFIGURATION.md show it."""
    assert set(commands) <= set(ONE_SHOT_COMMANDS), commands
    if mirroring:
        commands += tuple(c for c, like in SAME_SETTINGS.items() if like in commands and c not in commands)
    return ({"commands": commands} | ({"doc_default": default} if default is not None else {})
            | ({} if mirroring else {"mirroring": False}) | ({"metavar": metavar} if metavar else {}))


class Settings(BaseSettings):
    """Every setting of the sidecar, declared once; build it with :func:`load`. A field's
    description is its help text; ``doc_default`` names a computed default as documented."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=False, frozen=True, extra="forbid",
        # argparse parses the flags (cli.py): cli_parse_args stays unset, as any value, False
        # included, makes pydantic-settings build a parser of its own on every instantiation
        env_file=None, secrets_dir=None, validate_default=False, hide_input_in_errors=True,
    )

    store: Text = Field(default_factory=default_store, description="file:///dir, a path, or an Azure Blob "
                        "container URL https://<account>.blob.core.windows.net/<container>[/<prefix>]",
                        json_schema_extra=_uses("restore", "status", "release", "sessions", "prune",
                                                default="$XDG_STATE_HOME/checkpoint-sidecar/store"))
    layout: Layout = Field("agent-framework", description="which host's state to mirror: agent-framework "
                           "(.checkpoints,.function_approvals) or agentserver ($AGENTSERVER_STATE_ROOT)",
                           json_schema_extra=_uses("restore", "status"))
    # a Python function, not the builtin list: pydantic inspects a factory's signature, and a
    # builtin's is parsed from text by the tokenizer (about 5 ms at import)
    roots: Words = Field(default_factory=lambda: [], description="comma-separated trees to mirror (overrides the layout)",
                         json_schema_extra=_uses("restore", "status", default="from the layout"))
    commit: Commit = Field(
        "auto", description="per-file, or snapshot: crash-consistent across files (auto: snapshot for agentserver)")
    prefix: Text = Field("", description="namespace inside the store; may refer to variables, e.g. 'agents/{POD_NAME}'",
                         json_schema_extra=_uses("restore", "status", "release", "sessions", "prune"))
    session_namespace: SessionNamespace = Field(
        "auto", description="auto: each platform session (FOUNDRY_AGENT_SESSION_ID) in <prefix>/<agent>/<session> "
                            "(a template that does not place the session: <template>/<session>); "
                            "off: the prefix as written",
        json_schema_extra=_uses("restore", "status", "release", "sessions", "prune"))
    ignore: Words = Field(default_factory=lambda: list(DEFAULT_IGNORE), description="comma-separated basename globs "
                          "never mirrored", json_schema_extra=_uses("restore", "status", default=",".join(DEFAULT_IGNORE)))

    restore: RestoreRule = Field(
        "auto", description="restore rule: auto fills empty roots from the store, skip, force",
        json_schema_extra=_uses("restore"))
    restore_optional: Bool = Field(False, description="start even when the store cannot be reached (not recommended)",
                                 json_schema_extra=_uses("restore"))
    restore_corrupt: CorruptRule = Field(
        "fail", description="a stored object whose bytes fail their sha256: fail the restore, or skip it "
                            "(left out, reported, kept in the store)", json_schema_extra=_uses("restore"))
    concurrency: Int = Field(16, ge=1, le=256, description="store operations in flight (uploads, downloads)",
                       json_schema_extra=_uses("restore", "status", "release", "sessions", "prune"))
    debounce_ms: Int = Field(25, ge=2, le=1000,
                             description="watcher polling step while idle, ms: first-write latency vs idle CPU")
    reconcile_interval: Seconds = Field(120.0, description="seconds between local rescans (0: off)")
    full_reconcile_interval: Seconds = Field(3600.0, description="seconds between store listings (0: at start only)")
    drain_timeout: Seconds = Field(20.0, description="seconds to flush pending work on shutdown")
    child_stop_grace: PositiveSeconds = Field(
        35.0, description="run: seconds a child gets after a forwarded SIGTERM before SIGKILL (above the host's own 30)")
    fence_window: PositiveSeconds = Field(2.0, description="seconds a proof of store ownership is trusted",
                                          json_schema_extra=_uses("prune"))
    fence_margin: Seconds = Field(8.0, description="extra seconds to wait before writing after a recently active owner",
                                  json_schema_extra=_uses("prune"))
    heartbeat_interval: Seconds = Field(900.0, description="seconds between rewrites of the owner marker's heartbeat "
                                        "while mirroring (0: never; ownership is proven by reading it)")
    restore_point_interval: Seconds = Field(60.0, description="seconds between restore points at most, each "
                                            "written once changes settle and at every drain (0: no points)")
    restore_point_full_interval: Seconds = Field(86400.0, description="seconds after which the next restore point "
                                                 "is a full one, whatever its chain costs (0: only by cost)")
    restore_point_keep_all: Seconds = Field(3600.0, description="seconds for which every restore point is kept")
    restore_point_keep_hourly: Seconds = Field(86400.0, description="seconds for which the newest restore point "
                                               "of each hour is kept")
    restore_point_keep_daily: Seconds = Field(604800.0, description="seconds for which the newest restore point "
                                              "of each day is kept")
    max_file_size: Int = Field(256 * 1024 * 1024, ge=1, le=2**63 - 1,
                               description="bytes; larger files are not mirrored", json_schema_extra=_uses("restore"))
    http_addr: Text = Field(f"127.0.0.1:{DEFAULT_HTTP_PORT}",
                            description="host:port of /livez /readyz /metrics ('' disables)",
                            json_schema_extra=_uses("probe"))
    # -- the operator commands' own (sessions, prune, release): no mirroring command takes them --
    live_within: UnitSeconds = Field(
        3600.0, description="an owner marker rewritten within this long (by the store's clock; or within twice the "
                            "heartbeat interval it records) is live: sessions shows it so, prune keeps it, release "
                            "refuses it; written with a unit, e.g. 1h; keep it well above the sidecars' "
                            "SIDECAR_HEARTBEAT_INTERVAL",
        json_schema_extra=_uses("sessions", "prune", "release", default="1h", mirroring=False, metavar="DURATION"))
    older_than: UnitSeconds | None = Field(
        None, description="prune: a namespace's last write at least this old, by the store's clock; written with a "
                          "unit, e.g. 7d; below 1h only with --force (0s: every ended namespace)",
        json_schema_extra=_uses("prune", default="none: prune needs it", mirroring=False, metavar="DURATION"))
    pushgateway: Text = Field("", description="prune: push its gauges to this Prometheus Pushgateway at the end "
                              "(empty: no push)", json_schema_extra=_uses("prune", mirroring=False, metavar="URL"))
    log_level: LogLevel = Field("info", description="log level", json_schema_extra=_uses(*ONE_SHOT_COMMANDS))
    log_format: LogFormat = Field("auto", description="auto (json unless stderr is a terminal), json, text",
                                  json_schema_extra=_uses(*ONE_SHOT_COMMANDS))

    _namespace: Namespace = PrivateAttr(default_factory=Namespace)
    _platform: str | None = PrivateAttr(default=None)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (passed in as init values) over the environment; no .env file, no secrets dir."""
        return init_settings, _Environment(settings_cls)

    # -- checks beyond type and bounds (a ValueError's text becomes the problem line) -----------
    @field_validator("store")
    @classmethod
    def _check_store(cls, v: str) -> str:
        return check_store(v, _ENVIRON.get())

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, v: str) -> str:
        return check_template(v)  # NamespaceError is a ValueError: one line naming SIDECAR_PREFIX

    @field_validator("roots")
    @classmethod
    def _check_roots(cls, v: list[str]) -> list[str]:
        for p in v:
            check_local_path(p, "a root")
        return v

    @field_validator("pushgateway")
    @classmethod
    def _check_pushgateway(cls, v: str) -> str:
        return check_gateway(v)

    @field_validator("http_addr")
    @classmethod
    def _check_http_addr(cls, v: str) -> str:
        parse_host_port(v)
        return v

    # -- derived ---------------------------------------------------------------------------
    @property
    def namespace(self) -> Namespace:
        """Resolved by :func:`load` from ``prefix``, ``session_namespace`` and the environment."""
        return self._namespace

    @property
    def store_url(self) -> StoreURL:
        """``store`` as its backend parsed it (by the field's check, once)."""
        return parse_store(self.store)  # a StoreURL already: returned as it is

    @property
    def platform(self) -> str | None:
        """The variable that says this runs on a container platform
        (:data:`sidecar.platformenv.PLATFORM_VARIABLES`), as :func:`load` found it; None off-platform."""
        return self._platform

    @cached_property
    def ignore_rules(self) -> IgnoreRules:
        """``ignore`` compiled, once: the rules every reader of the roots applies."""
        return IgnoreRules(self.ignore)

    def root_list(self, cwd: str | None = None) -> list[Root]:
        return make_roots(self.roots or layout_roots(self.layout), cwd or os.getcwd())

    def snapshot_commits(self) -> bool:
        return self.commit == "snapshot" or (self.commit == "auto" and self.layout == "agentserver")

    def http_host_port(self) -> tuple[str, int] | None:
        return parse_host_port(self.http_addr)


# -- single-setting checks -------------------------------------------------------------------------

def check_store(v: str, env: Mapping[str, str] | None = None) -> StoreURL:
    """``SIDECAR_STORE`` stripped and parsed, once, by the backend its scheme names
    (:func:`sidecar.store.registry.parse_store`; ``env`` for what the URL leaves to it). The
    messages never show the value: a URL may carry a SAS token."""
    return parse_store(v, os.environ if env is None else env)


_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})?")  # fullmatch


def parse_host_port(addr: str) -> tuple[str, int] | None:
    """``SIDECAR_HTTP_ADDR`` as (host, port): ``host:port``, ``[v6]:port`` or ``:port`` (loopback);
    None when empty (disabled); ValueError saying what is wrong."""
    if addr == "":
        return None
    expected = f"expected host:port, [IPv6]:port or '' (disabled), e.g. 127.0.0.1:{DEFAULT_HTTP_PORT}; got {shown(addr)}"
    head, sep, port = addr.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        raise ValueError(expected)
    if head.startswith("[") or head.endswith("]"):
        if not (head.startswith("[") and head.endswith("]")):
            raise ValueError(expected)
        host = head[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{shown(host)} is not an IPv6 address; {expected}") from None
    else:
        host = head
        if ":" in host:
            raise ValueError(f"an IPv6 address goes in brackets, e.g. [::1]:{DEFAULT_HTTP_PORT}; got {shown(addr)}")
        if host and not _HOST.fullmatch(host):
            raise ValueError(expected)
    if len(port) > 5 or int(port) > 65535:
        raise ValueError(f"the port must be 0-65535; got {shown(addr)}")
    return (host or "127.0.0.1"), int(port)


# -- what the CLI and the docs show ----------------------------------------------------------------

@dataclass(frozen=True)
class SettingDoc:
    """One setting as the CLI and docs/CONFIGURATION.md present it."""

    name: str
    variable: str
    flag: str
    help: str
    default: str  # as documented: `16`, `empty`, `from the layout`...
    choices: tuple[str, ...]
    kind: str  # "text", "list", "int", "float", "bool", "choice"
    commands: tuple[str, ...]  # the commands that take it (its flag) and apply it
    metavar: str = ""  # the flag's value as its help shows it ("": the setting's name)


def _kind(annotation: Any) -> tuple[str, tuple[str, ...]]:
    args = tuple(a for a in get_args(annotation) if a is not type(None))
    if len(args) == 1 and type(None) in get_args(annotation):  # optional: the type it holds
        held = args[0]
        return _kind(get_args(held)[0] if get_origin(held) is Annotated else held)
    if args and all(isinstance(a, str) for a in args):
        return "choice", args
    names = {str: "text", int: "int", float: "float", bool: "bool"}
    return names.get(annotation, "list"), ()


def _shown_default(value: Any) -> str:
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@functools.cache
def setting_docs() -> tuple[SettingDoc, ...]:
    """Every setting, in declaration order, for flags, their help and the table in docs/CONFIGURATION.md."""
    out = []
    for name, f in Settings.model_fields.items():
        kind, choices = _kind(f.annotation)
        extra: dict[str, Any] = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        default = str(extra.get("doc_default") or _shown_default(f.default))
        mirroring = MIRRORING_COMMANDS if extra.get("mirroring", True) else ()
        out.append(SettingDoc(name, ENV_PREFIX + name.upper(), "--" + name.replace("_", "-"),
                              f.description or "", default, choices, kind,
                              mirroring + tuple(extra.get("commands", ())), str(extra.get("metavar", ""))))
    return tuple(out)


def command_settings() -> dict[str, tuple[str, ...]]:
    """The settings each command takes (its flags) and applies, in declaration order; the
    environment's SIDECAR_* variables are read whatever the command, so one environment serves
    every command of a deployment."""
    return {c: tuple(d.name for d in setting_docs() if c in d.commands) for c in MIRRORING_COMMANDS + ONE_SHOT_COMMANDS}


SETTING_NAMES = tuple(Settings.model_fields)
#: The settings only operator commands take (``sessions``, ``prune``, ``release``): no mirroring command does.
OPERATOR_SETTINGS = tuple(d.name for d in setting_docs() if not set(MIRRORING_COMMANDS) & set(d.commands))
VARIABLES = {ENV_PREFIX + n.upper(): n for n in SETTING_NAMES}


# -- load ------------------------------------------------------------------------------------------

def _problem(err: Any) -> str:  # a pydantic ErrorDetails
    """One pydantic error as ``SIDECAR_X: <what is wrong>``."""
    name = str(err["loc"][0]) if err["loc"] else ""
    variable = ENV_PREFIX + name.upper()
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    secret = name == "store"
    got = "" if secret else f", got {shown(value)}"
    if kind == "value_error":  # our own checks' messages: one line each
        return f"{variable}: {ctx.get('error', err['msg'])}".splitlines()[0]
    if kind in ("greater_than_equal", "less_than_equal", "greater_than"):
        words = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
                 "greater_than": ("more than", "gt")}[kind]
        return f"{variable}: must be {words[0]} {_num(ctx[words[1]])}; got {_num(value)}"
    if kind == "int_parsing_size":  # more digits than any bound: say which bound
        f = Settings.model_fields[name]
        le = next((m.le for m in f.metadata if getattr(m, "le", None) is not None), None)
        if le is not None and str(value).strip().isdigit():
            return f"{variable}: must be at most {_num(le)}; got {_num(value)}"
        return f"{variable}: must be a whole number{got}"
    if kind.startswith("int_"):
        return f"{variable}: must be a whole number{got}"
    if kind == "finite_number":
        return f"{variable}: must be a finite number{got}"
    if kind.startswith("float_"):
        return f"{variable}: must be a number{got}"
    if kind.startswith("bool_"):
        return f"{variable}: must be true or false{got}"
    if kind == "literal_error":
        choices = _kind(Settings.model_fields[name].annotation)[1]
        return f"{variable}: must be one of {', '.join(choices)}; got {shown(value)}"
    if kind == "string_unicode":
        return f"{variable}: must be UTF-8 text (it holds bytes that are not)"
    if kind in ("string_type", "list_type"):
        return f"{variable}: must be text{got}"
    return f"{variable}: {err['msg'].splitlines()[0]}"  # a type this list does not know yet


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """``SIDECAR_*`` variables that name no setting (a typo such as ``SIDECAR_STOR``); kubelet's
    service links (a Service named ``sidecar``...) are the platform's, not typos."""
    env = os.environ if env is None else env
    return sorted(k for k in env if k.upper().startswith(ENV_PREFIX) and k.upper() not in VARIABLES
                  and not is_service_link(k, env[k]))


def case_duplicates(env: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """Settings named by more than one variable, in different cases (``SIDECAR_STORE`` and
    ``sidecar_store``): the setting's variable -> the names, sorted."""
    env = os.environ if env is None else env
    names: dict[str, list[str]] = {}
    for k in env:
        if k.upper() in VARIABLES:
            names.setdefault(k.upper(), []).append(k)
    return {v: sorted(ks) for v, ks in sorted(names.items()) if len(ks) > 1}


def _unknown_problem(variable: str) -> str:
    import difflib  # only on this error path

    near = difflib.get_close_matches(variable.upper(), VARIABLES, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]}?)" if near else " (the settings: see checkpoint-sidecar --help)"
    return f"{_shortened(variable, 60)}: not a checkpoint-sidecar setting{hint}"


def load(overrides: Mapping[str, object] | None = None, cwd: str | None = None,
         env: Mapping[str, str] | None = None) -> tuple[Settings, list[Root]]:
    """Settings from the environment with ``overrides`` (CLI flags, by setting name; None: not
    given) on top, fully validated, and the roots they name.

    Raises :class:`ConfigError` listing every problem, one line each.
    """
    env = os.environ if env is None else env
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(given) - set(SETTING_NAMES))
    if unknown:
        raise TypeError(f"unknown settings {unknown}")  # a bug in the caller, not the operator's input
    problems = [_unknown_problem(k) for k in unknown_variables(env)]
    twice = case_duplicates(env)
    problems += [f"{v}: set {len(ks)} times, as {' and '.join(_shortened(k, 60) for k in ks)} (names differing only "
                 "in case): keep one" for v, ks in twice.items()]
    platform = platform_variable(env)
    store_set = "store" in given or any(k.upper() == "SIDECAR_STORE" for k in env)
    prefix_set = "prefix" in given or any(k.upper() == "SIDECAR_PREFIX" for k in env)
    if not store_set:
        given["store"] = default_store(env)
        if platform:
            problems.append(
                f"SIDECAR_STORE: not set, and {platform} says this runs on a container platform, where the "
                f"default ({default_store(env)}) is on the container's own disk and goes with it: set SIDECAR_STORE "
                "to a mounted volume or an Azure Blob container URL")
    token = _ENVIRON.set(env)
    try:
        settings = Settings(**given)  # type: ignore[arg-type]  # checked by the model itself
    except ValidationError as e:
        problems += [_problem(err) for err in e.errors(include_url=False)]
        raise ConfigError(_one_per_duplicate(problems, twice)) from None
    finally:
        _ENVIRON.reset(token)
    settings._platform = platform
    try:
        settings._namespace = resolve(settings.prefix, env, settings.session_namespace)
    except NamespaceError as e:
        problems.append(f"{e.variable}: {e}")
    roots: list[Root] = []
    try:
        roots = settings.root_list(cwd)
        if not roots:
            problems.append("SIDECAR_ROOTS: no root to mirror")
        for r in roots:  # a root may not exist yet (it is watched for), but it is never a file
            if os.path.exists(r.path) and not os.path.isdir(r.path):
                problems.append(f"SIDECAR_ROOTS: {r.path} is not a directory")
    except ValueError as e:
        problems.append(f"SIDECAR_ROOTS: {e}")
    ns = settings._namespace
    if not store_set and not prefix_set and roots and not ns.path and not ns.identity:
        # the default store is shared by every project on this machine: each gets a namespace of its own
        settings._namespace = project_namespace([r.path for r in roots])
    local = settings.store_url.local_path
    if local is not None:
        store_dir = os.path.normpath(os.path.join(cwd or os.getcwd(), local))
        for r in roots:
            if is_within(store_dir, r.path) or is_within(r.path, store_dir):
                problems.append(
                    f"SIDECAR_STORE: {store_dir} overlaps the mirrored root {r.path}; "
                    "put the store outside every root"
                )
    if problems:
        raise ConfigError(_one_per_duplicate(problems, twice))
    return settings, roots


def _one_per_duplicate(problems: list[str], twice: Mapping[str, list[str]]) -> list[str]:
    """``problems`` without those about the value of a variable set twice: which of its values
    was read is arbitrary, and its one line says so."""
    own = {f"{v}: set " for v in twice}
    return [p for p in problems if p.split(": ", 1)[0] not in twice or any(p.startswith(o) for o in own)]
