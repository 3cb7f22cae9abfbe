"""jdp's layering, checked over its import graph, read with `ast` (of jdp only its lazy `__init__` is imported):

(a) no cycle among module-level imports;
(b) no function-local import that closes a cycle: with every function-local import added, the graph is still
    acyclic (a function-local import must not hide a cycle);
(c) no library module imports the CLI (`jdp.cli`): only what stands above the library (ABOVE_THE_LIBRARY) and the
    module shims of the commands (COMMAND_SHIMS) do;
(d) jdp.compare (the torch extra) imports jdp's public API (`from jdp import NAME`), the CLI and config files and
    its own modules, and beyond them only the library modules in COMPARE_USES, each with the reason.

An import of `jdp.x.y` is an edge to module `jdp.x.y`; `from jdp.x import y` is an edge to `jdp.x.y` when y is a
submodule, else to `jdp.x`; `from jdp import NAME` of a lazy export (`jdp._EXPORTS`) is an edge to the module
that defines it, which is what runs. Imports under `if TYPE_CHECKING:` never run and are left out. The parents
of an imported module (whose `__init__` runs first) are no edges: a package importing its own submodules is no
cycle. Module-level means run at import: anywhere outside a function body (in `if`, `try`, a class...).

KNOWN holds the violations waiting on files owned elsewhere, each with its fix: the checks fail on any other,
and on a KNOWN entry that is gone (then delete it).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "jdp"
CLI = "jdp.cli"  # the commands' package: config files -> jdp.fit, and the other `python -m jdp.X` commands

# What stands above the library and may import the CLI: the CLI itself, the config files, the benchmark (it reads
# configs), the PyTorch comparison (its jdp side is `jdp.cli.train.run`), and the module shims that keep each
# `python -m jdp.X` command's name (they import their command only when run as __main__).
ABOVE_THE_LIBRARY = ("jdp.cli", "jdp.configs", "jdp.perf", "jdp.compare")
COMMAND_SHIMS = frozenset({"jdp.train", "jdp.sample", "jdp.export", "jdp.plot", "jdp.launch", "jdp.bench"})


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# What jdp.compare takes from the library besides the public API and the config layer, and why.
COMPARE_USES = {
    "jdp.metrics": "read_metrics: each run's metrics.jsonl, the per-step losses and gradient norms compared",
    "jdp.params_file": "flatten: the initial weights and the twin's weights in jdp.export's key names",
    "jdp.mesh": "simulate_cpu_devices: the jdp side's device count in its own process",
    "jdp.options": "BACKENDS: the backends `speed` times",
    "jdp.data": "build_source: the DDP workers read the same batches through jdp's numpy-only data code",
    "jdp.data.text": "is_text: whether a config's data is a language model's",
    "jdp.models": "settings, ARCHS, image_shape: the jdp model's settings, ResNet table and image shape, for its "
                  "PyTorch twin",
    "jdp.sync.base": "DDPTwin: the DDP hook that computes what the run's sync strategy computes (Sync.ddp_twin)",
}

# Violations waiting on files this change could not edit: key (as the checks below make it) -> the fix.
KNOWN: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    local: bool  # inside a function body: runs when the function is called, not at import
    public: bool = False  # spelled `from jdp import NAME`: jdp's public API

    def __str__(self) -> str:
        where = "function-local" if self.local else "module-level"
        return f"{self.importer} -> {self.imported} ({_path(self.importer)}:{self.line}, {where})"


def _path(module: str) -> str:
    rel = Path(*module.split("."))
    return str(rel / "__init__.py") if (ROOT.parent / rel).is_dir() else f"{rel}.py"


def _modules() -> dict[str, Path]:
    """Every module of jdp, through the jdp/configs link to the repository's configs/."""
    out = {}
    for folder, _, files in os.walk(ROOT, followlinks=True):
        for file in sorted(f for f in files if f.endswith(".py")):
            parts = (Path(folder) / file).relative_to(ROOT.parent).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = Path(folder) / file
    return out


def _lazy_exports() -> dict[str, str]:
    """`from jdp import NAME` -> the module NAME comes from: jdp/__init__.py's lazy `_EXPORTS`. Importing jdp
    imports nothing else."""
    import jdp

    return dict(jdp._EXPORTS)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, local: bool = False):
    """(import statement, local) for every import under `node`, leaving out `if TYPE_CHECKING:` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, local
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), local)
        else:
            yield from _imports(child, local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict, lazy: dict) -> list[tuple[str, bool]]:
    """(module, public) for each name the statement imports."""
    if isinstance(node, ast.Import):
        return [(alias.name, False) for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importer's package, `level - 1` packages up
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    out = []
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            out.append((f"{base}.{alias.name}", False))
        elif base == "jdp" and alias.name in lazy:
            out.append((lazy[alias.name], True))
        else:
            out.append((base, base == "jdp"))
    return out


@functools.cache
def import_graph() -> tuple[frozenset[str], tuple[Edge, ...]]:
    modules, lazy = _modules(), _lazy_exports()
    edges = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, local in _imports(ast.parse(path.read_text(), str(path))):
            for target, public in _targets(node, package, modules, lazy):
                # A jdp module that does not exist fails its own import, and is no edge here.
                if target != name and target in modules:
                    edges.append(Edge(name, target, node.lineno, local, public))
    return frozenset(modules), tuple(edges)


def _first_per_pair(edges) -> list[Edge]:
    """One edge per (importer, imported): the module-level one if any, else the first."""
    seen, out = set(), []
    for e in sorted(edges, key=lambda e: (e.local, e.line)):
        if (e.importer, e.imported) not in seen:
            seen.add((e.importer, e.imported))
            out.append(e)
    return out


def _shortest_path(edges: list[Edge], start: str, goal: str) -> list[Edge] | None:
    """The fewest edges from `start` to `goal` (module-level edges first among equals), or None."""
    out = collections.defaultdict(list)
    for e in sorted(edges, key=lambda e: e.local):
        out[e.importer].append(e)
    came: dict[str, Edge | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        here = queue.popleft()
        if here == goal:
            path = []
            while came[here] is not None:
                path.append(came[here])
                here = came[here].importer
            return path[::-1]
        for e in out[here]:
            if e.imported not in came:
                came[e.imported] = e
                queue.append(e.imported)
    return None


def _strongly_connected(nodes, edges: list[Edge]) -> list[set[str]]:
    """Tarjan's components of more than one module."""
    out = collections.defaultdict(set)
    for e in edges:
        out[e.importer].add(e.imported)
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(out[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                comp.add(w)
            on_stack.discard(v)
            comp.add(v)
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return comps


def _cycle(path: list[Edge]) -> str:
    return "\n      ".join(str(e) for e in path)


def module_level_cycles() -> dict[str, str]:
    """(a): "cycle M1 M2 ..." (the component's modules, sorted) -> one cycle through it, edge by edge."""
    nodes, edges = import_graph()
    top = _first_per_pair(e for e in edges if not e.local)
    found = {}
    for comp in _strongly_connected(nodes, top):
        inside = [e for e in top if e.importer in comp and e.imported in comp]
        first = min(inside, key=lambda e: (e.importer, e.imported))
        found["cycle " + " ".join(sorted(comp))] = _cycle([first, *_shortest_path(inside, first.imported,
                                                                                  first.importer)])
    return found


def hidden_cycles() -> dict[str, str]:
    """(b): "local IMPORTER -> IMPORTED" (a function-local import) -> the cycle it closes, through any imports."""
    edges = _first_per_pair(import_graph()[1])
    found = {}
    for e in edges:
        back = _shortest_path(edges, e.imported, e.importer) if e.local else None
        if back is not None:
            found[f"local {e.importer} -> {e.imported}"] = _cycle([e, *back])
    return found


def cli_imports() -> dict[str, str]:
    """(c): "cli IMPORTER" (a library module importing jdp.cli) -> the import."""
    return {f"cli {e.importer}": str(e) for e in _first_per_pair(import_graph()[1])
            if _in(e.imported, (CLI,)) and not _in(e.importer, ABOVE_THE_LIBRARY) and e.importer not in COMMAND_SHIMS}


def _compare_may_import(e: Edge) -> bool:
    return e.public or _in(e.imported, ("jdp.compare", CLI, "jdp.configs"))


def compare_imports() -> dict[str, str]:
    """(d): "compare IMPORTED" (a library module jdp.compare imports) -> where."""
    found = collections.defaultdict(list)
    for e in _first_per_pair(import_graph()[1]):
        if e.importer.startswith("jdp.compare.") and not _compare_may_import(e):
            found[f"compare {e.imported}"].append(str(e))
    return {key: "\n      ".join(where) for key, where in found.items()}


def _check(found: dict[str, str], what: str, allowed=()) -> None:
    new = {k: v for k, v in found.items() if k not in KNOWN and k not in allowed}
    assert not new, f"{what}:\n" + "\n".join(f"  {k}:\n      {v}" for k, v in sorted(new.items()))


def test_no_module_level_import_cycle():
    _check(module_level_cycles(), "import cycles among module-level imports")


def test_no_function_local_import_hides_a_cycle():
    _check(hidden_cycles(), "function-local imports that close an import cycle (move the shared part to a module "
                            "both import, or import at module level and let the cycle show)")


def test_no_library_module_imports_the_cli():
    _check(cli_imports(), f"library modules importing the CLI {CLI} (only {ABOVE_THE_LIBRARY} and the shims may)")


def test_compare_imports_the_public_api_the_config_layer_and_itself():
    _check(compare_imports(), "jdp.compare imports library modules outside jdp's public API and the CLI "
                              "(give the reason in COMPARE_USES, or use the public API)",
           allowed={f"compare {m}" for m in COMPARE_USES})


def test_the_exceptions_are_still_needed():
    """A fixed violation leaves KNOWN, and a module jdp.compare no longer uses leaves COMPARE_USES, so that
    neither comes back unnoticed."""
    found = module_level_cycles() | hidden_cycles() | cli_imports() | compare_imports()
    stale = [k for k in KNOWN if k not in found] + [m for m in COMPARE_USES if f"compare {m}" not in found]
    assert not stale, f"no longer needed: delete from tests/test_layers.py KNOWN / COMPARE_USES: {stale}"


def test_the_graph_sees_the_imports():
    """The checks are only as good as the graph: a few edges of each kind it must see, and must not."""
    nodes, edges = import_graph()
    pairs = {(e.importer, e.imported, e.local) for e in edges}
    assert {"jdp", "jdp.train", "jdp.cli.train", "jdp.data.batching", "jdp.configs.base", "jdp.compare.__main__",
            "jdp.perf.bench"} <= nodes
    assert ("jdp.cli.train", "jdp.cli.config", False) in pairs  # from jdp.cli import config as config_lib
    assert ("jdp.cli.train", "jdp.cli.build", False) in pairs  # from jdp.cli.build import build, build_task
    assert ("jdp.train", "jdp.cli.train", False) in pairs  # the shim's import under `if __name__ == "__main__"`
    assert ("jdp", "jdp.distributed", True) in pairs  # initialize's function-local import
    assert ("jdp.cli.config", "jdp.configs.base", False) in pairs  # through the jdp/configs link
    assert ("jdp.perf.bench", "jdp.perf.predict", False) in pairs  # from jdp.perf import predict
    assert not any(e.importer == "jdp" and e.imported == "jdp.data.batching" for e in edges)  # TYPE_CHECKING


def test_the_checks_find_what_they_look_for():
    """The issue's cycle, bench <-> predict, with both imports function-local, as the checks see it."""
    edges = [Edge("jdp.bench", "jdp.predict", 260, True), Edge("jdp.predict", "jdp.bench", 174, True),
             Edge("jdp.predict", "jdp.cli.config", 23, False)]
    assert not _strongly_connected({"jdp.bench", "jdp.predict"}, [e for e in edges if not e.local])
    assert _strongly_connected({"jdp.bench", "jdp.predict", "jdp.cli.config"}, edges) == [{"jdp.bench", "jdp.predict"}]
    assert _shortest_path(edges, "jdp.predict", "jdp.bench") == [edges[1]]
    assert str(edges[0]) == "jdp.bench -> jdp.predict (jdp/bench.py:260, function-local)"
