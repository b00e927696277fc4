"""The frontend's layering, stated: which server modules may import which.

A module imports only from its own layer or below, and never in a cycle; so the
core knows no transport (a second one, HTTP, plugs in above it), and the pool,
the link and recovery, the pieces inside the core, do not know each other.
Every module of batchd stays under 400 lines (generated stubs aside).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.servers import ROOT

SERVER = ROOT / "server"
LAYERS: list[tuple[str, set[str]]] = [
    (
        "leaves: values, settings, processes, the socket",
        {
            *("request", "flow", "errors", "config", "stats", "loopload", "describe"),
            *("supervisor", "frontends", "link", "tracing", "siblings", "parser", "exposition"),
            *("pace", "signals", "zygote", "private"),
            *("jobs.store", "jobs.sqlite", "jobs.database", "jobs.postgres"),
        },
    ),
    (
        "pure pieces and the edge's helpers",
        {
            *("batching.decision", "batching.plan", "batching.latency"),
            *("batching.split_join", "batching.queues", "batching.lanes", "batching.scheduler"),
            *("pool", "recovery"),
            "quarantine",
            *("calls", "auth", "codec", "metrics", "security", "streaming", "jobs.lines"),
            *("unary_steps", "jobs.ids", "index"),
            *("rest_codec", "json_body", "json_data", "handlers", "jobs.chunks", "http_site"),
            "http_serve",
        },
    ),
    ("model control and sequences", {"control", "sequences"}),
    ("the core", {"core"}),
    (
        "transports",
        {
            "service",
            "health",
            "jobs.run",
            "jobs.runner",
            "jobs.upload",
            "jobs.service",
            "jobs.rest",
            "rest",
        },
    ),
    ("the composition root and the command", {"app", "cli", "__main__"}),
]
# Pairs of one layer that must not know each other even so.
STRANGERS = [("pool", "recovery"), ("pool", "link"), ("recovery", "link")]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(SERVER).with_suffix("").parts)


def _runtime(tree: ast.AST) -> Iterator[ast.AST]:
    """Its nodes, but for `if TYPE_CHECKING:` blocks (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            yield from (n for each in node.orelse for n in [each, *_runtime(each)])
            continue
        yield node
        yield from _runtime(node)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in _runtime(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            name = node.module
            if name == "batchd.server":  # from batchd.server import recovery
                found |= {a.name for a in node.names}
            elif name.startswith("batchd.server."):
                found.add(name.removeprefix("batchd.server."))
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("batchd.server.")
                for a in node.names
                if a.name.startswith("batchd.server.")
            }
    return found - {"__version__"}


def _graph() -> dict[str, set[str]]:
    return {
        _module(p): _imports(p)
        for p in SERVER.rglob("*.py")
        if p.name != "__init__.py" or p.parent != SERVER
    }


def test_every_server_module_has_a_layer() -> None:
    placed = set().union(*(mods for _, mods in LAYERS))
    modules = {m for m in _graph() if not m.endswith("__init__")}
    assert modules == placed, f"unplaced: {modules - placed}; gone: {placed - modules}"


def test_modules_import_only_their_layer_or_below() -> None:
    layer = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
    wrong = [
        f"{m} ({LAYERS[layer[m]][0]}) imports {d} ({LAYERS[layer[d]][0]})"
        for m, deps in _graph().items()
        if m in layer
        for d in deps
        if d in layer and layer[d] > layer[m]
    ]
    assert not wrong, "\n".join(wrong)
    graph = _graph()
    for a, b in STRANGERS:
        assert b not in graph[a] and a not in graph[b], f"{a} and {b} must not know each other"


def test_there_is_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph.get(m, ()):
            assert state.get(d) != 1, "cycle: " + " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for folder in ("protos", "server", "worker", "client")
        for p in (ROOT / folder).rglob("*.py")
        if "_pb2" not in p.name and (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long
