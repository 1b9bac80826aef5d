"""The conversion pipeline: ``convert`` (NVFP4 through modelopt, MTP kept/quantized/extracted/dropped).

Importing this package is light; ``convert`` imports torch, transformers and modelopt when it runs.
"""

from mtpquant.pipeline.convert import ConvertResult, convert
from mtpquant.pipeline.plan import CONVERT_MODES, ConvertOptions, ConvertPlan, plan_convert
from mtpquant.pipeline.recipes import Recipe, builtin_recipe_names, load_recipe

__all__ = [
    "CONVERT_MODES",
    "ConvertOptions",
    "ConvertPlan",
    "ConvertResult",
    "Recipe",
    "builtin_recipe_names",
    "convert",
    "load_recipe",
    "plan_convert",
]
