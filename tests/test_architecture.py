"""The shape of the package: imports run one way, at the level of modules and of folders.

The import graph is read from the source with ``ast``, every ``import`` included (inside functions and
``TYPE_CHECKING`` blocks too: an import written inside a function to dodge a cycle is still a cycle), and so is each
module a package's lazy table names (``_LAZY = {name: module}``, ``hf_paged/_lazy.py``): a name imported on first use
is an import all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_paged"

#: The folders (and top-level modules) of ``hf_paged``, lowest first: a module may import only from its own folder
#: and from folders earlier in this list.
LAYERS = (
    "_lazy",
    "_version",
    "envs",
    "_compat",
    "_frozen_heap",
    "_forward_context",
    "kernels",
    "cache",
    "attention",
    "hf",
    "compile",
    "parallel",
    "runner",
    "generate",
    "engine",
    "integrations",
    "bench",
    "server",
    "cli",
    "__main__",
)


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str:
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[str]]:
    """``module -> modules it imports`` over ``hf_paged``, every import statement counted."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            targets += _lazy_table(node)
            edges |= {_resolve(t, modules) for t in targets if t == "hf_paged" or t.startswith("hf_paged.")}
        graph[module] = edges - {module}
    return graph


def _lazy_table(node: ast.AST) -> list[str]:
    """The modules of a ``_LAZY = {"Name": "hf_paged.module", ...}`` assignment (else none)."""
    if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)):
        return []
    return [v.value for v in node.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _folder(module: str) -> str:
    parts = module.split(".")
    return "hf_paged" if len(parts) == 1 else parts[1]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        folders.setdefault(_folder(module), set()).update(_folder(t) for t in targets)
    return {f: t - {f} for f, t in folders.items()}


def test_no_module_imports_itself_back():
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_folder_imports_itself_back():
    folders = folder_graph(import_graph())
    folders.pop("hf_paged")  # the package's __init__: the public API, which gathers every folder's names
    cycle = _find_cycle(folders)
    assert cycle is None, "import cycle between folders: " + " -> ".join(cycle)


def test_folders_import_only_the_layers_below_them():
    folders = folder_graph(import_graph())
    folders.pop("hf_paged")
    assert set(folders) <= set(LAYERS), f"folders missing from LAYERS: {sorted(set(folders) - set(LAYERS))}"
    upward = sorted((f, t) for f, targets in folders.items() for t in targets
                    if t == "hf_paged" or LAYERS.index(t) > LAYERS.index(f))
    assert not upward, "imports that run upward (folder -> folder it must not know): " + ", ".join(
        f"{f} -> {t}" for f, t in upward)


def test_the_graph_reader_sees_cycles_and_in_function_imports(tmp_path):
    """The checks above could pass vacuously if the reader missed imports: it must find both kinds here."""
    graph = import_graph()
    assert "hf_paged.hf._autoregister" in graph["hf_paged"], "the package's own imports were not read"
    assert "hf_paged.engine._engine" in graph["hf_paged"], "the package's lazy table was not read"
    assert "hf_paged.generate._default_cache" in graph["hf_paged"], "an import inside a function was not read"
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert _find_cycle(cyclic) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    source = "def f():\n    from hf_paged.engine import Engine\n"
    tree = ast.parse(source)
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert found and found[0].module == "hf_paged.engine"


def _names_of_the_engine(tree: ast.AST) -> list[str]:
    """Where a module's code receives or reads an engine: a parameter called ``engine`` or ``core``, or an attribute
    read on a name of that kind."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg in ("engine", "core"):
            found.append(f"parameter {node.arg!r} (line {node.lineno})")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in ("engine", "core")):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    return found


def test_the_runner_receives_no_engine_and_the_engine_step_holds_no_model_side():
    """The model side is the runner's: nothing in ``runner/`` is handed the engine (its core) to read back from, and
    the engine's step module reaches tensor parallel and the compiler only through its ``ModelRunner``."""
    for path in sorted((PACKAGE / "runner").glob("*.py")):
        found = _names_of_the_engine(ast.parse(path.read_text()))
        assert not found, f"runner/{path.name} reads an engine: {found}"
    core = import_graph()["hf_paged.engine._core"]
    assert not {t for t in core if _folder(t) in ("parallel", "compile")}, sorted(core)
    assert _names_of_the_engine(ast.parse("def f(core):\n    return core.pool\n"))  # (the reader sees both kinds)
