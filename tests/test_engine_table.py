"""The engine table is the one place engines are named: no module outside an engine's own branches on its name.

Read from the source with ``ast``: a comparison with an engine's name (``engine == "sglang"``, ``"vllm" in cmds``),
a lookup by it (``verdicts["vllm"]``, ``.get("sglang")``, ``.pop("vllm")``) or a dict keyed by it, anywhere in the
package except that engine's own module (``engine/<name>.py``), the table (``engine/table.py``) and the family
entries (``EngineRules.drafters``: each engine's drafter class per family, which the issue keeps with the families).
A comparison with ``"vllm"`` is flagged whatever its other side is called: the verification rule ``--rule vllm``
selects is a record (``records.sampling.ARGMAX_DRAFT``), asked for its properties, never compared by that spelling.
An engine is named by its key (``"trtllm"``) or its display name
(``"TensorRT-LLM"``), alone or in a tuple, list or set it is compared against, in a ``match`` case, or as the prefix
of ``startswith``/``endswith``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from mtpquant.engine.table import ENGINES, NAMES, EngineName, display, engine, launchable, searched

pytestmark = pytest.mark.dev

PACKAGE = Path(__file__).resolve().parents[1] / "mtpquant"


# an engine's key by every name it goes by: its key and its name in messages
_KEYS = {**{e.key: e.key for e in ENGINES}, **{e.display: e.key for e in ENGINES}}


def _named(node: ast.AST | None) -> str | None:
    """The engine a node names, when it is a string constant equal to an engine's key or display name."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _KEYS.get(node.value)
    return None


def _names_in(node: ast.AST) -> list[str]:
    """The engines a comparison operand names: itself, or the members of a tuple, list or set literal."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts if (n := _named(e))]
    n = _named(node)
    return [n] if n else []


def branches(source: str) -> list[tuple[int, str]]:
    """(line, engine) of every branch on an engine's name in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            found += [(node.lineno, n) for o in operands for n in _names_in(o)]
        elif isinstance(node, (ast.MatchValue, ast.Subscript)) and (
            n := _named(node.value if isinstance(node, ast.MatchValue) else node.slice)
        ):
            found.append((node.lineno, n))
        elif isinstance(node, ast.Dict):
            found += [(node.lineno, n) for k in node.keys if (n := _named(k))]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "startswith", "endswith")
            and node.args
        ):
            found += [(node.lineno, n) for n in _names_in(node.args[0])]
    return found


def _allowed(rel: str, name: str) -> bool:
    return rel in (f"engine/{name}.py", "engine/table.py") or rel.startswith("families/")


def misplaced_branches(package: Path) -> tuple[int, dict[str, list[tuple[int, str]]]]:
    """(modules read, {module: [(line, engine)]}) of every branch on an engine's name outside its own module,
    over every ``*.py`` under ``package`` (cli, validate, search, diagnose, ...: the whole package)."""
    scanned = 0
    wrong: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        scanned += 1
        bad = [(line, n) for line, n in branches(path.read_text()) if not _allowed(rel, n)]
        if bad:
            wrong[rel] = bad
    return scanned, wrong


def test_no_module_branches_on_an_engine_name_outside_its_own() -> None:
    scanned, wrong = misplaced_branches(PACKAGE)
    assert scanned > 100  # the package was read (a wrong path would make this pass on nothing)
    # every part of the package was read, not only engine/
    parts = {p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")}
    assert {"cli", "validate", "search", "diagnose", "engine", "convert", "publish", "surgery"} <= parts
    assert wrong == {}


def test_a_planted_branch_fails_the_check(tmp_path: Path) -> None:
    """The check over a copy of the package with one branch planted in the CLI, one in validate and one in the
    search reports exactly those three; the same branch in the engine's own module is allowed."""
    import shutil

    copy = tmp_path / "mtpquant"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    (copy / "cli" / "planted.py").write_text(
        'def f(engine: str) -> int:\n    if engine == "vllm":\n        return 1\n    return 0\n'
    )
    (copy / "validate" / "planted.py").write_text('def f(e: str) -> bool:\n    return e in ("sglang", "other")\n')
    with (copy / "search" / "__init__.py").open("a") as f:
        f.write('\n\ndef _planted(name: str) -> bool:\n    return name.startswith("TensorRT-LLM")\n')
    with (copy / "engine" / "vllm.py").open("a") as f:
        f.write('\n\ndef _planted(engine: str) -> bool:\n    return engine == "vllm"\n')
    lines = len((copy / "search" / "__init__.py").read_text().splitlines())
    _, wrong = misplaced_branches(copy)
    assert wrong == {
        "cli/planted.py": [(2, "vllm")],
        "validate/planted.py": [(2, "sglang")],
        "search/__init__.py": [(lines, "trtllm")],
    }


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('if engine == "sglang": pass', [(1, "sglang")]),
        ('x = "vllm" in cmds', [(1, "vllm")]),
        ('v = verdicts["vllm"]', [(1, "vllm")]),
        ('v = r.verdicts.get("sglang", "")', [(1, "sglang")]),
        ('serve.pop("vllm", None)', [(1, "vllm")]),
        ('d = {"vllm": 1}', [(1, "vllm")]),
        ('if rule == "vllm": pass', [(1, "vllm")]),  # a rule is a record (records.sampling.RULES), not a spelling
        ('if self.rule != "vllm": pass', [(1, "vllm")]),
        ('x = "vllm-python"', []),
        ('ok = engine in ("vllm", "sglang")', [(1, "vllm"), (1, "sglang")]),
        ('ok = engine not in ["trtllm"]', [(1, "trtllm")]),
        ('if label == "TensorRT-LLM": pass', [(1, "trtllm")]),
        ('ok = line.startswith("SGLang")', [(1, "sglang")]),
        ('ok = e.key.endswith(("vllm", "x"))', [(1, "vllm")]),
        ('match engine:\n    case "sglang":\n        pass', [(2, "sglang")]),
        ("if engine == ENGINE: pass", []),  # a name from the table, not a literal
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
        "quantized_mtp_note",
        "module_names",
    )
    adapter = row.adapter  # type: ignore[attr-defined]
    assert [h for h in hooks if not hasattr(adapter, h)] == []
    assert adapter.__name__ == f"mtpquant.engine.{row.key}"  # type: ignore[attr-defined]
