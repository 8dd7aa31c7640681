"""Store namespaces: where inside ``SIDECAR_STORE`` one session's state lives, and whose it is.

Many computes run one image with one configuration (a Foundry hosted agent runs one compute per
session; a StatefulSet one pod per replica). Each must keep its state apart, so the prefix every
key is stored under (the *namespace*) is resolved per compute from its environment:

* ``SIDECAR_PREFIX`` refers to variables, e.g. ``agents/{POD_NAME}``: the namespace is its
  expansion, and the compute's *identity* is the referenced variables' values.
* otherwise, when the platform names the session (``FOUNDRY_AGENT_SESSION_ID``, with
  ``FOUNDRY_AGENT_NAME``) and ``SIDECAR_SESSION_NAMESPACE`` is ``auto``: the namespace is
  ``<prefix>/<agent>/<session>`` (``_`` when the agent is unnamed), the identity the session id.
* otherwise the namespace is the prefix as written; with ``SIDECAR_SESSION_NAMESPACE=off`` on a
  platform that names sessions the identity is still the session id, else there is none.

Where the platform names the session, the session is always part of the identity, and with
``auto`` always a segment of the namespace: a template none of whose values is the session id
(``agents/{FOUNDRY_AGENT_NAME}``) gets ``/<session>`` appended, and the session id joins its
identity (with ``off`` too, so a second session is refused rather than sharing the state).
A template never refers to a credential (a name holding KEY, SECRET, PASS, TOKEN, CRED, AUTH,
SAS, PROXY or CONNECTION_STRING anywhere; ``SIDECAR_STORE``, whose URL may carry a SAS token;
``IDENTITY_HEADER``, ``MSI_SECRET``): its value would become a store name, a log line and the owner
marker. An error about a value names the variable and what is wrong, never the value.

The owner marker records the identity (see :mod:`sidecar.fence`): a compute of another identity
never restores from a namespace nor fences its owner. Every value is checked to be one plain name
segment, so no value can reach another namespace (``/``, ``..``, a leading ``.``). Pure: the
environment is passed in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

SESSION_VAR = "FOUNDRY_AGENT_SESSION_ID"
AGENT_VAR = "FOUNDRY_AGENT_NAME"
UNNAMED_AGENT = "_"
#: The longest namespace, in bytes: the store's own limit on a whole name is 1,024.
MAX_NAMESPACE_BYTES = 256
MAX_SEGMENT = 128

_REFERENCE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._~=@+-]*")  # fullmatch: no trailing newline
#: A variable whose value may be a secret, by its name (any case, anywhere in the name): a proxy
#: URL may carry a user and password.
_CREDENTIAL = re.compile(r"KEY|SECRET|PASS|TOKEN|CRED|AUTH|SAS|PROXY|CONNECTION_?STRING", re.I)
#: Named by no such word, yet secrets: the store URL may carry a SAS token, and the managed
#: identity endpoint's header is its secret.
_SECRET_VARIABLES = {"SIDECAR_STORE": "a store URL, which may carry a SAS token",
                     "IDENTITY_HEADER": "the managed identity endpoint's secret header",
                     "MSI_SECRET": "the managed identity endpoint's secret"}
#: A URL with a user (and password) before its host: ``scheme://user:pass@host``.
_USERINFO = re.compile(r"://[^/?#]*@")
_SAFE_TEXT = "letters, digits and . _ ~ = @ + -, not starting with '.'"


class NamespaceError(ValueError):
    """A prefix template or a variable it needs that cannot give a safe namespace (one line);
    ``variable`` is the setting or platform variable to fix."""

    def __init__(self, message: str, variable: str = "SIDECAR_PREFIX") -> None:
        super().__init__(message)
        self.variable = variable


@dataclass(frozen=True)
class Namespace:
    """A resolved namespace: the store prefix, who owns it, and where older releases stored."""

    path: str = ""  # the store's top when empty
    identity: dict[str, str] = field(default_factory=dict)  # variable -> value; empty: none
    #: where a release without session namespaces kept this state (its top-level prefix), when
    #: that differs from ``path``; None when they are the same
    legacy: str | None = None
    #: the directory this namespace of the shared default store was derived from
    #: (:func:`project_namespace`); "" for a namespace that was configured
    project: str = ""

    def identity_text(self) -> str:
        return describe_identity(self.identity)

    def describe(self) -> str:
        shown = self.path or "(top of the store)"
        if self.project:
            return f"{shown} (the default store's namespace for {self.project})"
        return f"{shown} ({self.identity_text()})" if self.identity else shown


def describe_identity(identity: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(identity.items())) or "no identity"


def references(template: str) -> list[str]:
    """The variables ``template`` refers to, in order; :class:`NamespaceError` for stray braces."""
    names = []
    pos = 0
    for m in _REFERENCE.finditer(template):
        _check_no_braces(template, pos, m.start())
        names.append(m.group(1))
        pos = m.end()
    _check_no_braces(template, pos, len(template))
    return names


def _check_no_braces(template: str, start: int, end: int) -> None:
    for i in range(start, end):
        if template[i] in "{}":
            raise NamespaceError(
                f"stray {template[i]!r} at position {i + 1}: a reference is {{NAME}} "
                "(letters, digits, _), not nested, and braces are allowed nowhere else")


def credential_word(name: str) -> str | None:
    """What makes the variable ``name`` a credential (``KEY``, ``SECRET``...), None when nothing does."""
    if name.upper() in _SECRET_VARIABLES:
        return _SECRET_VARIABLES[name.upper()]
    m = _CREDENTIAL.search(name)
    return f"'{m.group(0).strip('_').upper()}' in its name" if m else None


def check_template(template: str) -> str:
    """``template`` with surrounding ``/`` removed, once its syntax and static parts are checked
    and it refers to no credential (whose value is never read)."""
    template = template.strip().strip("/")
    for name in references(template):
        why = credential_word(name)
        if why:
            raise NamespaceError(
                f"refers to {{{name}}}, a credential ({why}): its value would become store names, log lines "
                "and the owner marker; refer to what names the compute, such as {POD_NAME}")
    static = _REFERENCE.sub("x", template)
    if static and any(p in ("", ".", "..") or "\\" in p for p in static.split("/")):
        raise NamespaceError("must be a plain relative name like 'session-42' or 'team/{POD_NAME}'")
    if static and any(p.startswith(".") for p in static.split("/")):
        # '.checkpoints' or '.sidecar' as a segment would reach another namespace's roots or the
        # sidecar's own objects
        raise NamespaceError("a segment must not start with '.' (root and sidecar names do)")
    if not static.isprintable():  # control, format (bidi) and line/paragraph separator characters
        raise NamespaceError("must not contain control, format or separator characters (newline, U+2028, "
                             "U+202E...)")
    if len(template.encode("utf-8", "surrogateescape")) > MAX_NAMESPACE_BYTES:
        raise NamespaceError(f"longer than {MAX_NAMESPACE_BYTES} bytes")
    return template


def _value(env: Mapping[str, str], name: str, referenced: bool = True) -> str:
    value = env.get(name, "")
    where = "SIDECAR_PREFIX" if referenced else name
    if not value:
        raise NamespaceError(f"refers to {{{name}}}, which is unset or empty: set it, or remove the reference")
    why = unsafe_value(value)
    if why:  # the value itself is never shown: it may be a secret (a URL with a password...)
        raise NamespaceError(f"the value of {name} is not a safe name segment: {why} ({_SAFE_TEXT}; "
                             f"at most {MAX_SEGMENT} characters)", where)
    return value


def unsafe_value(value: str) -> str | None:
    """Why ``value`` cannot be a name segment, in words that never quote it; None when it can."""
    if _USERINFO.search(value):
        return "it is a URL with a user name or password"
    if "://" in value:
        return "it is a URL"
    if len(value) > MAX_SEGMENT:
        return f"it is {len(value)} characters long"
    if value.startswith("."):
        return "it starts with '.'"
    bad = next((i for i, c in enumerate(value) if not _SAFE_VALUE.fullmatch(("x" + c) if i else c)), None)
    if bad is not None:
        c = value[bad]
        kind = ("a control, format or separator character" if not c.isprintable() else
                "a space" if c.isspace() else "a character outside that set")
        return f"character {bad + 1} is {kind}"
    return None


def resolve(template: str, env: Mapping[str, str], session_namespace: str = "auto") -> Namespace:
    """The namespace this compute uses, from the (checked) ``SIDECAR_PREFIX`` template, the
    environment and ``SIDECAR_SESSION_NAMESPACE`` (``auto`` or ``off``)."""
    template = check_template(template)
    names = references(template)
    session = env.get(SESSION_VAR, "")
    if names:
        values = {n: _value(env, n) for n in names}
        path = _REFERENCE.sub(lambda m: values[m.group(1)], template)
        head = template.split("{", 1)[0]
        legacy = head.rsplit("/", 1)[0] if "/" in head else ""
        identity = dict(values)
        if session:
            sid = _value(env, SESSION_VAR, referenced=False)
            if sid not in values.values():  # the template names no session: it must not be shared by all
                identity[SESSION_VAR] = sid
                if session_namespace == "auto":
                    path = f"{path}/{sid}"
        return _checked(Namespace(path, identity, legacy))
    if not session:
        return _checked(Namespace(template))
    identity = {SESSION_VAR: _value(env, SESSION_VAR, referenced=False)}
    if session_namespace == "off":
        return _checked(Namespace(template, identity))
    agent = _value(env, AGENT_VAR, referenced=False) if env.get(AGENT_VAR) else UNNAMED_AGENT
    path = "/".join(p for p in (template, agent, identity[SESSION_VAR]) if p)
    return _checked(Namespace(path, identity, template))


def _checked(ns: Namespace) -> Namespace:
    if len(ns.path.encode("utf-8", "surrogateescape")) > MAX_NAMESPACE_BYTES:
        raise NamespaceError(f"the namespace {ns.path[:60]!r}... is longer than {MAX_NAMESPACE_BYTES} bytes")
    return ns


# -- a namespace addressed from a shell (the hints the sidecar prints) ------------------------------

def public_store(url: str) -> tuple[str, bool]:
    """``SIDECAR_STORE`` as a hint may print it, and whether a credential was left out: an http(s)
    URL without its user, password and query (a SAS token), a directory made absolute (the hint
    may be pasted elsewhere)."""
    from urllib.parse import urlsplit, urlunsplit

    text = url.strip()
    try:
        parts = urlsplit(text)
    except ValueError:
        return "<SIDECAR_STORE>", True
    if parts.scheme.lower() in ("http", "https"):
        host = parts.netloc.rsplit("@", 1)[-1]
        hidden = bool(parts.query or "@" in parts.netloc or parts.fragment)
        return urlunsplit((parts.scheme, host, parts.path, "", "")), hidden
    if parts.scheme.lower() == "file":
        return text, False
    import os

    return os.path.abspath(text), False


def _quote(value: str) -> str:
    """``value`` for a POSIX shell, on one line (a control character escaped, never raw)."""
    import shlex

    from sidecar.log import printable

    return shlex.quote(printable(value))


def _as_identity(namespace: str, identity: Mapping[str, str]) -> tuple[str, dict[str, str]] | None:
    """A ``SIDECAR_PREFIX`` template and the variables with which, under
    ``SIDECAR_SESSION_NAMESPACE=off``, :func:`resolve` gives exactly ``namespace`` and ``identity``:
    each identity variable but the session's referred to where its value is a segment of the
    namespace (the session's joins the identity by itself). None when one is not a segment."""
    template = namespace.split("/") if namespace else []
    for name, value in sorted(identity.items()):
        if name == SESSION_VAR:
            continue
        try:
            template[template.index(value)] = "{" + name + "}"
        except ValueError:
            return None
    return "/".join(template), dict(sorted(identity.items()))


def command_for(command: str, store_url: str, namespace: str, identity: Mapping[str, str] | None = None) -> str:
    """The command line that runs ``checkpoint-sidecar <command>`` on ``namespace`` of the store
    ``store_url``, whatever the environment it is pasted in says about sessions: the store and
    the prefix as variables, ``SIDECAR_SESSION_NAMESPACE=off``, every value quoted for a POSIX
    shell (:func:`variables_for`; ``command`` "": the variables alone)."""
    words, notes = _variables(store_url, namespace, identity)
    return " ".join([*words, f"checkpoint-sidecar {command}"] if command else words) + notes


def variables_for(store_url: str, namespace: str, identity: Mapping[str, str] | None = None) -> str:
    """The variables of :func:`command_for`, alone: with ``identity``, those that make a command
    that identity (for a command that checks it): their template when it can be made, else the
    line names them. A credential of the store URL (a SAS token) is never printed: the line
    then says to add it."""
    return command_for("", store_url, namespace, identity)


def _variables(store_url: str, namespace: str, identity: Mapping[str, str] | None) -> tuple[list[str], str]:
    store, hidden = public_store(store_url)
    prefix, variables = namespace, dict[str, str]()
    if identity:
        made = _as_identity(namespace, identity)
        if made is not None:
            prefix, variables = made
    words = [f"SIDECAR_STORE={_quote(store)}", f"SIDECAR_PREFIX={_quote(prefix)}", "SIDECAR_SESSION_NAMESPACE=off"]
    words += [f"{k}={_quote(v)}" for k, v in variables.items()]
    notes = ""
    if identity and not variables:
        notes += f" (as {describe_identity(identity)}, which SIDECAR_PREFIX must refer to)"
    if hidden:
        notes += " (add the store's SAS token, not shown here, to SIDECAR_STORE, or its credentials)"
    return words, notes


#: Where the default store keeps each project's namespace (:func:`project_namespace`).
PROJECTS = "local"


def project_namespace(root_paths: list[str]) -> Namespace:
    """The namespace of the shared default store (``$XDG_STATE_HOME/checkpoint-sidecar/store``,
    used when neither ``SIDECAR_STORE`` nor ``SIDECAR_PREFIX`` is set) for roots at ``root_paths``
    (absolute): ``local/<name>-<hash>``, from the directory that holds them (their common parent:
    the working directory for the default roots), so two projects on one machine never restore
    each other's state. ``<name>`` is that directory's name made safe (for reading only), ``<hash>``
    the first 8 hex digits of the sha256 of its absolute path (what tells two ``app`` directories
    apart). State kept at the top of the store (before namespaces were derived) is its legacy
    place."""
    import hashlib
    import os

    where = os.path.commonpath([os.path.dirname(os.path.normpath(p)) for p in root_paths])
    digest = hashlib.sha256(where.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    name = re.sub(r"[^A-Za-z0-9_~=@+-]+", "-", os.path.basename(where))[:40].strip("-") or "root"
    return _checked(Namespace(f"{PROJECTS}/{name}-{digest}", legacy="", project=where))
