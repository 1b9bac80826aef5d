"""The house's one floor rule: a command imports no other command; the services below them import no command.

Read from the source with ``ast`` (every import: module level, inside functions, under ``TYPE_CHECKING``), so a
new import that breaks the rule fails here, in CI, before it spreads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.dev

PACKAGE = Path(__file__).resolve().parents[1] / "mtpquant"
# One package per command (inspect's work is the shared ``diagnose`` service, called directly by the API).
COMMANDS = ("convert", "graft", "heal", "tune", "validate", "publish")
# Above the commands: they compose them (the CLI, the API with ``convert --heal``, the text forms).
ABOVE = ("cli", "api", "render", "__main__")


def _room(module: str) -> str:
    """``mtpquant.convert.plan`` -> ``convert``; ``mtpquant.api`` -> ``api``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> set[str]:
    """Every ``mtpquant`` module or package this file imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mtpquant."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "mtpquant":
                found.update(f"mtpquant.{a.name}" for a in node.names)
            elif node.module.startswith("mtpquant."):
                found.add(node.module)
    return found


def _graph() -> dict[str, set[str]]:
    """``room/file.py`` -> the rooms it imports."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        module = ".".join(rel.with_suffix("").parts)
        graph[rel.as_posix()] = {_room(m) for m in _imports(path)} - {_room(module)}
    return graph


def test_every_command_has_its_package() -> None:
    assert all((PACKAGE / c / "__init__.py").is_file() for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_imports_no_other_command(command: str) -> None:
    wrong = {f: sorted(rooms & set(COMMANDS)) for f, rooms in _graph().items() if f.startswith(f"mtpquant/{command}/")}
    assert {f: r for f, r in wrong.items() if r} == {}


def test_the_services_below_import_no_command() -> None:
    below = {f: rooms for f, rooms in _graph().items() if _room(f.removesuffix(".py").replace("/", ".")) not in
             (*COMMANDS, *ABOVE)}
    assert len(below) > 50  # the services were read (a wrong path would make this test pass on nothing)
    assert {f: sorted(r & set(COMMANDS)) for f, r in below.items() if r & set(COMMANDS)} == {}


def test_the_rule_is_read_from_real_imports(tmp_path: Path) -> None:
    """The reader sees every form of import the code uses (a function-local one, one under TYPE_CHECKING)."""
    path = tmp_path / "x.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "import mtpquant.graft.run\n"
        "if TYPE_CHECKING:\n    from mtpquant.heal.options import HealOptions\n"
        "def f():\n    from mtpquant import validate\n    from mtpquant.records.validation import REPORT_DIR\n"
    )
    assert _imports(path) == {"mtpquant.graft.run", "mtpquant.heal.options", "mtpquant.validate",
                              "mtpquant.records.validation"}
