"""Offline real text that exists on every machine: CPython's pydoc topics and stdlib source.

Used as the default calibration data, the default validation prompts and the training text of the
tiny model. pydoc_data.topics is prose (the language reference's help topics); the stdlib modules
are real code. Both ship with every CPython, so nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

__all__ = ["STDLIB_MODULES", "offline_corpus", "offline_documents"]

# A fixed, ordered choice so the corpus is the same on every machine with the same Python.
STDLIB_MODULES = (
    "textwrap",
    "argparse",
    "json.decoder",
    "json.encoder",
    "pathlib",
    "functools",
    "dataclasses",
    "heapq",
    "bisect",
    "fractions",
    "statistics",
    "string",
    "shlex",
    "difflib",
    "csv",
    "queue",
    "calendar",
    "ipaddress",
    "configparser",
    "gettext",
    "locale",
    "tokenize",
    "ast",
    "inspect",
)


def _pydoc_topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(f"pydoc:{k}", str(v)) for k, v in sorted(topics.items())]


def _stdlib_sources() -> list[tuple[str, str]]:
    docs = []
    for mod in STDLIB_MODULES:
        spec = importlib.util.find_spec(mod)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        docs.append((f"stdlib:{mod}", Path(spec.origin).read_text(encoding="utf-8")))
    return docs


def offline_documents(kind: str = "mixed") -> list[tuple[str, str]]:
    """(name, text) documents: ``prose`` (pydoc topics), ``code`` (stdlib source) or ``mixed``."""
    prose = _pydoc_topics() if kind in {"prose", "mixed"} else []
    code = _stdlib_sources() if kind in {"code", "mixed"} else []
    if kind not in {"prose", "code", "mixed"}:
        raise ValueError(f"unknown corpus kind {kind!r}")
    # Interleave so any prefix of the corpus has both prose and code.
    out: list[tuple[str, str]] = []
    for i in range(max(len(prose), len(code))):
        if i < len(prose):
            out.append(prose[i])
        if i < len(code):
            out.append(code[i])
    return out


def offline_corpus(kind: str = "mixed", limit_chars: int | None = None) -> Iterator[str]:
    """Document texts in a fixed order, stopping after ``limit_chars`` characters if given."""
    seen = 0
    for _, text in offline_documents(kind):
        if limit_chars is not None and seen >= limit_chars:
            return
        yield text
        seen += len(text)
