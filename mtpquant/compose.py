"""What runs one command after another: ``convert --heal`` (convert SRC into OUT, then heal OUT's MTP in place
against SRC). Above the commands, below the API: neither command imports the other.

What heal would refuse on OUT is refused in convert's plan (``ConvertOptions.plan_check``), before any work, with the
exit code heal would give; a heal that fails once OUT exists says that OUT was written as converted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.convert.plan import ConvertOptions
from mtpquant.convert.result import ConvertResult
from mtpquant.errors import MtpquantError
from mtpquant.heal.options import HealOptions
from mtpquant.heal.run import HealResult

__all__ = ["convert_and_heal"]


def convert_and_heal(options: ConvertOptions, heal: HealOptions) -> tuple[ConvertResult, HealResult | None]:
    """``convert --heal``: ``convert(options)``, then ``heal`` of OUT in place against SRC (``heal.quant`` is replaced
    by OUT). A dry run plans the conversion (the heal's refusals included) and heals nothing (None)."""
    from mtpquant.convert.run import convert
    from mtpquant.heal.run import heal as run_heal
    from mtpquant.heal.support import check_convert

    def plan_check(src: Checkpoint, mode: str) -> None:
        check_convert(heal, src, mode, options.output_format, Path(options.out), probe=not options.dry_run)

    converted = convert(dataclasses.replace(options, plan_check=plan_check))
    if converted.dry_run:
        return converted, None
    assert converted.output is not None
    try:
        return converted, run_heal(dataclasses.replace(heal, quant=converted.output))
    except MtpquantError as exc:
        raise type(exc)(f"{converted.output} was written as converted, not healed: {exc}") from None
