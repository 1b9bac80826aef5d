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


def _package_of(path: Path) -> str:
    """The package a file is in (``mtpquant/cli/x.py`` -> ``mtpquant.cli``; ``mtpquant/cli/__init__.py`` too)."""
    rel = path.resolve().relative_to(PACKAGE.parent) if path.resolve().is_relative_to(PACKAGE.parent) else None
    return ".".join(rel.parent.parts) if rel is not None else "mtpquant"


def _imports(path: Path, package: str | None = None) -> set[str]:
    """Every ``mtpquant`` module or package this file imports, anywhere in it; a relative import resolved against
    the file's package (``package``: as if the file were in that one), ``from . import x`` as the module ``x``."""
    found: set[str] = set()
    here = package if package is not None else _package_of(path)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mtpquant."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module == "mtpquant" or (node.level and not node.module):
                found.update(f"{module}.{a.name}" for a in node.names)
            elif module.startswith("mtpquant."):
                found.add(module)
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


def _commands_imported(path: Path) -> set[str]:
    """The other ``cli/*_cmd`` modules a ``cli/*_cmd.py`` file imports (absolute or relative)."""
    mine = f"mtpquant.cli.{path.stem}"
    return {m for m in _imports(path) if m.startswith("mtpquant.cli.") and m.endswith("_cmd") and m != mine}


def test_no_cli_command_module_imports_another() -> None:
    """The floor rule reaches the CLI: a command's module (``cli/*_cmd.py``) imports no other command's; what two
    share lives in a module of its own (``cli/heal_args.py``, ``cli/search_args.py``)."""
    modules = sorted((PACKAGE / "cli").glob("*_cmd.py"))
    assert len(modules) >= 8  # the command modules were read
    assert {p.name: sorted(_commands_imported(p)) for p in modules if _commands_imported(p)} == {}


def test_relative_imports_are_read(tmp_path: Path) -> None:
    """``from .heal_cmd import x`` and ``from . import heal_cmd`` in a cli module are imports of ``cli.heal_cmd``."""
    path = tmp_path / "convert_cmd.py"
    path.write_text(
        "from .heal_cmd import add_schedule_arguments\nfrom . import tune_mtp_cmd\nfrom ..heal import run\n"
    )
    assert _imports(path, "mtpquant.cli") == {"mtpquant.cli.heal_cmd", "mtpquant.cli.tune_mtp_cmd", "mtpquant.heal"}
