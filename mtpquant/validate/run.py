"""``mtpquant validate``: one entry, two paths.

The built-in path (``builtin.py``) replays the engines' MTP loop with the checkpoints' own weights on
transformers; the engine path (``engine.py``) reads a real vLLM server's speculative-decoding
counters, on servers given with ``--server`` or started with ``--engine vllm``. Both give the same
typed report (``schema.py``) and the same verdict (``verdict.py``).
"""

from __future__ import annotations

from mtpquant.validate.options import ValidateError, ValidateOptions
from mtpquant.validate.schema import ValidationReport

__all__ = ["ValidateError", "ValidateOptions", "ValidationReport", "validate"]


def validate(opts: ValidateOptions) -> ValidationReport:
    """Run the evaluation described by ``opts``; writes the report directory when one is given."""
    if opts.engine_path:
        from mtpquant.validate.engine import validate_engine

        return validate_engine(opts)
    from mtpquant.libraries import library_output
    from mtpquant.validate.builtin import validate_builtin

    with library_output(opts.progress):  # transformers' messages through logging (-q / -v)
        return validate_builtin(opts)
