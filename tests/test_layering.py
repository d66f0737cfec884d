"""The floor plan holds: the import graph of realcore/ (every import, also those inside functions)
has no circle, transport/ imports only api/, trainer/ and rollout/ never import each other, and no
import runs up the layering except from a `__main__` entry point. No file is over 600 lines."""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent / "realcore"

# What each room may import besides itself (DESIGN's dependency direction). None: anything (entry points).
MAY_IMPORT = {
    "api": set(),
    "data": {"api"},
    "transport": {"api"},
    "dfg": {"api"},
    "plot": {"api"},  # realcore.plot: the run's picture, drawn by the master and by its own command
    "backends": {"api", "transport"},
    "workflows": {"api", "data", "transport", "backends"},
    "weights": {"api", "transport", "backends"},
    "mfc": {"api", "data", "transport", "backends", "workflows", "dfg"},
    "trainer": {"api", "data", "transport", "backends", "workflows", "weights", "mfc", "dfg", "plot"},
    "rollout": {"api", "data", "transport", "backends", "workflows", "weights"},
    "launch": None,
    "eval": None,  # python -m realcore.eval
    "serve": None,  # python -m realcore.serve
    "": None,  # realcore/__init__.py
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `from pkg import name`: the module that holds it
                    target = target.rpartition(".")[0]
                if target.startswith("realcore") and target != name:
                    graph.add_edge(name, target)
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_is_in_a_room():
    assert set(map(room, import_graph().nodes)) <= set(MAY_IMPORT), "a new room: give it its place in MAY_IMPORT"


def test_no_import_circle():
    graph = import_graph()
    # A package imports its own modules (its __init__ re-exports); that is not a circle of the design.
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges) if b.startswith(a + ".")])
    cycles = list(nx.simple_cycles(graph, length_bound=12))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_imports_follow_the_layering():
    bad = []
    for a, b in import_graph().edges:
        if a.endswith("__main__") or room(a) == room(b):
            continue
        allowed = MAY_IMPORT[room(a)]
        if allowed is not None and room(b) not in allowed:
            bad.append(f"{a} -> {b}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_trainer_and_rollout_never_import_each_other():
    pairs = [(a, b) for a, b in import_graph().edges if {room(a), room(b)} == {"trainer", "rollout"}]
    assert not pairs, pairs


def test_no_file_over_600_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
