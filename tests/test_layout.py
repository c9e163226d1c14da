"""The house rules of docs/design.md ("Layout and dependencies"), read from the code's own import
statements (those under TYPE_CHECKING and inside functions too): each part imports only the parts
below it, and no module imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAPER = {"trainer", "trainer.config", "trainer.batch", "trainer.model", "trainer.objectives",
         "trainer.wordvecs", "trainer.pictures"}

# part -> the parts its modules may import (besides the standard library and third parties)
ALLOWED = {
    "defrag": {"defrag"},
    "featurizer": {"defrag", "featurizer"},
    "paper": {"defrag", "paper"},
    "data": {"defrag", "paper", "data"},
    "store": {"defrag", "paper", "store"},
    "evaluate": {"defrag", "paper", "data", "store"},
    "training": {"defrag", "paper", "data", "store", "evaluate", "training"},
    "search": {"defrag", "featurizer", "paper", "data", "store", "evaluate", "search"},
    "caption": {"defrag", "featurizer", "paper", "data", "store", "evaluate", "training", "search",
                "caption"},
    "commands": {"defrag", "featurizer", "paper", "data", "store", "evaluate", "training",
                 "search", "caption"},
}


def module_files() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    modules = {}
    for package in ("defrag", "featurizer", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def part_of(module: str) -> str:
    """The part (ALLOWED's key) a module of the project belongs to."""
    top, _, rest = module.partition(".")
    if top != "trainer":
        return top
    if module in PAPER or rest.startswith("encoders"):
        return "paper"
    if module == "trainer.main":
        return "training"
    return {"evaluate": "evaluate", "commands": "commands"}.get(rest, rest.split(".")[0])


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules that `path` (module `name`) imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of `name`
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" in modules)
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def test_each_part_imports_only_the_parts_below_it() -> None:
    wrong = [f"{name} ({part_of(name)}) imports {other} ({part_of(other)})"
             for name, imported in import_graph().items() for other in sorted(imported)
             if part_of(other) not in ALLOWED[part_of(name)]]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle() -> None:
    graph = import_graph()
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                return [*path[path.index(other):], other] if other in path else [module, other]
            if other not in state and (cycle := visit(other, [*path, other])):
                return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            assert cycle is None, " -> ".join(cycle)


def test_the_rules_see_the_imports_they_judge() -> None:
    """The reader above finds real edges: without them the two tests could not fail."""
    graph = import_graph()
    assert "trainer.config" in graph["trainer.model"]
    assert any(part_of(module) == "training" for module in graph["trainer.main"])
    assert part_of("trainer.search.serve") == "search"
    assert part_of("trainer.encoders.gru") == "paper"
