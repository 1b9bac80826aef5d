"""Every family the registry marks convertible has what convert needs: a default recipe that accepts it, a tiny variant
to test it on, and a reference MTP forward (quantize mode, validate); a forgotten step fails here, by family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.families import FAMILIES, check_mtp_forward, resolve
from mtpquant.families.catalogue import family_row
from mtpquant.recipes.recipe import DEFAULT_RECIPES, load_recipe
from mtpquant.synth.tiny import TINY_VARIANTS, tiny_config

pytestmark = pytest.mark.dev

CONVERTIBLE = sorted(f.key for f in FAMILIES if f.convert)
BY_KEY = {f.key: f for f in FAMILIES}


def _tiny_variant(key: str) -> str | None:
    """The plain tiny variant of a family (its own name), else any variant of that family."""
    if key in TINY_VARIANTS and TINY_VARIANTS[key].family == key:
        return key
    return next((v for v, spec in sorted(TINY_VARIANTS.items()) if spec.family == key), None)


def test_the_convertible_families_are_the_expected_ones() -> None:
    assert len(CONVERTIBLE) >= 8 and {"qwen3_5", "deepseek_v3", "glm4_moe"} <= set(CONVERTIBLE)
    assert set(DEFAULT_RECIPES) == set(CONVERTIBLE)  # a recipe for a family convert refuses is a dead table entry


@pytest.mark.parametrize("key", CONVERTIBLE)
def test_a_convertible_family_has_a_recipe_a_tiny_variant_and_an_mtp_forward(key: str) -> None:
    family = BY_KEY[key]
    recipe = load_recipe(DEFAULT_RECIPES[key])  # the built-in file exists and validates
    recipe.check_family(family)
    variant = _tiny_variant(key)
    assert variant is not None, f"no tiny variant of {key} in synth.tiny.TINY_VARIANTS"
    config = tiny_config(TINY_VARIANTS[variant])
    assert resolve(config).family.key == key
    assert family.mtp_forward and check_mtp_forward(config).family.key == key  # every refusal it would make: none
    works = family_row(family).works
    assert works["convert"] and works["validate"]


@pytest.mark.slow
@pytest.mark.parametrize("key", CONVERTIBLE)
def test_the_mtp_forward_builds_on_the_tiny_checkpoint(key: str, tiny_factory: Callable[[str], Path]) -> None:
    """The reference forward takes the tiny checkpoint's MTP tensors, names and shapes checked (mtp.build)."""
    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.mtp.build import reference_mtp

    variant = _tiny_variant(key)
    assert variant is not None
    ckpt = Checkpoint.open(tiny_factory(variant))
    tensors = {e.name: ckpt.read_tensor(e.name) for e in ckpt.mtp_tensors()}
    assert reference_mtp(ckpt.config, tensors) is not None
