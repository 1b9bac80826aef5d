"""Recipes: shipped YAML validated, resolvable by name or path, overridable; modelopt config mapping."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from mtpquant.errors import RecipeError
from mtpquant.families import FAMILIES
from mtpquant.recipes.recipe import (
    MODELOPT_NVFP4_DISABLED,
    MtpSection,
    apply_overrides,
    builtin_recipe_names,
    byte_size,
    default_recipe_name,
    load_recipe,
    quantizer_enabled,
    recipe_from_mapping,
)
from mtpquant.units import ByteSize

pytestmark = pytest.mark.dev

FAMILY = {f.key: f for f in FAMILIES}


def test_builtin_recipes_load_and_cover_the_issue() -> None:
    names = builtin_recipe_names()
    assert names == [
        "deepseek_v3-nvfp4",
        "deepseek_v32-nvfp4",
        "glm4_moe-nvfp4",
        "glm_moe_dsa-nvfp4",
        "mimo_v2_flash-nvfp4",
        "nemotron_h-nvfp4",
        "nvfp4-w4a16",
        "qwen3_5-nvfp4",
        "qwen3_5_moe-experts-nvfp4",
        "qwen3_5_moe-nvfp4",
        "qwen3_next-nvfp4",
        "qwen4_exp-nvfp4",
        "step3p5-nvfp4",
    ]
    for name in names:
        recipe = load_recipe(name)
        assert recipe.name == name
        assert recipe.source == f"mtpquant/recipes/{name}.yaml"
        # Round trip: the resolved YAML written into OUT is itself a valid recipe.
        import yaml

        again = recipe_from_mapping(yaml.safe_load(recipe.to_yaml("header")), "again")
        assert again == recipe
    assert load_recipe("nvfp4-w4a16").quantization.quant_algo == "W4A16_NVFP4"
    assert load_recipe("qwen3_5_moe-experts-nvfp4").quantization.targets == "experts"


def test_default_recipe_per_family() -> None:
    assert default_recipe_name(FAMILY["qwen3_5"]) == "qwen3_5-nvfp4"
    assert default_recipe_name(FAMILY["qwen3_5_moe"]) == "qwen3_5_moe-nvfp4"
    assert default_recipe_name(FAMILY["qwen3_next"]) == "qwen3_next-nvfp4"
    assert default_recipe_name(FAMILY["qwen4_exp"]) == "qwen4_exp-nvfp4"
    assert default_recipe_name(FAMILY["glm4_moe"]) == "glm4_moe-nvfp4"
    assert default_recipe_name(FAMILY["deepseek_v3"]) == "deepseek_v3-nvfp4"
    assert default_recipe_name(FAMILY["deepseek_v32"]) == "deepseek_v32-nvfp4"
    assert default_recipe_name(FAMILY["glm_moe_dsa"]) == "glm_moe_dsa-nvfp4"
    assert default_recipe_name(FAMILY["step3p5"]) == "step3p5-nvfp4"
    assert default_recipe_name(FAMILY["mimo_v2_flash"]) == "mimo_v2_flash-nvfp4"
    for family in FAMILIES:
        load_recipe(default_recipe_name(family)).check_family(family)
        load_recipe("nvfp4-w4a16").check_family(family)


def test_recipe_by_path_and_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("schema: 1\nname: r\ncalibration:\n  samples: 8\n")
    recipe = load_recipe(str(path))
    assert recipe.calibration.samples == 8 and recipe.calibration.seq_len == 512 and recipe.source == str(path)
    path.write_text("name: r\nquantisation: {}\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: unknown key 'quantisation' \(allowed: "):
        load_recipe(str(path))
    path.write_text("name: r\nmtp:\n  mode: maybe\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path))
    assert (
        str(info.value)
        == f"{path}: mtp.mode: input should be 'auto', 'keep', 'quantize', 'extract', 'drop' or 'search', got 'maybe'"
    )
    path.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match=r"not valid YAML \(line \d+\)"):
        load_recipe(str(path))
    with pytest.raises(RecipeError, match="recipe file does not exist"):
        load_recipe(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"calibration": {"bogus": 1}},
            "unknown key 'calibration.bogus' (allowed: calibration.data, calibration.samples, "
            "calibration.seq_len, calibration.batch_size, calibration.chat_template)",
        ),
        ({"calibration": {"samples": "many"}}, "calibration.samples: input should be a valid integer, got 'many'"),
        ({"calibration": {"samples": True}}, "calibration.samples: input should be a valid integer, got True"),
        ({"calibration": {"seq_len": 0}}, "calibration.seq_len: input should be greater than 0, got 0"),
        (
            {"calibration": {"chat_template": "yes"}},
            "calibration.chat_template: input should be a valid boolean, got 'yes'",
        ),
        ({"quantization": {"exclude": ["a", 1]}}, "quantization.exclude[1]: input should be a valid string, got 1"),
        (
            {"quantization": {"group_size": 32}},
            "quantization.group_size: must be 16 (NVFP4 blocks are 16 elements), got 32",
        ),
        (
            {"families": ["qwen9"]},
            "families: unknown family 'qwen9' (known: bailing_moe_v25, bailing_moe_v3, deepseek_v3, deepseek_v32, "
            "deepseek_v4, deepseek_v41, dots3_note, ernie4_5_moe, exaone4_5, exaone_moe, gemma4, glm4_moe, "
            "glm4_moe_lite, glm5_next, glm_moe_dsa, glm_ocr, hy_v3, hy_v4, inkling, interns2, kimi_k3, longcat_flash, "
            "mimo, mimo_v2_flash, mimo_v2_omni, minimax_m2, minimax_m3, nemotron_h, pangu_ultra_moe, qwen3_5, "
            "qwen3_5_moe, qwen3_next, qwen4_exp, step3p5)",
        ),
        ({"mtp": ["keep"]}, "mtp: must be a mapping, got ['keep']"),
        ({"description": 5}, "description: input should be a valid string, got 5"),
        (
            {"source": "elsewhere"},
            "unknown key 'source' (allowed: calibration, description, families, mtp, name, "
            "output, quantization, schema)",
        ),
        ({"name": None}, "name: input should be a valid string, got None"),
    ],
)
def test_a_recipe_file_is_refused_in_one_line_naming_the_file_and_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError) as info:
        recipe_from_mapping({"name": "r", **raw}, "r.yaml")
    assert str(info.value) == f"r.yaml: {message}"
    # a single pattern stands for a list of one; an empty section for its defaults
    recipe = recipe_from_mapping({"name": "r", "quantization": {"exclude": "*.gate"}, "mtp": None}, "r.yaml")
    assert recipe.quantization.exclude == ("*.gate",) and recipe.mtp == MtpSection()


def test_overrides() -> None:
    recipe = load_recipe("qwen3_5-nvfp4")
    changed = apply_overrides(
        recipe,
        [
            "calibration.samples=16",
            'quantization.exclude=["*.mlp.down_proj"]',
            "mtp.mode=quantize",
            "output.max_shard_size=500MiB",
        ],
    )
    assert changed.calibration.samples == 16
    assert changed.quantization.exclude == ("*.mlp.down_proj",)
    assert changed.mtp.mode == "quantize"
    assert changed.output.max_shard_size == ByteSize("500MiB", 500 * 2**20)
    assert recipe.calibration.samples == 128  # frozen: the original is unchanged
    with pytest.raises(RecipeError, match=r"--set nope\.x: unknown key 'nope'"):
        apply_overrides(recipe, ["nope.x=1"])
    with pytest.raises(RecipeError, match="expected key=value"):
        apply_overrides(recipe, ["calibration.samples"])


def test_a_size_is_parsed_once_and_written_as_given() -> None:
    assert byte_size("5GB", "x") == ByteSize("5GB", 5 * 10**9)
    assert byte_size("1.5 MiB", "x") == ByteSize("1.5 MiB", int(1.5 * 2**20))
    assert byte_size(1234, "x") == ByteSize("1234", 1234)
    bad_sizes = (("0", "size must be positive, got '0'"), ("5 parsecs", "'5 parsecs' is not a size"), (True, "True is"))
    for bad, why in bad_sizes:
        with pytest.raises(RecipeError, match=f"^--max-shard-size: {re.escape(why)}"):
            byte_size(bad, "--max-shard-size")
    # a recipe file's size: checked where it is read (file and key named), carried parsed, written back as given
    recipe = recipe_from_mapping({"name": "r", "output": {"max_shard_size": 1000000}}, "r.yaml")
    assert recipe.output.max_shard_size == ByteSize("1000000", 10**6)
    assert "max_shard_size: '1000000'" in recipe.to_yaml()
    with pytest.raises(RecipeError, match=r"^r\.yaml: output\.max_shard_size: '-1GB' is not a size \(for example"):
        recipe_from_mapping({"name": "r", "output": {"max_shard_size": "-1GB"}}, "r.yaml")


def test_disabled_list_matches_installed_modelopt() -> None:
    """Planning uses a copy of modelopt's never-quantize entries; it must equal the installed one."""
    import modelopt.torch.quantization as mtq

    base = mtq.NVFP4_DEFAULT_CFG["quant_cfg"]
    disabled = [e for e in base if e.get("enable") is False and (e["quantizer_name"] != "*" or "parent_class" in e)]
    assert disabled == MODELOPT_NVFP4_DISABLED
    ours = load_recipe("qwen3_5-nvfp4").to_modelopt_config(FAMILY["qwen3_5"])
    weight = next(e for e in base if e.get("quantizer_name") == "*weight_quantizer")
    assert {"quantizer_name": "*weight_quantizer", "cfg": weight["cfg"]} in ours["quant_cfg"]
    assert ours["algorithm"] == mtq.NVFP4_DEFAULT_CFG["algorithm"] == "max"


@pytest.mark.parametrize(
    ("recipe", "family", "quantizer", "enabled"),
    [
        ("qwen3_5-nvfp4", "qwen3_5", "model.language_model.layers.3.self_attn.q_proj.weight_quantizer", True),
        ("qwen3_5-nvfp4", "qwen3_5", "model.language_model.layers.3.self_attn.q_proj.input_quantizer", True),
        ("qwen3_5-nvfp4", "qwen3_5", "model.language_model.layers.0.linear_attn.in_proj_a.weight_quantizer", False),
        ("qwen3_5-nvfp4", "qwen3_5", "model.visual.blocks.0.attn.qkv.weight_quantizer", False),
        ("qwen3_5-nvfp4", "qwen3_5", "lm_head.weight_quantizer", False),
        ("qwen3_5_moe-nvfp4", "qwen3_5_moe", "model.language_model.layers.0.mlp.gate.weight_quantizer", False),
        ("qwen3_5_moe-nvfp4", "qwen3_5_moe", "model.language_model.layers.0.mlp.gate_up_proj.weight_quantizer", True),
        (
            "qwen3_5_moe-nvfp4",
            "qwen3_5_moe",
            "model.language_model.layers.0.mlp.shared_expert_gate.weight_quantizer",
            False,
        ),
        (
            "qwen3_5_moe-experts-nvfp4",
            "qwen3_5_moe",
            "model.language_model.layers.0.mlp.experts.gate_up_proj_weight_quantizer",
            True,
        ),
        (
            "qwen3_5_moe-experts-nvfp4",
            "qwen3_5_moe",
            "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight_quantizer",
            False,
        ),
        (
            "qwen3_5_moe-experts-nvfp4",
            "qwen3_5_moe",
            "model.language_model.layers.3.self_attn.q_proj.weight_quantizer",
            False,
        ),
        ("qwen3_next-nvfp4", "qwen3_next", "model.layers.0.linear_attn.in_proj_ba.weight_quantizer", False),
        ("qwen3_next-nvfp4", "qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight_quantizer", True),
        ("nvfp4-w4a16", "qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight_quantizer", True),
        ("nvfp4-w4a16", "qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.input_quantizer", False),
    ],
)
def test_quantizer_selection(recipe: str, family: str, quantizer: str, enabled: bool) -> None:
    cfg = load_recipe(recipe).to_modelopt_config(FAMILY[family])
    assert quantizer_enabled(quantizer, cfg["quant_cfg"]) is enabled


def test_family_mismatch() -> None:
    with pytest.raises(RecipeError, match=r"quantizes only MoE experts, but Qwen3\.5 / Qwen3\.6 dense is dense"):
        apply_overrides(load_recipe("qwen3_5_moe-experts-nvfp4"), ["families=[]"]).check_family(FAMILY["qwen3_5"])
