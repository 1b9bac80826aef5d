"""``mtpquant validate``: one entry, two paths.

The built-in path (``builtin.py``) replays the engines' MTP loop with the checkpoints' own weights on
transformers; the engine path (``engine.py``) reads a real vLLM server's speculative-decoding
counters, on servers given with ``--server`` or started with ``--engine vllm``. Each returns what it measured;
the report is assembled (``assemble.py``: the same typed report, ``schema.py``, and the same verdict,
``verdict.py``) and written (``report.py``) here, once for both.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mtpquant.records.validation import ValidationReport
from mtpquant.validate.assemble import assemble
from mtpquant.validate.options import ValidateOptions
from mtpquant.validate.preflight import preflight

__all__ = ["ValidateOptions", "ValidationReport", "validate"]

log = logging.getLogger(__name__)


def validate(opts: ValidateOptions) -> ValidationReport:
    """Run the evaluation described by ``opts``; writes the report directory when one is given (replacing an earlier
    report there whole; the servers ``--engine`` started leave their logs in its ``logs/``)."""
    opened = preflight(opts)  # torch-free: a bad value or checkpoint is refused before the model code loads
    if opts.engine_path:
        from mtpquant.validate.engine import server_logs, validate_engine

        with server_logs(opts) as logs:
            result = assemble(opts, validate_engine(opts, opened, logs))
            _write(opts, result, logs)
    else:
        from mtpquant.runtime.libraries import library_output
        from mtpquant.validate.builtin import validate_builtin

        with library_output(opts.progress):  # transformers' messages through logging (-q / -v)
            measured = validate_builtin(opts, opened)
        result = assemble(opts, measured)
        _write(opts, result, None)
    verdict = result.report.verdict
    log.info("validate%s: %s (%s)", " (engine)" if opts.engine_path else "", verdict.status, "; ".join(verdict.reasons))
    return result


def _write(opts: ValidateOptions, result: ValidationReport, logs: Path | None) -> None:
    if opts.report_dir is not None:
        from mtpquant.validate.report import write_report

        write_report(result, opts.report_dir, logs=logs)
