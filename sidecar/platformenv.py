"""What a container platform puts in the environment, apart from the settings: the variables that
say the process runs on one (:func:`platform_variable`), the prefixes Foundry reserves for its own,
and kubelet's service links (:func:`is_service_link`), whose names can look like settings
(``SIDECAR_PORT`` for a Service named ``sidecar``) and are never one. Pure.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Mapping

#: Set by these, the process runs on a container platform: its local disk goes with the container.
PLATFORM_VARIABLES = ("KUBERNETES_SERVICE_HOST", "CONTAINER_APP_NAME", "FOUNDRY_HOSTING_ENVIRONMENT",
                      "FOUNDRY_AGENT_SESSION_ID")
#: The prefixes Foundry reserves for the variables it sets; no setting may use them.
RESERVED_PREFIXES = ("FOUNDRY_", "AGENT_")
#: kubelet's service links for a Service ``<NAME>`` (upper case, ``-`` as ``_``) with ports
#: ``<n>``/``<PROTO>`` and port names: ``<NAME>_SERVICE_HOST``, ``<NAME>_SERVICE_PORT[_<port name>]``,
#: ``<NAME>_PORT[_<n>_<PROTO>[_PROTO|_PORT|_ADDR]]``. Matched as kubelet writes them (upper case).
SERVICE_LINK = re.compile(r"[A-Z0-9_]+_SERVICE_HOST|[A-Z0-9_]+_SERVICE_PORT(?:_[A-Z0-9_]+)?"
                          r"|[A-Z0-9_]+_PORT(?:_[0-9]+_(?:TCP|UDP|SCTP)(?:_PROTO|_PORT|_ADDR)?)?")
#: Each form of a service link's name and the shape kubelet gives its value: an IP address
#: (``_SERVICE_HOST``, ``_ADDR``), a port number (``_SERVICE_PORT[_…]``, the nested ``_PORT``: the
#: name's ``<n>``), ``<proto>://<ip>:<port>`` (``<NAME>_PORT``; ``<NAME>_PORT_<n>_<PROTO>``: that
#: proto and port), the protocol (``_PROTO``: the name's, lower case).
_LINK_FORMS = (
    (re.compile(r"[A-Z0-9_]+_SERVICE_HOST"), "ip"),
    (re.compile(r"[A-Z0-9_]+_SERVICE_PORT(?:_[A-Z0-9_]+)?"), "number"),
    (re.compile(r"[A-Z0-9_]+_PORT"), "url"),
    (re.compile(r"[A-Z0-9_]+_PORT_(?P<n>[0-9]+)_(?P<proto>TCP|UDP|SCTP)"), "url"),
    (re.compile(r"[A-Z0-9_]+_PORT_(?P<n>[0-9]+)_(?P<proto>TCP|UDP|SCTP)_PROTO"), "proto"),
    (re.compile(r"[A-Z0-9_]+_PORT_(?P<n>[0-9]+)_(?P<proto>TCP|UDP|SCTP)_PORT"), "number"),
    (re.compile(r"[A-Z0-9_]+_PORT_(?P<n>[0-9]+)_(?P<proto>TCP|UDP|SCTP)_ADDR"), "ip"),
)
_LINK_URL = re.compile(r"(?P<proto>tcp|udp|sctp)://(?:\[(?P<ip6>[0-9A-Fa-f:.]+)\]|(?P<ip4>[0-9.]+)):(?P<port>[0-9]{1,5})")


def platform_variable(env: Mapping[str, str] | None = None) -> str | None:
    """The first of :data:`PLATFORM_VARIABLES` set in ``env``: this runs on a container platform."""
    env = os.environ if env is None else env
    return next((v for v in PLATFORM_VARIABLES if env.get(v)), None)


def is_service_link(variable: str, value: str | None = None) -> bool:
    """Whether ``variable`` has the shape of a kubelet service link (:data:`SERVICE_LINK`) and,
    given its ``value``, that value the shape kubelet writes for that form of name
    (:data:`_LINK_FORMS`): ``SIDECAR_HTTP_PORT=9090`` is a typo, not kubelet's ``tcp://…``."""
    if SERVICE_LINK.fullmatch(variable) is None:
        return False
    return value is None or any(_link_value_fits(m, kind, value) for form, kind in _LINK_FORMS
                                if (m := form.fullmatch(variable)) is not None)


def _link_value_fits(name: re.Match[str], kind: str, value: str) -> bool:
    groups = name.groupdict()
    n, proto = groups.get("n"), (groups.get("proto") or "").lower()
    if kind == "ip":
        return _is_ip(value)
    if kind == "number":
        return _is_port(value) and (n is None or int(value) == int(n))
    if kind == "proto":
        return value == proto
    m = _LINK_URL.fullmatch(value)
    return (m is not None and _is_ip(m["ip6"] or m["ip4"]) and _is_port(m["port"])
            and (not proto or (m["proto"] == proto and int(m["port"]) == int(n or 0))))


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _is_port(value: str) -> bool:
    return re.fullmatch(r"[0-9]{1,5}", value) is not None and 0 < int(value) < 65536
