"""The public Python API: everything the CLI does, as functions with typed options and results.

The CLI (``mtpquant.cli``) is a thin layer over this module and ``mtpquant.render`` (the text forms of the
results). Imports are lazy so that ``inspect`` and ``graft`` start without torch, transformers or modelopt.

A program that embeds mtpquant shares one thing with it: huggingface_hub's process-wide HTTP client. The first
call that reaches the Hub (a repo id given as a checkpoint, ``publish``) sets huggingface_hub's client factory
(``huggingface_hub.set_client_factory``, ``mtpquant.net.hub.configure_client``) to mtpquant's transport, so every
huggingface_hub call in the process then has its deadline (``MTPQUANT_HUB_TIMEOUT``), its byte caps on the Hub's
JSON answers and its request counting. A program that needs its own factory sets it again after mtpquant's calls
(mtpquant sets it once per process, and again only when ``MTPQUANT_HUB_TIMEOUT`` changes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a type checker (a user's, through py.typed) sees the real types; at run time they load lazily
    from mtpquant.convert.options import ConvertOptions
    from mtpquant.convert.plan import ConvertPlan, plan_convert
    from mtpquant.convert.result import ConvertResult
    from mtpquant.convert.run import convert
    from mtpquant.diagnose.report import InspectReport, inspect_checkpoint
    from mtpquant.graft.extract import ExtractOptions, ExtractResult, extract_mtp
    from mtpquant.graft.options import GraftOptions
    from mtpquant.graft.run import GraftResult, fix_metadata, graft
    from mtpquant.heal.options import HealOptions, HealSizes
    from mtpquant.heal.plan import HealPlan
    from mtpquant.heal.run import HealResult, heal
    from mtpquant.measure import ACTIVATION_MODES
    from mtpquant.publish.options import PublishOptions
    from mtpquant.publish.run import PublishResult, publish
    from mtpquant.recipes.recipe import builtin_recipe_names
    from mtpquant.records.validation import Report, ValidationReport
    from mtpquant.search.run import SearchResult
    from mtpquant.search.settings import SearchSettings
    from mtpquant.synth.tiny import TINY_VARIANTS, make_tiny_checkpoint
    from mtpquant.synth.train import TINY_MTP_ASSET, TINY_MTP_ASSETS
    from mtpquant.tune.options import TuneOptions
    from mtpquant.tune.run import TunePlan, TuneResult, tune_mtp
    from mtpquant.validate.options import ValidateOptions
    from mtpquant.validate.run import validate

__all__ = [
    "ACTIVATION_MODES",
    "TINY_MTP_ASSET",
    "TINY_MTP_ASSETS",
    "TINY_VARIANTS",
    "ConvertOptions",
    "ConvertPlan",
    "ConvertResult",
    "ExtractOptions",
    "ExtractResult",
    "GraftOptions",
    "GraftResult",
    "HealOptions",
    "HealPlan",
    "HealResult",
    "HealSizes",
    "InspectReport",
    "PublishOptions",
    "PublishResult",
    "Report",
    "SearchResult",
    "SearchSettings",
    "TuneOptions",
    "TunePlan",
    "TuneResult",
    "ValidateOptions",
    "ValidationReport",
    "builtin_recipe_names",
    "convert",
    "convert_and_heal",
    "extract_mtp",
    "fix_metadata",
    "graft",
    "heal",
    "inspect_checkpoint",
    "make_tiny_checkpoint",
    "plan_convert",
    "publish",
    "tune_and_heal",
    "tune_mtp",
    "validate",
]

_WHERE = {
    "ACTIVATION_MODES": "mtpquant.measure",
    "TINY_MTP_ASSET": "mtpquant.synth.train",
    "TINY_MTP_ASSETS": "mtpquant.synth.train",
    "TINY_VARIANTS": "mtpquant.synth.tiny",
    "ConvertOptions": "mtpquant.convert.options",
    "ConvertPlan": "mtpquant.convert.plan",
    "plan_convert": "mtpquant.convert.plan",
    "builtin_recipe_names": "mtpquant.recipes.recipe",
    "ConvertResult": "mtpquant.convert.result",
    "convert": "mtpquant.convert.run",
    "ExtractOptions": "mtpquant.graft.extract",
    "ExtractResult": "mtpquant.graft.extract",
    "extract_mtp": "mtpquant.graft.extract",
    "GraftOptions": "mtpquant.graft.options",
    "GraftResult": "mtpquant.graft.run",
    "graft": "mtpquant.graft.run",
    "fix_metadata": "mtpquant.graft.run",
    "HealOptions": "mtpquant.heal.options",
    "HealSizes": "mtpquant.heal.options",
    "HealPlan": "mtpquant.heal.plan",
    "HealResult": "mtpquant.heal.run",
    "heal": "mtpquant.heal.run",
    "InspectReport": "mtpquant.diagnose.report",
    "inspect_checkpoint": "mtpquant.diagnose.report",
    "make_tiny_checkpoint": "mtpquant.synth.tiny",
    "PublishOptions": "mtpquant.publish.options",
    "PublishResult": "mtpquant.publish.run",
    "publish": "mtpquant.publish.run",
    "Report": "mtpquant.records.validation",
    "ValidationReport": "mtpquant.records.validation",
    "SearchResult": "mtpquant.search.run",
    "SearchSettings": "mtpquant.search.settings",
    "TuneOptions": "mtpquant.tune.options",
    "TunePlan": "mtpquant.tune.run",
    "TuneResult": "mtpquant.tune.run",
    "tune_mtp": "mtpquant.tune.run",
    "ValidateOptions": "mtpquant.validate.options",
    "validate": "mtpquant.validate.run",
}


def convert_and_heal(
    options: ConvertOptions, heal: HealOptions, on_converted: Callable[[ConvertResult], None] | None = None
) -> tuple[ConvertResult, HealResult | None]:
    """``convert --heal``: ``convert(options)``, then ``heal`` of OUT in place against SRC (``heal.quant`` is replaced
    by OUT); ``on_converted`` sees the conversion's result before the heal starts (the CLI prints it there). A dry run
    plans the conversion (the heal's refusals included) and heals nothing (None). With ``--mtp auto`` the search
    heals each finalist before its choice with ``heal``'s data and schedule (``search.finalists``) and writes the
    chosen MTP healed: there is no heal afterwards (None; the search's report has each finalist before and after)."""
    import dataclasses
    from pathlib import Path

    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.convert.run import convert
    from mtpquant.errors import MtpquantError
    from mtpquant.heal.support import check_convert  # torch-free: refusals come before the heavy imports

    search = options.mtp == "auto"

    def plan_check(src: Checkpoint, mode: str) -> None:
        # --mtp auto: no in-place heal of OUT afterwards, so no directory exchange to probe
        check_convert(heal, src, mode, options.output_format, Path(options.out), probe=not (options.dry_run or search))

    if search:  # each finalist of the search healed before the choice; the chosen MTP is written healed
        from mtpquant.heal.finalists import FinalistHealer

        with FinalistHealer(heal) as healer:
            converted = convert(dataclasses.replace(options, plan_check=plan_check, healer=healer))
        if on_converted is not None:
            on_converted(converted)
        return converted, None
    converted = convert(dataclasses.replace(options, plan_check=plan_check))
    if on_converted is not None:
        on_converted(converted)
    if converted.dry_run:
        return converted, None
    assert converted.output is not None
    from mtpquant.heal.run import heal as run_heal

    try:
        return converted, run_heal(dataclasses.replace(heal, quant=converted.output))
    except MtpquantError as exc:
        raise type(exc)(f"{converted.output} was written as converted, not healed: {exc}") from None


def tune_and_heal(options: TuneOptions, heal: HealOptions) -> TuneResult:
    """``tune-mtp --heal``: ``tune_mtp(options)`` with each finalist of the search healed before the choice with
    ``heal``'s data and schedule (``search.finalists``; ``heal``'s QUANT, SRC and destination are not used), the chosen
    MTP written healed."""
    import dataclasses

    from mtpquant.heal.finalists import FinalistHealer
    from mtpquant.text.calibration import check_calibration_source
    from mtpquant.tune.run import tune_mtp

    heal.check()
    check_calibration_source(heal.data)
    with FinalistHealer(heal) as healer:
        return tune_mtp(dataclasses.replace(options, healer=healer))


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (``_WHERE`` says from where)."""
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mtpquant.api' has no attribute {name!r}")
