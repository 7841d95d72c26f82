"""The package's layout: prepack's modules import one another without a cycle, none takes another's
private names, and the building wing never reaches into the training wing. Read from their `import` and
`from` statements (anywhere in a module, under TYPE_CHECKING too) and their `import_module`/`require`
calls of a named prepack module, via ast."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import prepack

_PACKAGE = Path(prepack.__file__).parent
_DYNAMIC_IMPORTS = {"import_module", "require"}  # importlib's, and prepack.errors.require


# The two wings (README, "Where things are"): building never imports torch, so it never imports training.
_BUILDING = ("prepack.sources", "prepack.building", "prepack.formats", "prepack.storage", "prepack.exports")
_TRAINING = ("prepack.training", "prepack.model")


def _file(name: str) -> Path:
    """The source file of module or package `name`."""
    path = _PACKAGE.joinpath(*name.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _packages() -> set[str]:
    return {"prepack"} | {info.name for info in pkgutil.walk_packages(prepack.__path__, "prepack.") if info.ispkg}


def _modules() -> dict[str, ast.Module]:
    """Every module and package of prepack, by its dotted name, parsed."""
    names = ["prepack"] + [info.name for info in pkgutil.walk_packages(prepack.__path__, "prepack.")]
    return {name: ast.parse(_file(name).read_text()) for name in names}


def _imports(name: str, tree: ast.Module, modules: set[str]) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for each prepack module that `name` imports."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package `name` lies in (or is)
                parts = name.split(".") if name in _packages() else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                source = ".".join(parts + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:  # `from prepack import families`: the module, not a name
                    found.append((submodule, None, node.lineno))
                else:
                    found.append((source, alias.name, node.lineno))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if function in _DYNAMIC_IMPORTS and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, None, node.lineno))
    return [(module, taken, line) for module, taken, line in found if module in modules and module != name]


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """Each module's imported prepack modules, and every private name taken across modules."""
    modules = _modules()
    graph, private = {}, []
    for name, tree in modules.items():
        imports = _imports(name, tree, set(modules))
        graph[name] = {module for module, _, _ in imports}
        private += [f"{name}, line {line}: {taken} from {module}" for module, taken, line in imports if taken and taken.startswith("_")]
    return graph, private


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as the modules along it (the first one again at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            if (cycle := visit(imported)) is not None:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if (cycle := visit(module)) is not None:
            return cycle
    return None


def test_the_modules_import_one_another_without_a_cycle():
    graph, _ = _graph()
    # The scan sees the edges that are there: an import inside a function, and one at the top.
    assert "prepack.building.engines.ray" in graph["prepack.building.build"] and "prepack.building.write_store" in graph["prepack.building.engines.ray"]
    cycle = _cycle(graph)
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def test_the_building_wing_never_imports_the_training_wing():
    graph, _ = _graph()
    building = [name for name in graph if name.startswith(_BUILDING)]
    assert "prepack.building.build" in building and "prepack.sources.corpus" in building  # the wing is found
    crossings = [f"{name} imports {imported}" for name in building for imported in graph[name] if imported.startswith(_TRAINING)]
    assert crossings == []


def test_no_module_imports_another_modules_private_names():
    _, private = _graph()
    assert private == []


def test_the_cycle_finder_finds_a_cycle_and_the_scan_a_private_name():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    tree = ast.parse("from prepack.x import _hidden, shown\nfrom . import y\nrequire('prepack.z', 'it')\nimport prepack.w")
    names = {"prepack", "prepack.x", "prepack.y", "prepack.z", "prepack.w", "prepack.v"}
    assert sorted(_imports("prepack.v", tree, names)) == [
        ("prepack.w", None, 4),
        ("prepack.x", "_hidden", 1),
        ("prepack.x", "shown", 1),
        ("prepack.y", None, 2),
        ("prepack.z", None, 3),
    ]


@pytest.mark.slow  # imports torch, transformers and ray: ~10 s on 2 cores
def test_every_module_imports_and_the_scan_reads_every_module_loaded():
    modules = set(_modules())
    for name in sorted(modules):
        importlib.import_module(name)
    loaded = {name for name in sys.modules if name == "prepack" or name.startswith("prepack.")}
    assert loaded == modules
