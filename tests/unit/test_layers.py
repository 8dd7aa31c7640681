"""The import graph of ``sidecar/``: no circle, and no import from a lower layer to a higher one;
and no module of ``sidecar/`` longer than :data:`MAX_MODULE_LINES`.

Every ``import`` and ``from ... import`` of a ``sidecar`` module counts wherever it is: at module
level, inside a function (imported late to keep ``run``'s start light, but a dependency all the
same) and under ``TYPE_CHECKING`` (a type named is a module known). The layers, top first, are those
of docs/ARCHITECTURE.md; a module may import its own layer and those below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SIDECAR = Path(__file__).resolve().parents[2] / "sidecar"
#: A module longer than this is split along its concepts.
MAX_MODULE_LINES = 600

#: Top first. A new module gets a line here (the test says so); ``store.*`` backends are the store's;
#: each module of the packages ``restore``, ``ops`` and ``points`` has its own.
LAYERS: list[tuple[str, set[str]]] = [
    ("entry", {"__main__", "cli"}),
    ("commands", {"lifecycle", "ops.history", "ops.prune", "ops.sessions", "ops.status", "ops.verify"}),
    ("daemon", {"daemon"}),
    ("workers", {"http", "ledger", "ops.pruner", "restore", "restore.asof", "restore.bundles", "restore.finish", "restore.latest",
                 "restore.objects", "restore.place", "restore.points", "restore.progress", "restore.state", "runner",
                 "takeovercheck", "uploader"}),
    ("mirroring", {"hints", "listing", "ops.namespaces", "points.writer", "snapshot", "watcher", "writer"}),
    ("store access", {"fence", "marker", "ops.sessionplan", "ops.verifyplan", "retry", "storeclient", "takeover"}),
    ("state and pure rules", {"health", "known", "plan", "points.format", "points.plan", "queue", "restore.plan"}),
    ("foundation", {"config", "configtypes", "errors", "localfs", "log", "metrics", "namespace", "paths", "platformenv",
                    "restorefs", "store", "tarstream"}),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(SIDECAR).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)  # '' for the package itself


def imports(path: Path, modules: set[str]) -> set[str]:
    """The sidecar modules ``path`` imports (``from sidecar import log`` is ``log``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.removeprefix("sidecar").lstrip(".") for a in node.names if a.name.split(".")[0] == "sidecar")
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package up
                base = package.split(".") if package else []
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "sidecar":
                mod = (node.module or "").removeprefix("sidecar").lstrip(".")
            else:
                continue
            for a in node.names:  # ``from sidecar.store import base`` names a module
                sub = f"{mod}.{a.name}".lstrip(".")
                out.add(sub if sub in modules else mod)
    return {m for m in out if m and m != name}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in SIDECAR.rglob("*.py")}
    modules = set(paths)
    return {name: imports(p, modules) for name, p in paths.items() if name}


def layer_of(module: str) -> int:
    """A module's layer: its own line, else its package's (a store backend, store.azure, is in the store's)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        for i, (_, names) in enumerate(LAYERS):
            if ".".join(parts[:n]) in names:
                return i
    raise AssertionError(f"sidecar.{module} has no layer: add it to LAYERS in {__file__} and to docs/ARCHITECTURE.md")


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower():
    upward = []
    for module, deps in sorted(graph().items()):
        for dep in sorted(deps):
            if layer_of(dep) < layer_of(module):
                upward.append(f"sidecar.{module} ({LAYERS[layer_of(module)][0]}) imports sidecar.{dep} "
                              f"({LAYERS[layer_of(dep)][0]})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_commands_do_not_import_each_other():
    g = graph()
    commands = next(names for layer, names in LAYERS if layer == "commands")
    assert {(m, d) for m in commands for d in g.get(m, ()) if d in commands} == set()


def test_there_is_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []
    circles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(g.get(m, ())):
            if state.get(dep) == 1:
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_graph_sees_function_level_and_type_checking_imports():
    g = graph()
    assert "daemon" in g["lifecycle"]  # imported inside Lifecycle.main
    assert "localfs" in g["known"]  # under TYPE_CHECKING
    assert {"log", "metrics"} <= g["health"]  # ``from sidecar import log, metrics``


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(SIDECAR)): n for p in sorted(SIDECAR.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules of sidecar/ longer than {MAX_MODULE_LINES} lines: {long}"


#: Modules still making a store of their own; each is to go through ``storeclient``.
OWN_FACTORIES: set[str] = set()


def test_storeclient_is_the_only_store_factory():
    """No module of ``sidecar/`` but the store's own and ``storeclient`` calls ``make_store``: a
    store is made from a command's settings in one place (``storeclient``)."""
    makers = set()
    for p in sorted(SIDECAR.rglob("*.py")):
        name = module_name(p)
        if name.split(".")[0] in ("store", "storeclient"):
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "make_store" for a in node.names):
                makers.add(name)
    assert makers == OWN_FACTORIES, f"modules making their store without sidecar.storeclient: {sorted(makers)}"
