"""vLLM's own functions, read from the installed vLLM 0.32 of the test engine (``tests/support/vllm_env.py``) and
compiled here as they are: the loader rules that decide whether an MTP loads are plain functions, which run without
vLLM's model modules (whose imports need GPU kernels)."""

from __future__ import annotations

import ast
from typing import Any

import pytest

from tests.support.vllm_env import vllm_env_dir

__all__ = ["vllm_functions", "vllm_method", "vllm_source"]


def vllm_source(relative: str) -> ast.Module:
    """The parsed source of ``vllm/RELATIVE`` in the test engine (the test is skipped where it is not installed)."""
    matches = sorted(vllm_env_dir().glob(f"lib/python3*/site-packages/vllm/{relative}"))
    if not matches:
        pytest.skip(f"the vLLM {relative} of the test engine is not installed (python -m tests.support.vllm_env)")
    return ast.parse(matches[0].read_text(), filename=str(matches[0]))


def vllm_functions(tree: ast.Module, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """vLLM's module-level functions ``names``, compiled from its source as they are."""
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in nodes} == names, "vLLM's source no longer has these functions"
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "<vllm>", "exec"), namespace)
    return {n: namespace[n] for n in names}


def vllm_method(tree: ast.Module, cls: str, name: str) -> Any:
    """A method of one of vLLM's classes, compiled from its source as a plain function (``self`` first)."""
    owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    node = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "<vllm>", "exec"), namespace)
    return namespace[name]
