"""Imports run one way through evaluation and report: read from the source as a reader reads it (type
hints included), no module of `ssl_vit.evaluation` imports the report or the CLI, and no modules of
either import each other in a loop."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ssl_vit"
FLOORS = ("ssl_vit.evaluation", "ssl_vit.report")


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every ssl_vit module `path` names in an import, anywhere in it (`from A import B` names A, and A.B
    where that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("ssl_vit.")}


def modules() -> dict[str, Path]:
    """The modules of evaluation and report: name -> source file."""
    folders = [PACKAGE.joinpath(*floor.split(".")[1:]) for floor in FLOORS]
    return {module_of(path): path for folder in folders for path in folder.rglob("*.py")}


def test_evaluation_imports_neither_report_nor_cli():
    above = ("ssl_vit.report", "ssl_vit.cli")
    wrong = {
        name: sorted(m for m in imported(path) if m.startswith(above))
        for name, path in modules().items()
        if name.startswith("ssl_vit.evaluation")
    }
    assert not any(wrong.values()), wrong


def test_no_import_circle_in_evaluation_or_report():
    found = modules()
    edges = {name: imported(path) & set(found) - {name} for name, path in found.items()}
    circles = []

    def visit(name: str, path: list[str]) -> None:
        for nxt in sorted(edges[name]):
            if nxt in path:
                circles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(name)

    done: set[str] = set()
    for name in sorted(edges):
        if name not in done:
            visit(name, [name])
    assert not circles, circles
