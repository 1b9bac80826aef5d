"""The one place a validation report is put together: what a path measured (``Measured``), the settings and
thresholds the options give, the verdict and the stamp (version, time). The built-in path (``builtin.py``) and the
engine path (``engine.py``) each return a ``Measured``; ``run.validate`` assembles it here and writes the report
directory (``report.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from mtpquant import __version__
from mtpquant.records.acceptance import Acceptance
from mtpquant.records.validation import (
    Comparison,
    EngineInfo,
    Predicted,
    Report,
    Settings,
    Side,
    ValidationReport,
    Verdict,
)
from mtpquant.validate.options import ValidateOptions
from mtpquant.validate.verdict import verdict

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Measured", "assemble", "report_settings"]


@dataclass(frozen=True)
class Measured:
    """What one path measured: the report's sides and comparison, and how they were measured (``settings``, made by
    ``report_settings``). ``extra``: further measurements of the pair that the verdict decides too (label, reference,
    candidate, cross; the sampling settings after the headline one)."""

    settings: Settings
    reference: Side
    candidate: Side | None = None
    comparison: Comparison | None = None
    notes: tuple[str, ...] = ()
    timing: Mapping[str, float] = field(default_factory=dict)
    engine: tuple[EngineInfo, ...] = ()
    predicted: Predicted | None = None
    extra: Sequence[tuple[str, Acceptance, Acceptance, Acceptance | None]] = ()
    mtp_kl: Tensor | None = None
    main_kl: Tensor | None = None
    caveats: tuple[str, ...] = ()  # what the numbers do not model (activations not quantized): ends the verdict line


def report_settings(
    opts: ValidateOptions,
    *,
    k: int,
    num_prompts: int,
    max_len: int,
    prompts: str,
    device: str,
    dtype: str,
    activations: str,
    hidden_file: str | None = None,
) -> Settings:
    """The report's settings: how a path measured, with the options' thresholds, sampling settings and rule."""
    return Settings(
        *(k, num_prompts, max_len, prompts, device, dtype, activations, hidden_file),
        *(opts.warn_al_drop, opts.broken_al, opts.min_main_agreement, opts.confidence),
        *(opts.sampling_settings, opts.rule),
    )


def _with_caveats(v: Verdict, caveats: Sequence[str]) -> Verdict:
    """The verdict with ``caveats`` after its reasons: the verdict line itself says what the numbers do not model."""
    return dataclasses.replace(v, reasons=(*v.reasons, *caveats)) if caveats else v


def assemble(opts: ValidateOptions, m: Measured) -> ValidationReport:
    """The report of ``m``: the verdict (on ``opts``' thresholds), version and time."""
    report = Report(
        mtpquant_version=__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        mode="pair" if m.candidate is not None else "single",
        settings=m.settings,
        reference=m.reference,
        verdict=_with_caveats(verdict(opts, m.reference, m.candidate, m.comparison, extra=m.extra), m.caveats),
        candidate=m.candidate,
        comparison=m.comparison,
        timing={k: round(v, 3) for k, v in m.timing.items()},
        notes=m.notes,
        engine=m.engine,
        predicted=m.predicted,
    )
    return ValidationReport(report, m.mtp_kl, m.main_kl)
