"""What ``validate`` checks before it runs anything: the options, the prompts file, the report directory (writable,
and holding nothing but an earlier report, which the new one replaces: ``report.check_replaceable_report``), and that
REFERENCE and CANDIDATE open and are the same model. Each failure is one line, and nothing has been loaded, run or
written yet: this module is torch-free, so a bad value or an unreachable checkpoint is refused before the model code
loads.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from mtpquant.checkpoint.source import CheckpointSource, open_source, read_text
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import LineageError, ValidateError
from mtpquant.families import dimension_differences
from mtpquant.text.prompts import prompts_for
from mtpquant.validate.options import ValidateOptions

__all__ = ["Opened", "check_context_buckets", "check_report_dir", "check_same_model", "preflight"]


def check_report_dir(path: Path) -> None:
    """Refuse a report directory that cannot be written, without creating it (a failed run leaves none behind)."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory, so the report cannot be written there", str(probe))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "not writable, so the report cannot be written there", str(probe))


def _vocabulary(source: CheckpointSource) -> dict[str, int] | None:
    from tokenizers import Tokenizer

    if "tokenizer.json" not in source.list_files():
        return None
    text = read_text(source, "tokenizer.json", what="tokenizer file")
    return dict(Tokenizer.from_str(text).get_vocab(with_added_tokens=True))


def check_same_model(reference: Checkpoint, candidate: Checkpoint) -> None:
    """Refuse, in one line naming every difference, a pair that is not one model: family and architecture, the
    dimensions graft's lineage check compares, and the tokenizer's vocabulary (where both ship ``tokenizer.json``).
    Reads configs and the tokenizers only."""
    rs, cs = reference.spec, candidate.spec
    where = f"REFERENCE {reference.label} and CANDIDATE {candidate.label} are not the same model"
    if rs.family.key != cs.family.key:
        raise LineageError(
            f"{where}: REFERENCE is {rs.family.display} ({rs.architecture}), CANDIDATE is {cs.family.display} "
            f"({cs.architecture})"
        )
    diffs = dimension_differences(rs.text, cs.text, rs.family)
    if not diffs:
        ref_vocab, cand_vocab = _vocabulary(reference.source), _vocabulary(candidate.source)
        if ref_vocab is not None and cand_vocab is not None and ref_vocab != cand_vocab:
            differ = sorted(set(ref_vocab.items()) ^ set(cand_vocab.items()))
            diffs.append(
                f"tokenizer vocabularies differ ({len(ref_vocab)} vs {len(cand_vocab)} entries; first difference "
                f"{differ[0][0]!r})"
            )
    if diffs:
        raise LineageError(f"{where}: " + "; ".join(diffs))


def check_context_buckets(checkpoint: Checkpoint, buckets: tuple[int, ...]) -> None:
    """Refuse context buckets the model does not support (beyond its ``max_position_embeddings``)."""
    limit = checkpoint.spec.text.get("max_position_embeddings")
    if buckets and isinstance(limit, int) and buckets[-1] > limit:
        raise ValidateError(
            f"--context-buckets {' '.join(map(str, buckets))}: {checkpoint.label} supports contexts up to {limit} "
            "tokens (max_position_embeddings)"
        )


@dataclass(frozen=True)
class Opened:
    """What ``preflight`` read, for the path that measures: the checkpoints (header tables only) and the prompts with
    how the report describes them (None with ``--hidden``: the prompts are the file's)."""

    reference: Checkpoint | None = None
    candidate: Checkpoint | None = None
    prompts: tuple[list[str], str] | None = None
    # whose tokenizer turns the prompts into tokens: REFERENCE's (with --server, REFERENCE names what it serves)
    tokenizer: CheckpointSource | None = None


def preflight(opts: ValidateOptions) -> Opened:
    """The checks every path runs first: options, the prompts file, the report directory; then, where validate
    reads the checkpoints (the built-in path, ``--engine``), REFERENCE and CANDIDATE opened, the same model, and the
    context buckets within the model's. A running server's checkpoint (``--server``) is the server's to read."""
    opts.check()
    prompts = prompts_for(opts.prompts_file, opts.num_prompts, opts.prompt_chars) if opts.hidden is None else None
    if opts.report_dir is not None:
        from mtpquant.validate.report import check_replaceable_report

        check_report_dir(Path(opts.report_dir))
        check_replaceable_report(Path(opts.report_dir))
    if opts.save_hidden is not None:
        check_report_dir(Path(opts.save_hidden).parent)
    if opts.hidden is not None and not Path(opts.hidden).is_file():
        raise ValidateError(f"--hidden {opts.hidden}: no such file")
    if opts.reference is None or opts.server is not None:
        tokenizer = open_source(opts.reference) if opts.reference is not None else None
        return Opened(prompts=prompts, tokenizer=tokenizer)
    reference = Checkpoint.open(opts.reference, name_errors=True)
    candidate = Checkpoint.open(opts.candidate, name_errors=True) if opts.candidate is not None else None
    if candidate is not None:
        check_same_model(reference, candidate)
    check_context_buckets(reference, opts.context_buckets)
    return Opened(reference, candidate, prompts, reference.source)
