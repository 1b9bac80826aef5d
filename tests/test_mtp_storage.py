"""Where the MTP lives is the registry's: the three storage classes' name tests, and no MTP name test elsewhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mtpquant.families import APPENDED, NAMESPACE, SUBSPACE, MtpStorage, TensorClass, tensor_classifier

pytestmark = pytest.mark.dev

PACKAGE = Path(__file__).resolve().parents[1] / "mtpquant"


def test_namespace_storage_is_an_anchored_prefix() -> None:
    names = MtpStorage(NAMESPACE).resolve(("model.",), 0)
    assert names.is_mtp("mtp.fc.weight") and names.is_mtp("mtp.layers.0.mlp.gate.weight")
    assert not names.is_mtp("model.layers.0.mlp.mtp.weight") and not names.is_mtp("mtpx.fc.weight")
    assert names.depth(["mtp.fc.weight", "mtp.layers.0.a", "mtp.layers.2.b"]) == 3
    assert names.depth_of("mtp.fc.weight") is None
    assert names.layer_prefix("mtp.layers.1.self_attn.q_proj.weight") == "mtp.layers.1."


def test_appended_storage_needs_the_trunk_length() -> None:
    """DeepSeek-V3: layer 61 is the MTP only because num_hidden_layers is 61 (vLLM's
    get_spec_layer_idx_from_weight_name takes model.layers., layers. and model.language_model.layers. alike)."""
    names = MtpStorage(APPENDED).resolve(("model.", "model.language_model."), 61)
    assert names.is_mtp("model.layers.61.eh_proj.weight")
    assert names.is_mtp("model.language_model.layers.62.mlp.experts.0.up_proj.weight")
    assert not names.is_mtp("model.layers.60.eh_proj.weight")
    assert not names.is_mtp("model.layers.6.mlp.gate.weight") and not names.is_mtp("model.layers.61")
    assert not names.is_mtp("lm_head.weight") and not names.is_mtp("model.embed_tokens.weight")
    assert names.depth(["model.layers.61.enorm.weight", "model.layers.63.enorm.weight"]) == 3
    assert names.depth_of("model.layers.62.hnorm.weight") == 1 and names.depth_of("model.layers.3.x") is None
    assert names.layer_prefix("model.layers.61.mlp.experts.7.down_proj.weight") == "model.layers.61."
    assert names.layer_prefixes(2) == ["model.layers.61.", "model.layers.62."]
    classify = tensor_classifier("model.", False, names)
    assert classify("model.layers.61.embed_tokens.weight") == TensorClass.MTP  # a copy inside the MTP layer
    assert classify("model.layers.60.mlp.gate.weight") == TensorClass.MAIN
    assert classify("model.embed_tokens.weight") == TensorClass.EMBED


def test_subspace_and_sublayer_storage() -> None:
    mimo = MtpStorage(SUBSPACE, root="model.mtp_layers.", layer="").resolve(("model.",), 0)
    assert mimo.is_mtp("model.mtp_layers.0.input_proj.weight") and not mimo.is_mtp("model.layers.0.mlp.up_proj.weight")
    assert mimo.depth(["model.mtp_layers.0.input_proj.weight"]) == 1
    # Nemotron-H: mtp.layers.0 and .1 are the attention and MoE sub-layers of ONE depth ("*E")
    nemotron = MtpStorage(NAMESPACE, sublayers_key=("mtp_hybrid_override_pattern",)).resolve(("model.",), 0, 2)
    assert nemotron.depth(["mtp.layers.0.eh_proj.weight", "mtp.layers.1.final_layernorm.weight"]) == 1
    assert nemotron.depth(["mtp.layers.3.norm.weight"]) == 2


# The Qwen-only code that names Qwen's mtp. namespace itself: the Qwen MTP forwards and their trainer (mtp/,
# synth/train.py), heal (it trains the Qwen3 MTP layer only), and modelopt's quantizer names in convert's recipes.
_QWEN_ONLY = ("mtpquant/families/", "mtpquant/mtp/", "mtpquant/heal/", "mtpquant/synth/train.py",
              "mtpquant/recipes/recipe.py")
_NAME_TESTS = re.compile(r"is_mtp_name\(|mtp_layer_count\(|startswith\(\s*[\"']mtp\.|[\"']mtp\*[\"']|re:\^mtp")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_mtp_name_test_outside_the_registry(path: Path) -> None:
    rel = path.relative_to(PACKAGE.parent).as_posix()
    if rel.startswith(_QWEN_ONLY):
        return
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # comments and docstrings do not count; code and its strings do
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            body[0] = ast.Pass()  # type: ignore[index]
    assert _NAME_TESTS.findall(ast.unparse(tree)) == []
