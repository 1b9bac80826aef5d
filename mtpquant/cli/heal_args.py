"""heal's schedule flags, shared by ``heal``, ``convert --heal`` (``--heal-steps``, ...) and ``tune-mtp`` (defaults from
``heal.options.HealOptions``, the one place they are written): no command module imports another's."""

from __future__ import annotations

import argparse
from typing import Any

from mtpquant.heal.options import HealOptions  # torch-free: the defaults at start-up
from mtpquant.records.record import field_default

__all__ = ["SCHEDULE_FIELDS", "add_schedule_arguments", "check_schedule_values", "schedule_options"]


def add_schedule_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The data and schedule flags (``heal``'s, and ``convert --heal``'s with ``prefix="heal-"``); their defaults
    are ``HealOptions``'."""

    def default(name: str) -> str:
        return f"default {field_default(HealOptions, name):g}"

    p.add_argument(f"--{prefix}data", dest="heal_data", metavar="PATH|DATASET",
                   help="calibration text the prompts come from (default: the offline CPython text without "
                   "validate's held-out documents); a .txt/.jsonl file or a `datasets` name")
    p.add_argument(f"--{prefix}steps", dest="heal_steps", type=int, metavar="N",
                   help=f"training steps ({default('steps')})")
    p.add_argument(f"--{prefix}lr", dest="heal_lr", type=float, metavar="LR",
                   help=f"peak learning rate ({default('lr')})")
    p.add_argument(f"--{prefix}seed", dest="heal_seed", type=int, metavar="N", help=f"seed ({default('seed')})")
    p.add_argument(f"--{prefix}chain", dest="heal_chain", type=int, metavar="K",
                   help=f"train the first K chained drafts, as the engines draft ({default('chain')})")
    p.add_argument(f"--{prefix}samples", dest="heal_samples", type=int, metavar="N",
                   help=f"calibration prompts the target continues ({default('samples')})")
    p.add_argument(f"--{prefix}check-prompts", dest="heal_check_prompts", type=int, metavar="N",
                   help=f"held-out prompts of the before/after check ({default('check_prompts')})")


# HealOptions field -> the argparse dest of its schedule flag (``--steps``; ``convert --heal-steps``)
SCHEDULE_FIELDS = {"data": "heal_data", "steps": "heal_steps", "lr": "heal_lr", "seed": "heal_seed",
                   "chain": "heal_chain", "samples": "heal_samples", "check_prompts": "heal_check_prompts"}


def schedule_options(args: argparse.Namespace) -> dict[str, Any]:
    """The HealOptions fields the schedule flags set (only those given)."""
    return {k: getattr(args, v) for k, v in SCHEDULE_FIELDS.items() if getattr(args, v, None) is not None}


def check_schedule_values(options: Any) -> None:
    """heal's values and data source, refused in the flag names convert and tune-mtp take them by (``--heal-steps``,
    ...)."""
    import re

    from mtpquant.errors import CalibrationDataError, MtpquantError
    from mtpquant.text.calibration import check_calibration_source

    try:
        options.check()
        check_calibration_source(options.data)
    except CalibrationDataError as exc:
        raise CalibrationDataError(f"--heal-data: {exc}") from None
    except MtpquantError as exc:
        flags = "|".join(key.replace("_", "-") for key in SCHEDULE_FIELDS)
        raise type(exc)(re.sub(rf"--({flags})\b", r"--heal-\1", str(exc))) from None
