"""The package's shape: every module imports alone, no import circle, no module too long to read."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, assert_ok

PACKAGE = ROOT / "hvdtrain"
MAX_LINES = 360


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of hvdtrain (a package by its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The hvdtrain modules this module imports, at module level and inside functions, leaving out
    `if TYPE_CHECKING:` blocks. `from a.b import c` names a.b.c when that is a module, else a.b."""
    known = _modules()
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.add(child if child in known else source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in known and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = walk(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = walk(start)
            if found:
                return found
    return None


def test_no_import_circle():
    graph = _graph()
    assert "hvdtrain.train.fit" in graph and "hvdtrain.train.setup" in graph["hvdtrain.train.checkpointer"]
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


_IMPORT_EACH = """
import importlib, sys, traceback
import torch  # once: every module below may import it
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "hvdtrain" or m.startswith("hvdtrain.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=3).strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
    """Each module in an interpreter with no hvdtrain module loaded yet, so none relies on another's
    import having run first (what a circle, or a missing import, breaks)."""
    names = sorted(_modules())
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert_ok(done)


def test_no_module_is_too_long():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_each_folder_says_what_it_holds():
    for init in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{init.relative_to(ROOT)} has no docstring"


# Layers run one way: the loop's folder sits above what it uses; data and io know ranks and sizes,
# not the engine.
FORBIDDEN = {
    "hvdtrain.tasks": ("hvdtrain.train",),
    "hvdtrain.data": ("hvdtrain.train", "hvdtrain.engine"),
    "hvdtrain.io": ("hvdtrain.train", "hvdtrain.engine"),
    "hvdtrain.numerics": ("hvdtrain.train", "hvdtrain.tasks", "hvdtrain.data", "hvdtrain.io"),
}
ALLOWED_BELOW_DATA = {"hvdtrain.engine.environment"}  # the launchers' variables: no engine in it


def test_layers_import_one_way():
    wrong = []
    for module, imported in _graph().items():
        for layer, forbidden in FORBIDDEN.items():
            if module == layer or module.startswith(layer + "."):
                wrong += [f"{module} imports {name}" for name in sorted(imported)
                          if name.startswith(forbidden) and name not in ALLOWED_BELOW_DATA]
    assert not wrong, "\n".join(wrong)


MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 7


def test_training_functions_stay_small():
    """No function in train/ longer than a screen or taking more than 7 parameters (self and cls
    aside): a feature adds a component or a hook, not one more parameter."""
    big = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                args = node.args
                names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
                count = len([n for n in names if n not in ("self", "cls")])
                count += bool(args.vararg) + bool(args.kwarg)
                if lines > MAX_FUNCTION_LINES or count > MAX_PARAMETERS:
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines, {count} parameters")
    assert not big, "\n".join(big)


def test_training_never_asks_which_sampler_it_has():
    named = [str(path.relative_to(ROOT)) for path in sorted((PACKAGE / "train").rglob("*.py"))
             if "StreamBatchSampler" in path.read_text() or "ShardedBatchSampler" in path.read_text()]
    assert not named, f"train/ names a concrete sampler: {named}"
