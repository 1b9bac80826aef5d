"""Hidden-state files: the target runs captured once (e.g. on a GPU), replayed anywhere (``--hidden``).

A safetensors file (``format: mtpquant.hidden/1`` in its metadata): ``ref.tokens.NNNNN`` (int64 ``[T]``),
``ref.hidden.NNNNN`` (``[T, H]``, post-final-norm), ``ref.mtp_input.NNNNN`` where the MTP reads another tensor
(Qwen4-Exp: ``[T, hc_count * H]``), and in pair mode ``cand.*`` plus ``cand.hidden_on_ref.*``; runs sampled at
further settings are groups ``ref@1``, ``cand@1``, ...; metadata ``groups`` (per group: side, source, prompt lengths,
sampling settings) and ``meta`` (prompts, max_len, dtype, device).
Written through the writer's atomic path (temp file, fsync, rename, directory fsync).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.writer import atomic_write_safetensors
from mtpquant.errors import HiddenFileError
from mtpquant.measure import HIDDEN_FORMAT
from mtpquant.measure.replay import SequenceRecord, TargetRun
from mtpquant.records.sampling import SamplingSettings

__all__ = ["load_hidden", "save_hidden"]

log = logging.getLogger(__name__)



def save_hidden(path: Path, runs: Sequence[tuple[str, TargetRun]], meta: dict[str, Any]) -> None:
    """Write target runs (side ``ref`` or ``cand``, run; one of each per sampling setting) to a safetensors file,
    atomically."""
    from mtpquant.checkpoint.dtypes import planned

    tensors = []
    info: dict[str, Any] = {}
    settings: list[SamplingSettings] = []
    for side, run in runs:
        if run.sampling not in settings:
            settings.append(run.sampling)
        index = settings.index(run.sampling)
        group = side + (f"@{index}" if index else "")
        info[group] = {
            "side": side,
            "source": run.source,
            "prompt_lens": [s.prompt_len for s in run.sequences],
            "ends": [s.end for s in run.sequences],  # where each request ends (None: no lookahead after it)
            "sampling": run.sampling.to_json(),
        }
        for i, s in enumerate(run.sequences):
            tensors.append(planned(f"{group}.tokens.{i:05d}", s.tokens.contiguous()))
            tensors.append(planned(f"{group}.hidden.{i:05d}", s.hidden.contiguous()))
            if s.mtp_input is not None:
                tensors.append(planned(f"{group}.mtp_input.{i:05d}", s.mtp_input.contiguous()))
        for i, h in enumerate(run.hidden_on_ref or []):
            tensors.append(planned(f"{group}.hidden_on_ref.{i:05d}", h.contiguous()))
    metadata = {"format": HIDDEN_FORMAT, "groups": json.dumps(info), "meta": json.dumps(meta)}
    atomic_write_safetensors(Path(path), tensors, metadata)
    log.info("saved hidden states of %s to %s", ", ".join(info), path)


def load_hidden(path: Path) -> tuple[dict[str, TargetRun], dict[str, Any]]:
    """Read a file written by :func:`save_hidden`: runs by group and the capture metadata; anything else (not
    safetensors, another format, missing entries, metadata that is not JSON) is one line, exit 2."""
    try:
        return _load_hidden(path)
    except HiddenFileError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HiddenFileError(f"{path}: not a readable mtpquant hidden-state file ({type(exc).__name__})") from None
    except Exception as exc:  # safetensors' own error type for a file that is not safetensors
        if type(exc).__name__ != "SafetensorError":
            raise
        raise HiddenFileError(f"{path}: not a safetensors file ({str(exc).splitlines()[0][:120]})") from None


def _load_hidden(path: Path) -> tuple[dict[str, TargetRun], dict[str, Any]]:
    from safetensors import safe_open

    from mtpquant.net import safejson

    with safe_open(str(path), framework="pt") as fh:
        md = fh.metadata() or {}
        if md.get("format") != HIDDEN_FORMAT:
            raise HiddenFileError(f"{path}: not an mtpquant hidden-state file (format {md.get('format')!r})")
        info = safejson.loads(md["groups"])
        runs: dict[str, TargetRun] = {}
        keys = set(fh.keys())
        for group, g in info.items():
            seqs = [
                SequenceRecord(
                    fh.get_tensor(f"{group}.tokens.{i:05d}"),
                    int(p),
                    fh.get_tensor(f"{group}.hidden.{i:05d}"),
                    fh.get_tensor(f"{group}.mtp_input.{i:05d}") if f"{group}.mtp_input.{i:05d}" in keys else None,
                    None if e is None else int(e),
                )
                for i, (p, e) in enumerate(zip(g["prompt_lens"], g.get("ends") or [None] * len(g["prompt_lens"])))
            ]
            on_ref = None
            if f"{group}.hidden_on_ref.00000" in keys:
                on_ref = [fh.get_tensor(f"{group}.hidden_on_ref.{i:05d}") for i in range(len(seqs))]
            sampling = SamplingSettings.from_json(g.get("sampling") or {}, f"{path}: sampling")
            runs[group] = TargetRun(str(g["source"]), seqs, on_ref, sampling)
    return runs, safejson.loads(md.get("meta", "{}"))
