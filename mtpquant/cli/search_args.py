"""The precision search's flags, shared by ``convert --mtp auto`` and ``tune-mtp`` (defaults and choices from
``search.settings.SearchSettings``, the one place they are written)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from mtpquant.errors import UsageError
from mtpquant.records.record import field_choices, field_default
from mtpquant.search.settings import SearchSettings
from mtpquant.search.space import PRECISIONS

__all__ = ["SEARCH_FLAGS", "add_search_arguments", "search_engine_choices", "search_settings"]

# flag -> SearchSettings field
SEARCH_FLAGS = {
    "al_budget": "budget",
    "engine": "engine",
    "mtp_precisions": "precisions",
    "search_prompts": "num_prompts",
    "confirm_prompts": "confirm_prompts",
    "search_temperature": "temperatures",
    "search_seed": "seed",
}


def search_engine_choices() -> tuple[str, ...]:
    """``--engine``'s values: the engines whose loader rules the search applies (``engine.table.searched``), and
    ``any``: the settings' type admits every engine of the table, the search only those."""
    from mtpquant.engine.table import searched

    return tuple(c for c in field_choices(SearchSettings, "engine") if c in (*searched(), "any"))


def add_search_arguments(p: argparse.ArgumentParser, when: str = "") -> None:
    """``--al-budget``, ``--engine``, ``--mtp-precisions``, ``--search-prompts``, ``--confirm-prompts``,
    ``--search-temperature``, ``--search-seed`` (``when``: the help's condition, e.g. ``with --mtp auto: ``)."""
    p.add_argument(
        "--al-budget", type=float, metavar="AL",
        help=f"{when}the AL the MTP may lose against the BF16 MTP's, at every k = 1..3 and sampling setting: a bound "
        "the held-out confirmation tests (family-wise error 5 %% over the finalists, Holm) (default "
        f"{field_default(SearchSettings, 'budget')}; 0 writes the BF16 MTP byte for byte, measuring no quantized one)",
    )  # fmt: skip
    p.add_argument(
        "--engine", choices=search_engine_choices(),
        help=f"{when}the engines that must load the result (any: every one; default "
        f"{field_default(SearchSettings, 'engine')})",
    )  # fmt: skip
    p.add_argument(
        "--mtp-precisions", metavar="P[,P]",
        help=f"{when}the precisions a group may take, comma-separated (default {','.join(PRECISIONS)}; bf16 always)",
    )  # fmt: skip
    p.add_argument(
        "--search-prompts", type=int, metavar="N",
        help=f"{when}held-out prompts the selection measures on (default "
        f"{field_default(SearchSettings, 'num_prompts')}; more decides smaller differences)",
    )  # fmt: skip
    p.add_argument(
        "--confirm-prompts", type=int, metavar="N",
        help=f"{when}other held-out prompts, never selected on, that confirm the finalists (default "
        f"{field_default(SearchSettings, 'confirm_prompts')})",
    )  # fmt: skip
    p.add_argument(
        "--search-temperature", type=float, action="append", metavar="T",
        help=f"{when}also measure at this sampling temperature (repeatable; greedy always)",
    )  # fmt: skip
    p.add_argument("--search-seed", type=int, metavar="N", help=f"{when}the sampling and bootstrap seed (default 0)")


def search_settings(args: argparse.Namespace) -> tuple[SearchSettings, list[str]]:
    """The settings the flags give, and the flags given (a command refuses them where no search runs)."""
    given: dict[str, Any] = {}
    flags = []
    for flag, name in SEARCH_FLAGS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        flags.append("--" + flag.replace("_", "-"))
        if name == "precisions":
            value = tuple(p.strip() for p in value.split(",") if p.strip())
            unknown = [p for p in value if p not in PRECISIONS]
            if unknown or not value:
                raise UsageError(f"--mtp-precisions: {unknown[0] if unknown else value!r} is not one of "
                                 f"{', '.join(PRECISIONS)}")  # fmt: skip
        elif name == "temperatures":
            value = tuple(value)
        given[name] = value
    settings = dataclasses.replace(SearchSettings(), **given)
    try:  # the values checked by the settings' own declared constraints, refused in the words of the flag
        SearchSettings.from_json(settings.to_json(), "search")
    except ValueError as exc:
        text = str(exc)
        for flag, name in SEARCH_FLAGS.items():
            text = text.replace(f"search.{name}", "--" + flag.replace("_", "-"))
        raise UsageError(text) from None
    return settings, flags
