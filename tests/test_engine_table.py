"""The engine table is the one place engines are named: no module outside an engine's own branches on its name.

Read from the source with ``ast``: a comparison with an engine's name (``engine == "sglang"``, ``"vllm" in cmds``),
a lookup by it (``verdicts["vllm"]``, ``.get("sglang")``, ``.pop("vllm")``) or a dict keyed by it, anywhere in the
package except that engine's own module (``engine/<name>.py``), the table (``engine/table.py``) and the family
entries (``EngineRules.drafters``: each engine's drafter class per family, which the issue keeps with the families).
The verification rule called ``vllm`` (``records.sampling.RULES``) is another vocabulary: a comparison whose other
side is named ``rule`` is not an engine's.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from mtpquant.engine.table import ENGINES, NAMES, EngineName, display, engine, launchable, searched

pytestmark = pytest.mark.dev

PACKAGE = Path(__file__).resolve().parents[1] / "mtpquant"


def _named(node: ast.AST | None) -> str | None:
    """The engine a node names, when it is a string constant equal to an engine's key."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES:
        return node.value
    return None


def _is_rule(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "rule"


def branches(source: str) -> list[tuple[int, str]]:
    """(line, engine) of every branch on an engine's name in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_rule(o) for o in operands):
                continue
            found += [(node.lineno, n) for o in operands if (n := _named(o))]
        elif isinstance(node, ast.Subscript) and (n := _named(node.slice)):
            found.append((node.lineno, n))
        elif isinstance(node, ast.Dict):
            found += [(node.lineno, n) for k in node.keys if (n := _named(k))]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop")
            and node.args
            and (n := _named(node.args[0]))
        ):
            found.append((node.lineno, n))
    return found


def _allowed(rel: str, name: str) -> bool:
    return rel in (f"engine/{name}.py", "engine/table.py") or rel.startswith("families/")


def test_no_module_branches_on_an_engine_name_outside_its_own() -> None:
    scanned = 0
    wrong: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        scanned += 1
        bad = [(line, n) for line, n in branches(path.read_text()) if not _allowed(rel, n)]
        if bad:
            wrong[rel] = bad
    assert scanned > 100  # the package was read (a wrong path would make this pass on nothing)
    assert wrong == {}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('if engine == "sglang": pass', [(1, "sglang")]),
        ('x = "vllm" in cmds', [(1, "vllm")]),
        ('v = verdicts["vllm"]', [(1, "vllm")]),
        ('v = r.verdicts.get("sglang", "")', [(1, "sglang")]),
        ('serve.pop("vllm", None)', [(1, "vllm")]),
        ('d = {"vllm": 1}', [(1, "vllm")]),
        ('if rule == "vllm": pass', []),  # the verification rule, not the engine
        ('if self.rule != "vllm": pass', []),
        ('x = "vllm-python"', []),
    ],
)
def test_the_check_sees_every_form_of_branch(source: str, expected: list[tuple[int, str]]) -> None:
    assert branches(source) == expected


def test_the_table_and_its_type_agree() -> None:
    assert get_args(EngineName) == NAMES == tuple(e.key for e in ENGINES)
    assert len(set(NAMES)) == len(NAMES)
    assert display("vllm") == "vLLM" and display("sglang") == "SGLang" and display("other") == "other"
    with pytest.raises(ValueError, match="unknown engine 'x' \\(known: vllm, sglang"):
        engine("x")
    assert set(launchable()) <= set(NAMES) and set(searched()) <= set(NAMES)


@pytest.mark.parametrize("row", ENGINES, ids=lambda e: e.key)
def test_every_engine_module_has_every_hook(row: object) -> None:
    """An engine's module answers everything the table's readers ask of it (a new engine that forgets one fails
    here, not in the middle of an inspect)."""
    hooks = (
        "mtp_verdict",
        "late_verdict",
        "format_refusal",
        "serve_command",
        "build_expectation",
        "probe",
        "Client",
        "PROBE_MISS",
        "rule_refusal",
        "cpu_sampling_note",
        "module_names",
    )
    adapter = row.adapter  # type: ignore[attr-defined]
    assert [h for h in hooks if not hasattr(adapter, h)] == []
    assert adapter.__name__ == f"mtpquant.engine.{row.key}"  # type: ignore[attr-defined]
