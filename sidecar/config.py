"""One typed configuration, from ``SIDECAR_*`` environment variables and CLI flags (flags win)."""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sidecar.paths import DEFAULT_IGNORE, Root, is_within, make_roots
from sidecar.store import directory_of, store_kind

DEFAULT_ROOTS = [".checkpoints", ".function_approvals"]
LAYOUTS = ("agent-framework", "agentserver")


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


def _split(v: object) -> object:
    if isinstance(v, str):
        return [p.strip() for p in v.split(",") if p.strip()]
    return v


CommaList = Annotated[list[str], NoDecode]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIDECAR_", extra="forbid", validate_default=True)

    store: str = Field(default_factory=default_store, description="file:///dir, a path, or an Azure Blob container URL")
    layout: Literal["agent-framework", "agentserver"] = Field("agent-framework", description="which host's state to mirror")
    roots: CommaList = Field(default_factory=list, description="trees to mirror (overrides the layout)")
    commit: Literal["auto", "per-file", "snapshot"] = Field(
        "auto", description="per-file, or crash-consistent snapshots across files (auto: snapshot for agentserver)")
    prefix: str = Field("", description="namespace inside the store, e.g. one per agent session")
    ignore: CommaList = Field(default_factory=lambda: list(DEFAULT_IGNORE), description="basename globs never mirrored")

    restore: Literal["auto", "skip", "force"] = Field("auto", description="restore rule before sync/run")
    restore_optional: bool = Field(False, description="start even when the store cannot be reached")
    concurrency: int = Field(16, ge=1, le=256, description="uploads/downloads in flight")
    debounce_ms: int = Field(25, ge=2, le=1000, description="watcher polling step while idle (ms): first-write latency vs idle CPU")
    reconcile_interval: float = Field(120.0, ge=0, description="seconds between local rescans (0: off)")
    full_reconcile_interval: float = Field(3600.0, ge=0, description="seconds between store listings (0: start only)")
    drain_timeout: float = Field(20.0, ge=0, description="seconds to flush pending work on shutdown")
    fence_window: float = Field(2.0, gt=0, description="seconds a proof of store ownership is trusted")
    fence_margin: float = Field(8.0, ge=0, description="extra wait before writing after a recently active owner")
    max_file_size: int = Field(256 * 1024 * 1024, ge=1, description="files larger than this are not mirrored")
    http_addr: str = Field(f"127.0.0.1:{DEFAULT_HTTP_PORT}", description="host:port of /livez /readyz /metrics ('' to disable)")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "text"] = "auto"

    @field_validator("roots", "ignore", mode="before")
    @classmethod
    def _comma(cls, v: object) -> object:
        return _split(v)

    @field_validator("log_level", "log_format", "restore", "layout", "commit", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        v = v.strip("/")
        if v and any(p in ("", ".", "..") or "\\" in p for p in v.split("/")):
            raise ValueError("must be a plain relative name like 'session-42' or 'team/session-42'")
        return v

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        store_kind(v)  # raises for unsupported schemes
        return v.strip()

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


def _format_validation(e: ValidationError) -> list[str]:
    out = []
    for err in e.errors():
        field = ".".join(str(x) for x in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        out.append(f"SIDECAR_{field.upper()}: {msg}")
    return out


def load(overrides: dict[str, object] | None = None, cwd: str | None = None) -> tuple[Settings, list[Root]]:
    """Settings from the environment with ``overrides`` (CLI flags) on top, fully validated.

    Raises :class:`ConfigError` listing every problem, one line each.
    """
    try:
        settings = Settings(**{k: v for k, v in (overrides or {}).items() if v is not None})
    except ValidationError as e:
        raise ConfigError(_format_validation(e)) from None
    problems: list[str] = []
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
