"""The package imports downward only, with no cycle (issue 22; ARCHITECTURE.md names the layers).

Every `import` / `from ... import` in ascend_pool/**/*.py is read from the syntax tree (inside
functions too), and so are the Python imports of the compiled extension's Cython sources
(cython/**/*.pyx|pxi, module ascend_pool._core). An import of our own package is allowed only to
the importer's layer or a lower one, and the module graph must be acyclic. Third-party imports
(torch, numpy, prometheus_client, ...) are not our modules and are not checked; importing our own
modules by string (importlib.import_module("ascend_pool..."), __import__) is refused.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "ascend_pool"
PY_CORE = "ascend_pool._core"

# Lowest first. A module belongs to the layer of its longest listed prefix.
LAYERS = [
    ("leaf", ["errors", "config", "units", "identity", "private_dir", "version", "include", "_sim"]),
    ("native", ["_core", "backend", "sim", "capi"]),
    ("pool", ["pool", "stats", "snapshot", "snapshot_trace", "rmm_log_trace", "replay", "traces", "registry", "current",
               "settings"]),
    ("tenants", ["tenants", "sharing", "api"]),
    ("service", ["metrics", "service"]),
    ("tools", ["bench", "commands", "cli", "integrations", "__main__"]),
]
FACADE = "ascend_pool"
LEVEL = {f"ascend_pool.{m}": i for i, (_, mods) in enumerate(LAYERS) for m in mods}


def layer_of(module):
    """Index of module's layer (len(LAYERS) for the facade); KeyError names an unplaced module."""
    if module == FACADE:
        return len(LAYERS)
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        key = ".".join(parts[:n])
        if key in LEVEL:
            return LEVEL[key]
    raise KeyError(f"{module} is in no layer of tests/test_import_layers.py: place it (and in ARCHITECTURE.md)")


def _modules():
    """{dotted module name: path} of every .py file of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(module):
    return MODULES.get(module, Path()).name == "__init__.py"


def _targets(importer, node):
    """The own-package modules that one import statement loads, as dotted names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == FACADE]
    if node.level:
        base = importer.split(".") if _is_package(importer) else importer.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module.split(".")[0] != FACADE:
        return []
    out = []
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        # `from pkg import sub` loads the submodule; `from pkg import name` runs pkg/__init__.
        out.append(sub if sub in MODULES or sub == PY_CORE else module)
    return out


def _string_imports(tree):
    """Lines where our own modules are imported by string (importlib.import_module, __import__)."""
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name not in ("import_module", "__import__"):
            continue
        arg = node.args[0]
        text = arg.value if isinstance(arg, ast.Constant) else \
            arg.values[0].value if isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant) else ""
        if isinstance(text, str) and (text.startswith(FACADE) or text.startswith(".")):
            bad.append(node.lineno)
    return bad


_CY_IMPORT = re.compile(r"^\s*(?:from\s+(ascend_pool[\w.]*)\s+import\s+([\w, ()]+)|import\s+(ascend_pool[\w.]*))", re.M)


def _function_level(tree):
    """Import statements inside a function or method of tree."""
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return out


def import_graph():
    """({module: {imported module: first line}}, [string-import findings], [function-level own imports])."""
    graph, by_string, late = {}, [], []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = graph.setdefault(module, {})
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(module, node):
                    edges.setdefault(t, f"{path.relative_to(ROOT)}:{node.lineno}")
        by_string += [f"{path.relative_to(ROOT)}:{line}" for line in _string_imports(tree)]
        late += [(module, f"{path.relative_to(ROOT)}:{n.lineno}") for n in _function_level(tree)
                 if _targets(module, n)]
    edges = graph.setdefault(PY_CORE, {})
    for path in sorted((ROOT / "cython").rglob("*.p[yx][xi]")):
        text = path.read_text()
        for m in _CY_IMPORT.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            if m.group(3):
                edges.setdefault(m.group(3), where)
                continue
            for name in (n.split()[0] for n in m.group(2).strip("() ").split(",") if n.strip()):
                sub = f"{m.group(1)}.{name}"
                edges.setdefault(sub if sub in MODULES else m.group(1), where)
    return graph, by_string, late


def find_cycle(graph):
    """One cycle of the graph as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


GRAPH, BY_STRING, LATE = import_graph()

# Own-module imports that may stay inside a function, and why.
LATE_OK = {
    # PEP 562 __getattr__: the exporters' modules import prometheus_client (a third-party import
    # every process that only allocates should not pay for).
    "ascend_pool.metrics": "prometheus_client stays lazy",
    "ascend_pool.service": "prometheus_client stays lazy",
}


def test_every_module_has_a_layer():
    unplaced = []
    for module in sorted(set(GRAPH) | {t for e in GRAPH.values() for t in e}):
        try:
            layer_of(module)
        except KeyError as e:
            unplaced.append(str(e))
    assert not unplaced, "\n".join(unplaced)


def test_imports_go_downward_only():
    upward = []
    for module, edges in sorted(GRAPH.items()):
        if module == FACADE:
            continue  # the facade re-exports every layer
        for target, where in sorted(edges.items()):
            if target == FACADE:
                upward.append(f"{where}: {module} imports the facade (import the defining module instead)")
            elif layer_of(target) > layer_of(module):
                upward.append(f"{where}: {module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_module_graph_is_acyclic():
    # Every cycle is reported (one found, its closing edge dropped, the search repeated).
    graph = {u: dict(e) for u, e in GRAPH.items()}
    cycles = []
    while len(cycles) < 50:
        cycle = find_cycle(graph)
        if not cycle:
            break
        cycles.append(" -> ".join(cycle) + "\n    " + "\n    ".join(
            f"{a} -> {b}: {GRAPH[a][b]}" for a, b in zip(cycle, cycle[1:])))
        del graph[cycle[-2]][cycle[-1]]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_own_imports_sit_at_module_level():
    late = [f"{where}: {module}" for module, where in LATE
            if module not in LATE_OK]
    assert not late, "own-package imports inside functions (hoist them; a cycle is fixed by moving code):\n" + \
        "\n".join(late)


def test_no_own_module_imported_by_string():
    assert not BY_STRING, f"own modules imported by string: {BY_STRING}"


def test_the_checker_sees_cycles_and_function_level_imports():
    # The checker itself: a cycle hidden in a function and a relative import are both edges.
    src = "def f():\n    from .b import x\n"
    tree = ast.parse(src)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _targets("ascend_pool.tenants.context", node) == ["ascend_pool.tenants.b"]
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None
    assert _string_imports(ast.parse("importlib.import_module(f'ascend_pool.commands.{n}')")) == [1]
    assert _string_imports(ast.parse("importlib.import_module('torch_npu')")) == []


def test_each_module_imports_on_its_own():
    # A fresh interpreter per module (no import-order dependence): each module in a child of its
    # own, so that an earlier import cannot help a later one (four at a time).
    mods = sorted(m for m in MODULES if m != FACADE and not m.endswith("__main__"))
    code = ("import subprocess, sys\n"
            "from concurrent.futures import ThreadPoolExecutor\n"
            "def check(m):\n"
            "    r = subprocess.run([sys.executable, '-c', 'import ' + m], capture_output=True, text=True)\n"
            "    return m + ': ' + r.stderr.strip().splitlines()[-1] if r.returncode else None\n"
            "with ThreadPoolExecutor(4) as ex:\n"
            "    bad = [b for b in ex.map(check, sys.argv[1:]) if b]\n"
            "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stdout + r.stderr


def test_architecture_md_names_every_layer_module():
    # A module placed in LAYERS is named in ARCHITECTURE.md's layer table too.
    text = (ROOT / "ARCHITECTURE.md").read_text()
    unnamed = [m for _, mods in LAYERS for m in mods
               if ((PKG / m).is_dir() or (PKG / f"{m}.py").exists()) and f"ascend_pool/{m}" not in text]
    assert not unnamed, f"modules of the layer table missing from ARCHITECTURE.md: {unnamed}"
