"""The package's module-level import graph, read with `ast` (nothing is imported): no cycles, no upward edges.

Layers, lowest first (a module imports from its own package and from lower layers only):
  errors, beside < config, devices < models < data < training < inference < generation < pipeline < train, demo, doctor, cli
`data` reads, tokenizes and packs; `training` is the objective and the step; `inference` is speculative decoding and
its runners (it drafts with the objective's block attention); `generation` is batched decoding for regeneration
and self-written prompts. A function-local import is not an edge of the module graph; one that would close a cycle
if it were made at module level exists to dodge that cycle, and one that points at a higher layer is an upward edge
hidden inside a function: the tests below allow neither.
"""

from __future__ import annotations

import ast
from pathlib import Path


SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "dflash_train"

# Lowest first. Top-level modules (cli, demo, doctor, train, config, errors, beside, devices) are placed by name.
LAYERS = [
    {"errors", "beside"},
    {"config", "devices"},
    {"models"},
    {"data"},
    {"training"},
    {"inference"},
    {"generation"},
    {"pipeline"},
    {"train", "demo", "doctor", "cli"},
]


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted((SRC / PKG).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom | ast.Import, modules: dict[str, Path]) -> list[str]:
    """The package modules one import statement in `module` names (absolute and relative forms)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")
            if not _is_package(module, modules):
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        # `from pkg import sub` names a submodule when one exists; otherwise the name is an attribute of `pkg`.
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
    out = []
    for name in names:
        while name and name not in modules:        # `import pkg.mod.attr` style: the longest module prefix
            name = name.rpartition(".")[0]
        if name.startswith(PKG) and name in modules:
            out.append(name)
    return out


def _walk_imports(tree: ast.Module, local: bool):
    """Module-level imports (local=False; `if TYPE_CHECKING` and try blocks included, defs excluded) or the imports
    inside functions and methods (local=True)."""
    def visit(node, in_def: bool):
        for child in ast.iter_child_nodes(node):
            child_in_def = in_def or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and child_in_def == local:
                yield child
            yield from visit(child, child_in_def)
    yield from visit(tree, False)


def _is_type_checking(tree: ast.Module, node: ast.AST) -> bool:
    for block in ast.walk(tree):
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
            if any(n is node for n in ast.walk(block)):
                return True
    return False


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports at module level (typing-only imports left out: they never run)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for node in _walk_imports(tree, local=False):
            if _is_type_checking(tree, node):
                continue
            edges.update(t for t in _resolve(name, node, modules) if t != name)
        # A submodule's import runs its parent packages' __init__ first, but that is not an edge of its own code.
        graph[name] = edges
    return graph


def function_local_imports() -> list[tuple[str, str, str]]:
    """(module, target, function) for every package import made inside a function."""
    modules = _modules()
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    out.extend((name, t, fn.name) for t in _resolve(name, node, modules) if t != name)
    return sorted(set(out))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [m0, m1, ..., m0], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
    return None


def layer_of(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    for i, names in enumerate(LAYERS):
        if part in names:
            return i
    return len(LAYERS)   # the package's own __init__: the top


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if layer_of(t) > layer_of(m))


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def cycle_dodging_imports(graph: dict[str, set[str]]) -> list[str]:
    """Function-local imports m -> t where t already reaches m at module level: made at the top, each would close a
    cycle, so the function-local form is what keeps the graph acyclic."""
    return sorted({f"{m} -> {t} (in {fn})" for m, t, fn in function_local_imports() if _reaches(graph, t, m)})


def local_upward_imports() -> list[str]:
    return sorted({f"{m} -> {t} (in {fn})" for m, t, fn in function_local_imports() if layer_of(t) > layer_of(m)})


def test_graph_is_read_from_the_sources():
    graph = import_graph()
    assert f"{PKG}.training.objective" in graph
    assert f"{PKG}.models.drafter" in graph[f"{PKG}.training.objective"]     # a relative `from ..models.drafter`
    assert all(t.startswith(PKG) for ts in graph.values() for t in ts)


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_relative_imports_resolve():
    mods = {"dflash_train": Path("__init__.py"), "dflash_train.data": Path("data/__init__.py"),
            "dflash_train.data.packing": Path("packing.py"), "dflash_train.training": Path("training/__init__.py"),
            "dflash_train.training.objective": Path("objective.py")}
    node = ast.parse("from ..training.objective import x").body[0]
    assert _resolve("dflash_train.data.packing", node, mods) == ["dflash_train.training.objective"]
    node = ast.parse("from . import packing").body[0]
    assert _resolve("dflash_train.data", node, mods) == ["dflash_train.data.packing"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_layer_checks_see_an_upward_and_a_dodging_import():
    graph = {"dflash_train.data.packing": {"dflash_train.training.objective"}, "dflash_train.training.objective": set()}
    assert upward_edges(graph) == ["dflash_train.data.packing -> dflash_train.training.objective"]
    assert _reaches(graph, "dflash_train.data.packing", "dflash_train.training.objective")
    assert not _reaches(graph, "dflash_train.training.objective", "dflash_train.data.packing")


def test_no_upward_edges():
    up = upward_edges(import_graph())
    assert not up, "imports from a higher layer: " + "; ".join(up)


def test_no_function_local_import_dodges_a_cycle():
    dodging = cycle_dodging_imports(import_graph())
    assert not dodging, "function-local imports that would close a cycle at module level: " + "; ".join(dodging)


def test_no_function_local_upward_imports():
    up = local_upward_imports()
    assert not up, "function-local imports from a higher layer: " + "; ".join(up)
