"""One typed configuration, from ``SIDECAR_*`` environment variables and CLI flags (flags win).

Every setting is declared once, as a field of :class:`Settings` with its type, default, bounds
and help; :func:`load` takes each from the flags or the environment (``SIDECAR_<NAME>``, any
case), converts and checks it, and reports every problem at once, one line each, naming the
variable. This is the part of pydantic-settings the sidecar used; importing pydantic cost about
95 ms of the 200 ms a restore may add to a host's cold start (see the README's design section).
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Callable

from sidecar.namespace import Namespace, NamespaceError, check_template, resolve
from sidecar.paths import DEFAULT_IGNORE, Root, is_within, make_roots
from sidecar.store import directory_of, store_kind

DEFAULT_ROOTS = [".checkpoints", ".function_approvals"]
LAYOUTS = ("agent-framework", "agentserver")
ENV_PREFIX = "SIDECAR_"


def layout_roots(layout: str, env: dict[str, str] | None = None) -> list[str]:
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


DEFAULT_HTTP_PORT = 7479  # clear of the host (8088), Prometheus exporters (9100-9999) and common app ports


def default_store() -> str:
    """Outside the working directory and outside any root: ``$XDG_STATE_HOME/checkpoint-sidecar/store``."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "checkpoint-sidecar", "store")


class ConfigError(ValueError):
    """Configuration problems, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


# -- checks beyond type and bounds (a ValueError's text becomes the problem line) ----------------

def _check_prefix(v: str) -> str:
    return check_template(v)  # NamespaceError is a ValueError: one line naming SIDECAR_PREFIX


def _check_store(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    store_kind(v)  # raises for unsupported schemes
    return v.strip()


def setting(default: Any, help: str, *, choices: tuple[str, ...] = (), ge: float | None = None,
            le: float | None = None, gt: float | None = None, check: Callable[[Any], Any] | None = None) -> Any:
    """A :class:`Settings` field: ``default`` (a value, or a callable for a fresh one), the help
    text, and what a value must satisfy besides its type."""
    meta = {"help": help, "choices": choices, "ge": ge, "le": le, "gt": gt, "check": check}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Settings:
    store: str = setting(default_store, "file:///dir, a path, or an Azure Blob container URL", check=_check_store)
    layout: str = setting("agent-framework", "which host's state to mirror", choices=LAYOUTS)
    roots: list[str] = setting(list, "trees to mirror (overrides the layout)")
    commit: str = setting("auto", "per-file, or crash-consistent snapshots across files (auto: snapshot for agentserver)",
                          choices=("auto", "per-file", "snapshot"))
    prefix: str = setting("", "namespace inside the store; may refer to variables, e.g. 'agents/{POD_NAME}'",
                          check=_check_prefix)
    session_namespace: str = setting("auto", "auto: each platform session (FOUNDRY_AGENT_SESSION_ID) in "
                                     "<prefix>/<agent>/<session>; off: the prefix as written", choices=("auto", "off"))
    ignore: list[str] = setting(lambda: list(DEFAULT_IGNORE), "basename globs never mirrored")

    restore: str = setting("auto", "restore rule before sync/run", choices=("auto", "skip", "force"))
    restore_optional: bool = setting(False, "start even when the store cannot be reached")
    restore_corrupt: str = setting("fail", "a stored object whose bytes fail their sha256: fail the restore, or skip it "
                                   "(left out, reported, kept in the store)", choices=("fail", "skip"))
    concurrency: int = setting(16, "uploads/downloads in flight", ge=1, le=256)
    debounce_ms: int = setting(25, "watcher polling step while idle (ms): first-write latency vs idle CPU", ge=2, le=1000)
    reconcile_interval: float = setting(120.0, "seconds between local rescans (0: off)", ge=0)
    full_reconcile_interval: float = setting(3600.0, "seconds between store listings (0: start only)", ge=0)
    drain_timeout: float = setting(20.0, "seconds to flush pending work on shutdown", ge=0)
    fence_window: float = setting(2.0, "seconds a proof of store ownership is trusted", gt=0)
    fence_margin: float = setting(8.0, "extra wait before writing after a recently active owner", ge=0)
    max_file_size: int = setting(256 * 1024 * 1024, "files larger than this are not mirrored", ge=1)
    http_addr: str = setting(f"127.0.0.1:{DEFAULT_HTTP_PORT}", "host:port of /livez /readyz /metrics ('' to disable)")
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("auto", "auto (json unless a terminal), json, text", choices=("auto", "json", "text"))

    #: resolved by :func:`load` from ``prefix``, ``session_namespace`` and the environment
    namespace: Namespace = field(default_factory=Namespace, metadata={"derived": True})

    # -- derived ---------------------------------------------------------------------------
    def root_list(self, cwd: str | None = None) -> list[Root]:
        return make_roots(self.roots or layout_roots(self.layout), cwd or os.getcwd())

    def snapshot_commits(self) -> bool:
        return self.commit == "snapshot" or (self.commit == "auto" and self.layout == "agentserver")

    def http_host_port(self) -> tuple[str, int] | None:
        if not self.http_addr:
            return None
        host, _, port = self.http_addr.rpartition(":")
        return (host.strip("[]") or "127.0.0.1"), int(port)


# -- conversion ------------------------------------------------------------------------------------

_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def _convert(kind: str, raw: Any) -> Any:
    """``raw`` (a string from the environment, or a flag's value) as ``kind``; ValueError if not."""
    if kind == "str":
        if not isinstance(raw, str):
            raise ValueError(f"must be text, got {raw!r}")
        return raw
    if kind == "list[str]":
        if isinstance(raw, str):
            return [p.strip() for p in raw.split(",") if p.strip()]
        if isinstance(raw, (list, tuple)) and all(isinstance(p, str) for p in raw):
            return list(raw)
        raise ValueError(f"must be a comma-separated list, got {raw!r}")
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        word = str(raw).strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ValueError(f"must be true or false, got {raw!r}")
    if kind == "int":
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError(f"must be a whole number, got {raw!r}")
        try:
            return int(raw)
        except ValueError:
            pass
        try:  # "8.0" is a whole number too
            value = float(raw)
        except ValueError:
            value = math.nan
        if not value.is_integer():
            raise ValueError(f"must be a whole number, got {raw!r}")
        return int(value)
    if kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ValueError(f"must be a number, got {raw!r}")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"must be a number, got {raw!r}") from None
        if math.isnan(value):
            raise ValueError("must be a number, got nan")
        return value
    raise AssertionError(f"no conversion for {kind}")  # a new field type needs one here


def _num(value: float) -> str:
    """A number for a message: ``2``, ``0.5``, ``inf``; a huge integer shortened, never an error."""
    if isinstance(value, float):
        return f"{value:g}"
    text = str(value)
    return text if len(text) <= 24 else f"{text[:8]}...({len(text)} digits)"


def _check(value: Any, meta: dict[str, Any]) -> Any:
    if meta["choices"]:
        value = value.lower()
        if value not in meta["choices"]:
            raise ValueError(f"must be one of {', '.join(meta['choices'])}; got {value!r}")
    if meta["ge"] is not None and value < meta["ge"]:
        raise ValueError(f"must be at least {_num(meta['ge'])}; got {_num(value)}")
    if meta["le"] is not None and value > meta["le"]:
        raise ValueError(f"must be at most {_num(meta['le'])}; got {_num(value)}")
    if meta["gt"] is not None and value <= meta["gt"]:
        raise ValueError(f"must be more than {_num(meta['gt'])}; got {_num(value)}")
    if meta["check"] is not None:
        value = meta["check"](value)
    return value


def _settings(overrides: dict[str, Any], env: dict[str, str], problems: list[str]) -> Settings | None:
    from_env = {k.upper(): v for k, v in env.items() if k.upper().startswith(ENV_PREFIX)}
    values: dict[str, Any] = {}
    for f in fields(Settings):
        if f.metadata.get("derived"):
            continue
        variable = ENV_PREFIX + f.name.upper()
        if overrides.get(f.name) is not None:
            raw = overrides[f.name]
        elif variable in from_env:
            raw = from_env[variable]
        else:
            raw = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
        try:
            values[f.name] = _check(_convert(f.type, raw), f.metadata)  # type: ignore[arg-type]
        except ValueError as e:
            problems.append(f"{variable}: {e}")
    unknown = sorted(set(overrides) - {f.name for f in fields(Settings)})
    if unknown:
        raise TypeError(f"unknown settings {unknown}")  # a bug in the caller, not the operator's input
    return None if problems else Settings(**values)


def unknown_variables(env: dict[str, str] | None = None) -> list[str]:
    """``SIDECAR_*`` variables that name no setting (a typo such as ``SIDECAR_STOR``): ignored,
    and worth a warning."""
    env = os.environ if env is None else env
    known = {ENV_PREFIX + f.name.upper() for f in fields(Settings) if not f.metadata.get("derived")}
    return sorted(k for k in env if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)


def load(overrides: dict[str, object] | None = None, cwd: str | None = None,
         env: dict[str, str] | None = None) -> tuple[Settings, list[Root]]:
    """Settings from the environment with ``overrides`` (CLI flags) on top, fully validated.

    Raises :class:`ConfigError` listing every problem, one line each.
    """
    problems: list[str] = []
    env = os.environ if env is None else env
    settings = _settings(overrides or {}, env, problems)
    if settings is None:
        raise ConfigError(problems)
    try:
        settings = replace(settings, namespace=resolve(settings.prefix, env, settings.session_namespace))
    except NamespaceError as e:
        problems.append(f"{e.variable}: {e}")
    roots: list[Root] = []
    try:
        roots = settings.root_list(cwd)
        if not roots:
            problems.append("SIDECAR_ROOTS: no root to mirror")
    except ValueError as e:
        problems.append(f"SIDECAR_ROOTS: {e}")
    if store_kind(settings.store) == "directory":
        store_dir = os.path.normpath(os.path.join(cwd or os.getcwd(), directory_of(settings.store)))
        for r in roots:
            if is_within(store_dir, r.path) or is_within(r.path, store_dir):
                problems.append(
                    f"SIDECAR_STORE: {store_dir} overlaps the mirrored root {r.path}; "
                    "put the store outside every root"
                )
    if settings.http_addr:
        try:
            settings.http_host_port()
        except ValueError:
            problems.append(f"SIDECAR_HTTP_ADDR: expected host:port, got {settings.http_addr!r}")
    if problems:
        raise ConfigError(problems)
    return settings, roots
