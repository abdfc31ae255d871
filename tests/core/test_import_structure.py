"""The package's import structure: no module imports itself through others, nothing in the core folder
(``hf_eagle3/core/``, the remote-code bundle) imports anything but torch, transformers, the standard library and the
core folder, and the draft model imports no decoding code.

Every import statement counts, at module level or inside a function, relative or absolute.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import hf_eagle3

PACKAGE = "hf_eagle3"
ROOT = Path(hf_eagle3.__file__).resolve().parent
CORE = ROOT / "core"
# Modules that run decoding: the draft model must not import them.
DECODING = {"generate_hook", "candidate_generator", "decoding_loop", "tree_candidates", "tree_policy", "target_cache",
            "draft_state", "acceptance", "auto_entry"}
# Third-party packages a core file may import inside a function only (optional for the bundle's user).
LAZY_ONLY = {"safetensors"}


def all_modules() -> dict[str, Path]:
    """Every module of the package (sub-packages included), by dotted name, with its file."""
    modules = {PACKAGE: ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix=PACKAGE + "."):
        spec = importlib.util.find_spec(info.name)
        modules[info.name] = Path(spec.origin)
    return modules


def imports_of(name: str, path: Path, modules: dict) -> list[tuple[str, int, bool]]:
    """``(imported name, line, at module level)`` for every import statement of a module, relative ones resolved
    (``from X import y`` names the submodule ``X.y`` when there is one, else ``X``)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # imports under a module-level try / if run at import time too
        if isinstance(node, (ast.Try, ast.If)):
            top_level |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, node.lineno, id(node) in top_level))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in modules else target, node.lineno, id(node) in top_level))
    return found


def import_graph(modules: dict) -> dict[str, set]:
    """Intra-package edges: module -> the package modules it imports."""
    graph = {}
    for name, path in modules.items():
        graph[name] = {target for target, _, _ in imports_of(name, path, modules) if target in modules and target != name}
    return graph


def find_cycle(graph: dict) -> list | None:
    """A cycle of the graph as a list of modules (first == last), or ``None``."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


@pytest.fixture(scope="module")
def modules():
    return all_modules()


def core_modules(modules: dict) -> set[str]:
    """The modules whose file lies in the core folder, found by path."""
    return {name for name, path in modules.items() if path.resolve().parent == CORE}


def test_every_module_imports(modules):
    assert len(core_modules(modules)) > 20
    for name in modules:
        importlib.import_module(name)


def test_no_import_cycle(modules):
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_core_folder_imports_only_torch_transformers_and_itself(modules):
    core = core_modules(modules)
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for name in sorted(core):
        for target, line, top in imports_of(name, modules[name], modules):
            root = target.split(".")[0]
            if target in core or root in stdlib or root in ("torch", "transformers", "__future__"):
                continue
            if root in LAZY_ONLY and not top:
                continue
            bad.append(f"{name}:{line} imports {target}")
    assert not bad, "the core folder must import only torch, transformers, the standard library and itself:\n" + \
        "\n".join(bad)


def test_draft_model_imports_no_decoding(modules):
    name = f"{PACKAGE}.core.modeling_eagle3"
    graph = import_graph(modules)
    reached, todo = set(), [name]
    while todo:  # what modeling_eagle3 imports, directly or not
        for nxt in graph[todo.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    decoding = sorted(m for m in reached if m.rpartition(".")[2] in DECODING)
    assert not decoding, f"modeling_eagle3 imports decoding modules: {decoding}"
