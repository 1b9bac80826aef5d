"""TensorRT-LLM's loader rules for a ModelOpt checkpoint's MTP (``engine/trtllm.py``), each with a layout that passes
and one that fails for the documented reason, and its verdict and serve line in inspect, ``--json`` and the card.

The oracles are TensorRT-LLM's documented behaviour, written out by hand here (not computed by the code under test):
``QuantConfig.is_module_excluded_from_quantization`` matches a module's name or any ancestor (``fnmatchcase``, ``re:``
full match, ``X.*`` also matching ``X``; before PR #13844 the name alone); ``Qwen3NextHfWeightMapper`` names the MTP
``model.layers.<num_hidden_layers>``; PR #16936 kept Qwen3.5's MTP experts unquantized only for ``model.layers.<mtp>*``
or ``model.layers.<mtp>.mlp.experts*``, PR #17051 for any ancestor; DeepSeek / GLM build the MTP layer whole
unquantized when ``model.layers.<n>`` is excluded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.engine.loading import EngineModule
from mtpquant.engine.trtllm import build, excluded, experts_excluded, module_name, serve_command
from mtpquant.families import family
from tests.support.nextn_skeleton import modelopt_nvfp4_metadata

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]
N = 4  # the tiny Qwen3.5 MoE's num_hidden_layers: TensorRT-LLM's name of its MTP layer is model.layers.4
LAYER = f"model.layers.{N}"


# ---- the matcher ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "patterns", "now", "before_13844"),
    [
        # a parent listed without a glob covers its children only by ancestor (PR #13844)
        ("model.layers.61.self_attn.q_a_proj", ["model.layers.61"], True, False),
        ("model.layers.61.mlp.experts", ["model.layers.61.mlp"], True, False),
        # the glob form matched before and after
        ("model.layers.61.self_attn.q_a_proj", ["model.layers.61*"], True, True),
        # X.* also matches X itself (the whole-layer lookup of _get_decoder_layer_quant_config)
        ("model.layers.61", ["model.layers.61.*"], True, False),
        # re: entries are full-matched
        ("model.layers.61.eh_proj", ["re:model\\.layers\\.61\\..*"], True, True),
        ("model.layers.61.eh_proj", ["re:layers\\.61"], False, False),
        # a sibling with a longer number is not a child (ancestors split on dots)
        ("model.layers.610.mlp", ["model.layers.61"], False, False),
        # the checkpoint's own MTP names do not match TensorRT-LLM's
        ("model.layers.4.fc", ["mtp*"], False, False),
        ("model.layers.4.fc", ["mtp.fc"], False, False),
    ],
)
def test_exclusions_match_by_ancestor(name: str, patterns: list[str], now: bool, before_13844: bool) -> None:
    assert excluded(name, patterns) is now
    assert excluded(name, patterns, ancestors=False) is before_13844


def test_the_mtp_is_named_as_tensorrt_llm_builds_it() -> None:
    assert module_name("mtp.layers.0.self_attn.qkv_proj", 40) == "model.layers.40.self_attn.qkv_proj"
    assert module_name("mtp.layers.1.mlp.experts", 40) == "model.layers.41.mlp.experts"
    assert module_name("mtp.fc", 40) == "model.layers.40.fc"
    assert module_name("mtp.norm", 40) == "model.layers.40.shared_head.norm"
    assert module_name("model.layers.61.eh_proj", 61) == "model.layers.61.eh_proj"  # DeepSeek: unchanged


@pytest.mark.parametrize(
    ("patterns", "fixed", "before_17051"),
    [
        ([f"{LAYER}*"], True, True),
        ([f"{LAYER}.mlp.experts*"], True, True),
        ([f"{LAYER}.mlp*"], True, False),  # a parent: only the ancestor matcher of PR #17051 covers the experts
        ([f"{LAYER}.mlp"], True, False),
        ([f"{LAYER}.self_attn*"], False, False),
        (["mtp*"], False, False),
    ],
)
def test_mtp_experts_rule(patterns: list[str], fixed: bool, before_17051: bool) -> None:
    assert experts_excluded(LAYER, patterns) is fixed
    assert experts_excluded(LAYER, patterns, fixed=False) is before_17051


def test_deepseek_decides_the_mtp_layer_whole() -> None:
    rules = family("deepseek_v3").engine
    experts = EngineModule("model.layers.61.mlp.experts", ("model.layers.61.mlp.experts.0.down_proj",), "experts")
    meta = _meta(["model.layers.61.*"])
    assert build(experts, experts.prefix, meta, rules)[:2] == (
        False,
        "model.layers.61 is excluded: the whole MTP layer is built unquantized",
    )
    assert build(experts, experts.prefix, _meta(["model.layers.61.self_attn*"]), rules)[0] is True


def _meta(exclude: list[str]):  # type: ignore[no-untyped-def]
    from mtpquant.formats.quant_config import QuantMetadata

    return QuantMetadata("modelopt", "NVFP4", 16, None, tuple(exclude))


# ---- verdicts on checkpoints ---------------------------------------------------------------------------------------
def _has_visual(path: Path) -> bool:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return any(name.startswith("model.visual.") for name in index)


def _declare(path: Path, exclude: list[str]) -> Path:
    """The tiny BF16 Qwen3.5 MoE declared a ModelOpt NVFP4 checkpoint excluding ``exclude`` (its MTP stays BF16)."""
    config = json.loads((path / "config.json").read_text())
    # the trunk stays BF16 too, excluded as a whole: the main model consistent, so only the MTP is in question
    trunk = ["lm_head", "model.language_model*", *(["model.visual*"] if _has_visual(path) else [])]
    cfg, hfq = modelopt_nvfp4_metadata(config, [*trunk, *exclude])
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "hf_quant_config.json").write_text(json.dumps(hfq))
    return path


_WHOLE = [f"{LAYER}*"]
_PARENTS = [f"{LAYER}.fc", f"{LAYER}.self_attn", f"{LAYER}.mlp"]  # ancestors, no glob
_EXACT = [f"{LAYER}.fc", f"{LAYER}.self_attn*", f"{LAYER}.mlp.shared_expert*", f"{LAYER}.mlp.experts*"]


@pytest.mark.parametrize("exclude", [_WHOLE, _EXACT], ids=["layer-glob", "module-globs"])
def test_a_bf16_mtp_excluded_by_tensorrt_llm_names_loads(tiny_copy: Factory, exclude: list[str]) -> None:
    r = inspect_checkpoint(_declare(tiny_copy("qwen3_5_moe"), exclude))
    assert r.verdicts["trtllm"] == "TensorRT-LLM: MTP loads (BF16)"
    assert r.serve_commands["trtllm"].endswith(f"trtllm-serve {r.checkpoint} --extra_llm_api_options mtp.yaml")
    assert r.to_json()["verdicts"]["trtllm"] == r.verdicts["trtllm"]


def test_parents_without_glob_load_only_by_the_ancestor_matcher(tiny_copy: Factory) -> None:
    r = inspect_checkpoint(_declare(tiny_copy("qwen3_5_moe"), _PARENTS))
    assert r.verdicts["trtllm"] == (
        f"TensorRT-LLM: MTP loads (BF16); {LAYER}.mlp.experts stays unquantized only by the ancestor matcher of "
        f"TensorRT-LLM PR #17051 (earlier releases take only {LAYER}* or {LAYER}.mlp.experts* and build it "
        "quantized)"
    )
    assert "trtllm" in r.serve_commands


def test_exclusions_in_the_checkpoint_names_only_fail(tiny_copy: Factory) -> None:
    """``mtp*`` (the form every mtpquant release before this one wrote) names the MTP as the checkpoint does;
    TensorRT-LLM builds it as model.layers.4.* and quantizes it over BF16 weights."""
    r = inspect_checkpoint(_declare(tiny_copy("qwen3_5_moe"), ["mtp*"]))
    assert r.verdicts["trtllm"] == (
        f"TensorRT-LLM will fail to load: mtp.fc is BF16 on disk but TensorRT-LLM builds it quantized as {LAYER}.fc "
        f"(no exclusion matches {LAYER}.fc; its exclusions match its own names, {LAYER}.*): add {LAYER}* to the "
        "exclusions (mtpquant graft CHECKPOINT --fix-metadata)"
    )
    assert "trtllm" not in r.serve_commands
    assert all(m.consistent for m in r.mtp_modules)  # vLLM matches the checkpoint's names: its MTP would load


def test_families_without_tensorrt_llm_rules_say_so(tiny_factory: Factory) -> None:
    r = inspect_checkpoint(tiny_factory("qwen3_5_moe"))
    assert r.verdicts["trtllm"] == "TensorRT-LLM: MTP loads (BF16)"  # no quantization: nothing to exclude
    assert r.drafters["trtllm"] == "Qwen3NextMTP"


def test_the_serve_line_carries_the_mtp_options() -> None:
    assert serve_command("org/quant", 2) == (
        "echo 'speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 2}' > mtp.yaml && "
        "trtllm-serve org/quant --extra_llm_api_options mtp.yaml"
    )


# ---- an exclusion that matches nothing (TensorRT-LLM PR #18607: a ModelOpt export's corrupt suffix) ---------------
def test_unmatched_exclusions_by_any_engine() -> None:
    from mtpquant.engine.loading import unmatched_exclusions

    names = ["lm_head", "model.layers.0.mixer.conv1d", "mtp.layers.0.mlp.experts.0.down_proj", "model.layers.4.fc"]
    patterns = [
        "*.mixer.conv1d",  # matches
        "*.mixer.conv1d_",  # the corrupt suffix: matches nothing
        "model.layers.4*",  # TensorRT-LLM's name of the MTP layer
        "re:.*experts\\.0\\..*",  # a regex entry that matches
        "re:.*experts\\.9\\..*",  # and one that does not
        "lm_head",
    ]
    assert unmatched_exclusions(patterns, names) == ["*.mixer.conv1d_", "re:.*experts\\.9\\..*"]


def test_inspect_names_an_exclusion_that_matches_nothing(tiny_copy: Factory) -> None:
    r = inspect_checkpoint(_declare(tiny_copy("qwen3_5_moe"), [*_WHOLE, "*.linear_attn.conv1d_"]))
    notes = [f.message for f in r.warnings if "match no module" in f.message or "matches no module" in f.message]
    assert notes == [
        "1 exclusion matches no module of this checkpoint by any engine's rule (*.linear_attn.conv1d_): whatever "
        "they were written for is quantized (a ModelOpt export's corrupt exclude_modules, TensorRT-LLM PR #18607)"
    ]
    clean = inspect_checkpoint(_declare(tiny_copy("qwen3_5"), _WHOLE))
    assert not [f for f in clean.warnings if "no module" in f.message]


def test_a_main_model_that_does_not_load_is_said_first(tiny_copy: Factory) -> None:
    """The same BF16 MTP, excluded in TensorRT-LLM's names, in a checkpoint declaring its BF16 trunk NVFP4: the MTP
    would load, the model does not (inspect's main-model finding)."""
    path = tiny_copy("qwen3_5_moe")
    cfg, hfq = modelopt_nvfp4_metadata(json.loads((path / "config.json").read_text()), _WHOLE)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "hf_quant_config.json").write_text(json.dumps(hfq))
    r = inspect_checkpoint(path)
    assert r.verdicts["trtllm"] == (
        "TensorRT-LLM will fail to load: the main model's metadata disagrees with its tensors (lm_head is BF16 on "
        "disk but declared quantized)"
    )
    assert "trtllm" not in r.serve_commands


# ---- each rule on a checkpoint: a layout that passes and one that fails for the documented reason -------------------
_EXPERTS_FAIL = (
    f"TensorRT-LLM will fail to load: mtp.layers.0.mlp.experts is BF16 on disk but TensorRT-LLM builds it quantized "
    f"as {LAYER}.mlp.experts (no exclusion matches {LAYER}.mlp.experts; its exclusions match its own names, "
    f"{LAYER}.*): add {LAYER}* to the exclusions (mtpquant graft CHECKPOINT --fix-metadata)"
)
_BY_ANCESTOR = (
    f"TensorRT-LLM: MTP loads (BF16); {LAYER}.mlp.experts stays unquantized only by the ancestor matcher of "
    f"TensorRT-LLM PR #17051 (earlier releases take only {LAYER}* or {LAYER}.mlp.experts* and build it quantized)"
)
# the tiny Qwen3.5 MoE's MTP routed experts (4 experts), one entry per expert Linear, as per-module lists are written
_PER_EXPERT = [f"{LAYER}.mlp.experts.{e}.{x}_proj" for e in range(4) for x in ("gate", "up", "down")]
_ALL_BUT_EXPERTS = [f"{LAYER}.fc", f"{LAYER}.self_attn*", f"{LAYER}.mlp.shared_expert*", f"{LAYER}.mlp.gate"]


@pytest.mark.parametrize(
    ("exclude", "verdict"),
    [
        # passes: the layer named without a glob covers every module below it, the fused experts included
        ([LAYER], _BY_ANCESTOR),
        # fails: the entries name the experts' children; TensorRT-LLM builds them as one module, model.layers.4.mlp
        # .experts, and matches upward from it (its name, then its ancestors), never down to its children
        ([*_ALL_BUT_EXPERTS, *_PER_EXPERT], _EXPERTS_FAIL),
    ],
    ids=["layer-as-ancestor", "children-only"],
)
def test_ancestor_matching_on_a_checkpoint(tiny_copy: Factory, exclude: list[str], verdict: str) -> None:
    r = inspect_checkpoint(_declare(tiny_copy("qwen3_5_moe"), exclude))
    assert r.verdicts["trtllm"] == verdict
    assert ("trtllm" in r.serve_commands) is verdict.startswith("TensorRT-LLM: MTP loads")
    # the oracle of the matcher, by hand: no entry is the experts module or one of its ancestors in the failing list
    ancestors = {LAYER, f"{LAYER}.mlp", f"{LAYER}.mlp.experts"}
    assert bool(ancestors & {p.rstrip("*").rstrip(".") for p in exclude}) is verdict.startswith("TensorRT-LLM: MTP")


@pytest.mark.parametrize(
    ("exclude", "verdict"),
    [
        # passes: the experts named by the pattern PR #16936 takes and PR #17051 keeps
        ([*_ALL_BUT_EXPERTS, f"{LAYER}.mlp.experts*"], "TensorRT-LLM: MTP loads (BF16)"),
        # passes only by PR #17051's ancestor matcher (the MoE block as a parent): said so
        ([*_ALL_BUT_EXPERTS, f"{LAYER}.mlp*"], _BY_ANCESTOR),
        # fails: every other MTP module excluded, the routed experts not: built quantized over BF16 weights
        (_ALL_BUT_EXPERTS, _EXPERTS_FAIL),
    ],
    ids=["experts-glob", "mlp-parent", "experts-not-excluded"],
)
def test_mtp_expert_rule_on_a_checkpoint(tiny_copy: Factory, exclude: list[str], verdict: str) -> None:
    r = inspect_checkpoint(_declare(tiny_copy("qwen3_5_moe"), exclude))
    assert r.verdicts["trtllm"] == verdict
    assert r.to_json()["verdicts"]["trtllm"] == verdict
