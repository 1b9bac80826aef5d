"""Validation prompts: offline real text (code and prose) held out from the tiny model's training text.

The default prompts come from :mod:`mtpquant.text.corpus` (CPython's pydoc topics and stdlib source), so
they exist on every machine. A fixed part of that corpus is *held out*: the tiny model shipped in
``mtpquant/assets`` never trained on it (``scripts/train_tiny_mtp.py`` trains on
``training_documents()``), so acceptance measured on the default prompts is measured on unseen text.
User prompts come from a file: plain text (one prompt per blank-line-separated paragraph block) or
JSON lines (``{"text": ...}`` or ``{"prompt": ...}`` per line).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mtpquant.checkpoint.source import CheckpointSource, read_text
from mtpquant.errors import ConfigError
from mtpquant.public import public_file
from mtpquant.text.corpus import offline_documents

__all__ = [
    "HELD_OUT_STDLIB",
    "PlannedSequence",
    "context_edges",
    "default_prompts",
    "held_out_documents",
    "is_held_out",
    "load_prompts",
    "long_prompts",
    "plan_sequences",
    "prompt_length",
    "prompts_for",
    "tokenize_prompts",
    "training_documents",
]

log = logging.getLogger(__name__)

# Code held out from training: two whole stdlib modules.
HELD_OUT_STDLIB = ("difflib", "ipaddress")
# Prose held out from training: every pydoc topic whose position in the sorted topic list is 9 mod 10.
_PYDOC_HELD_OUT_MOD = 10
_PYDOC_HELD_OUT_REM = 9


def is_held_out(name: str, pydoc_position: int) -> bool:
    """Whether a corpus document (by name, and its position among pydoc topics) is held out."""
    if name.startswith("stdlib:"):
        return name.removeprefix("stdlib:") in HELD_OUT_STDLIB
    return pydoc_position % _PYDOC_HELD_OUT_MOD == _PYDOC_HELD_OUT_REM


def _split() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    train: list[tuple[str, str]] = []
    held: list[tuple[str, str]] = []
    pydoc_pos = 0
    for name, text in offline_documents("mixed"):
        pos = -1
        if name.startswith("pydoc:"):
            pos = pydoc_pos
            pydoc_pos += 1
        (held if is_held_out(name, pos) else train).append((name, text))
    return train, held


def training_documents() -> list[tuple[str, str]]:
    """(name, text) of the corpus documents the tiny model may train on (all but the held-out ones)."""
    return _split()[0]


def held_out_documents() -> list[tuple[str, str]]:
    """(name, text) of the held-out corpus documents, in corpus order (prose and code interleaved)."""
    return _split()[1]


def _chunks(text: str, size: int) -> list[str]:
    """Split text at line boundaries into pieces of about ``size`` characters (at least 1 line each)."""
    out: list[str] = []
    current: list[str] = []
    length = 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line)
        if length >= size:
            out.append("".join(current))
            current, length = [], 0
    if current and length >= size // 4:
        out.append("".join(current))
    return out


def default_prompts(num_prompts: int = 32, chars: int = 600) -> list[str]:
    """``num_prompts`` distinct held-out pieces of about ``chars`` characters, alternating code and prose while both
    last (then code alone); fewer when the held-out text has fewer pieces. A prompt is never repeated: the
    confidence intervals treat prompts as independent draws."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    held = held_out_documents()
    code = [c for name, text in held if name.startswith("stdlib:") for c in _chunks(text, chars)]
    prose = [c for name, text in held if name.startswith("pydoc:") for c in _chunks(text, chars)]
    n_prose = min(num_prompts // 2, len(prose))
    n_code = min(num_prompts - n_prose, len(code))
    if n_code + n_prose < num_prompts:
        log.warning("the held-out text has %d prompts of ~%d characters; using all of them", n_code + n_prose, chars)

    def spread(pool: list[str], n: int) -> list[str]:  # picks over the whole pool: many documents, not the first
        return [pool[(j * len(pool)) // max(1, n)] for j in range(n)]

    picked_code, picked_prose = spread(code, n_code), spread(prose, n_prose)
    out = [p for pair in zip(picked_code, picked_prose) for p in pair]
    out += picked_code[n_prose:] + picked_prose[n_code:]
    return [p for p in out if p.strip()]


def load_prompts(path: Path | str, num_prompts: int | None = None) -> list[str]:
    """Prompts from a user file: ``.jsonl`` (``text`` or ``prompt`` key) or plain text blocks."""
    from mtpquant.errors import ValidateError
    from mtpquant.net import safejson

    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidateError(f"{path}: cannot read the prompts ({exc.__class__.__name__})") from None
    prompts: list[str] = []
    if path.suffix in {".jsonl", ".json"}:
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = safejson.loads(line)
            except ValueError as exc:
                raise ValidateError(f"{path}:{lineno}: not a JSON line ({exc})") from None
            if isinstance(obj, str):
                prompts.append(obj)
            elif isinstance(obj, dict) and isinstance(text := obj.get("text", obj.get("prompt")), str):
                prompts.append(text)
            else:
                raise ValidateError(f"{path}:{lineno}: expected a string or an object with 'text' or 'prompt'")
    else:
        prompts = [block.strip("\n") for block in raw.split("\n\n\n")]
        if len(prompts) == 1:
            prompts = [block.strip("\n") for block in raw.split("\n\n")]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    log.info("%s: %d prompts", path, len(prompts))
    return _take(prompts, num_prompts)


DEFAULT_PROMPTS = "default: held-out pydoc topics and stdlib source (mtpquant.text.prompts)"


def prompts_for(prompts_file: Path | None, num_prompts: int, min_chars: int = 0) -> tuple[list[str], str]:
    """The prompts of a validation and how the report describes them: ``num_prompts`` from ``prompts_file``, else
    the default held-out ones (of at least ``min_chars`` characters when long contexts are asked for). A file that is
    missing, unreadable or holds no prompt is a one-line usage error."""
    if prompts_file is None:
        if min_chars > 600:
            return long_prompts(num_prompts, min_chars), DEFAULT_PROMPTS + ", joined into long texts"
        return default_prompts(num_prompts), DEFAULT_PROMPTS
    from mtpquant.errors import UsageError

    path = Path(prompts_file)
    if not path.is_file():
        raise UsageError(f"--prompts {path}: no such file")
    try:
        return load_prompts(path, num_prompts), public_file(str(path))  # the report names the file by its name
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        detail = str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}"  # load_prompts names the file
        raise UsageError(f"--prompts {detail}") from None


def _take(prompts: Sequence[str], n: int | None) -> list[str]:
    return list(prompts if n is None else prompts[:n])


def long_prompts(num_prompts: int, chars: int) -> list[str]:
    """``num_prompts`` held-out texts of at least ``chars`` characters each (for long contexts): the held-out
    documents joined, each prompt starting at another document; fewer (with a warning) when the held-out text is
    shorter than ``chars``."""
    docs = [text for _, text in held_out_documents()]
    total = sum(len(d) for d in docs)
    if total < chars:
        log.warning("the held-out text has %d characters, fewer than the %d a prompt needs", total, chars)
        return []
    out = []
    for i in range(num_prompts):
        start = (i * len(docs)) // max(1, num_prompts)
        text, j = "", start
        while len(text) < chars:
            text += docs[j % len(docs)] + "\n\n"
            j += 1
        out.append(text)
    return out


@dataclass(frozen=True)
class PlannedSequence:
    """One evaluated sequence: the prompt's tokens, how many the target generates after them, and the context
    bucket it fills (None without ``--context-buckets``)."""

    prompt: tuple[int, ...]
    new_tokens: int
    bucket: int | None = None


def context_edges(max_len: int, edges: Sequence[int] = ()) -> tuple[int, ...]:
    """The upper ends of the context buckets (bucket i covers contexts [edges[i-1], edges[i]), from 0): ``edges``
    when given, else four equal spans up to ``max_len``."""
    if edges:
        return tuple(edges)
    return tuple(max(1, (max_len * i) // 4) for i in range(1, 5))


def plan_sequences(
    ids: Sequence[Sequence[int]], max_len: int, buckets: Sequence[int] = ()
) -> list[PlannedSequence]:
    """What each tokenized prompt becomes; the built-in and the engine paths use the same plan.

    Without ``buckets``: the first ``prompt_length`` tokens, and ``max_len`` minus that many generated. With
    ``buckets`` (ascending upper ends of context ranges): prompt i fills bucket [lo, hi) = the next one it is long
    enough for, round robin: its first ``lo`` tokens (a bucket from 0: at most half of ``hi``), then
    min(hi - lo, max_len / 2) generated, so every step it drafts has a context in the bucket; the sequences of one
    bucket come next to each other (the engine path sends a bucket's requests together). Prompts too short for
    every bucket are left out.
    """
    if not buckets:
        out = []
        for row in ids:
            p = prompt_length(len(row), max_len)
            out.append(PlannedSequence(tuple(row[:p]), max_len - p))
        return out
    ranges = list(zip((0, *buckets[:-1]), buckets))
    plan = []
    for i, row in enumerate(ids):
        for shift in range(len(ranges)):
            b = (i + shift) % len(ranges)
            lo, hi = ranges[b]
            p = lo if lo > 0 else prompt_length(len(row), hi)
            if len(row) >= max(p, 1) and hi - p >= 2:
                plan.append(PlannedSequence(tuple(row[:p]), min(hi - p, max(2, max_len // 2)), b))
                break
    return sorted(plan, key=lambda s: s.bucket or 0)


def prompt_length(tokens: int, max_len: int) -> int:
    """How much of a tokenized prompt a sequence of ``max_len`` tokens uses: at most half, at least one token;
    the target generates the rest (the built-in and the engine paths use the same split)."""
    return max(1, min(tokens, max_len // 2))


def tokenize_prompts(source: CheckpointSource, prompts: Sequence[str], vocab: int | None = None) -> list[list[int]]:
    """Token ids of each prompt with the checkpoint's own ``tokenizer.json`` (no special tokens, no template);
    prompts shorter than two tokens are left out."""
    from tokenizers import Tokenizer

    if "tokenizer.json" not in source.list_files():
        raise ConfigError(f"{source.label}: tokenizer.json is missing (validate needs the model's tokenizer)")
    tok = Tokenizer.from_str(read_text(source, "tokenizer.json", what="tokenizer file"))
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    if vocab is not None:
        for row in ids:
            if row and max(row) >= vocab:
                raise ConfigError(f"{source.label}: tokenizer produces id {max(row)} >= vocab size {vocab}")
    return [row for row in ids if len(row) >= 2]
