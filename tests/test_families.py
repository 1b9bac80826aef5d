"""The registry recognises every real config and derives exactly the MTP set of its layout table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpquant.errors import ConfigError, UnsupportedArchitectureError
from mtpquant.families import TensorClass, classify_tensor, is_mtp_name, resolve
from tests.support.layouts import expand_layout

pytestmark = pytest.mark.dev

LAYOUTS = [
    ("Qwen3.5-0.8B-Base", "Qwen3.5-0.8B-Base_config_as_loaded_by_transformers-5.7.0.json", "qwen3_5", 15),
    ("Qwen3.5-4B", "Qwen3.5-4B_config.json", "qwen3_5", 15),
    ("Qwen3.5-35B-A3B", "Qwen3.5-35B-A3B_config_as_loaded_by_transformers-5.7.0.json", "qwen3_5_moe", 785),
    ("Qwen3-Next-80B-A3B-Instruct", "Qwen3-Next-80B-A3B-Instruct_config.json", "qwen3_next", 1553),
]


@pytest.mark.parametrize(("model", "config_file", "family", "n_mtp"), LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_registry_derives_real_mtp_set(
    real_layouts: Path, model: str, config_file: str, family: str, n_mtp: int
) -> None:
    config = json.loads((real_layouts / config_file).read_text())
    spec = resolve(config)
    assert spec.family.key == family
    rows = expand_layout(real_layouts / f"{model}_weights_table.md", config)
    real_mtp = {r.name: r.shape for r in rows if r.name.startswith("mtp.")}
    expected = spec.expected_mtp_shapes()
    assert len(expected) == n_mtp
    assert expected == real_mtp
    # every real tensor classifies into a known class, and vision only where the family has one
    prefix = spec.main_prefix_for(r.name for r in rows)
    classes = {spec.classify(r.name, prefix) for r in rows}
    assert TensorClass.OTHER not in classes
    assert (TensorClass.VISION in classes) == spec.family.has_vision


def test_layout_totals_match_table_headers(real_layouts: Path) -> None:
    config = json.loads((real_layouts / "Qwen3-Next-80B-A3B-Instruct_config.json").read_text())
    rows = expand_layout(real_layouts / "Qwen3-Next-80B-A3B-Instruct_weights_table.md", config)
    assert len(rows) == 75_944


def test_qwen3_next_defaults_to_one_layer_without_key(real_layouts: Path) -> None:
    spec = resolve(json.loads((real_layouts / "Qwen3-Next-80B-A3B-Instruct_config.json").read_text()))
    assert spec.mtp.layers == 1 and spec.mtp.key is None
    assert "engines default to 1" in spec.mtp.describe()


def test_mtp_declaration_key_and_value(real_layouts: Path) -> None:
    spec = resolve(json.loads((real_layouts / "Qwen3.5-4B_config.json").read_text()))
    assert spec.mtp.describe() == "text_config.mtp_num_hidden_layers = 1"
    assert spec.tied_embeddings is True
    assert spec.wrapped and spec.main_prefix == "model.language_model."


def test_text_only_reexports_are_recognised() -> None:
    base = {
        "hidden_size": 64,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 64,
        "mtp_num_hidden_layers": 1,
    }
    dense = resolve({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **base})
    assert dense.family.key == "qwen3_5" and not dense.wrapped
    assert dense.mtp.describe() == "mtp_num_hidden_layers = 1"
    assert dense.main_prefix_for(["model.layers.0.mlp.up_proj.weight"]) == "model."
    assert dense.main_prefix_for(["model.language_model.layers.0.mlp.up_proj.weight"]) == "model.language_model."
    moe = resolve({"model_type": "qwen3_5_moe_text", **base})
    assert moe.family.key == "qwen3_5_moe" and moe.architecture == "Qwen3_5MoeForCausalLM"


def test_unsupported_architecture_lists_supported() -> None:
    with pytest.raises(UnsupportedArchitectureError) as err:
        resolve({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    msg = str(err.value)
    assert msg.startswith("config.json: unsupported architecture LlamaForCausalLM; supported: ")
    for arch in (
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
    ):
        assert arch in msg
    assert "\n" not in msg


def test_bad_mtp_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"text_config.mtp_num_hidden_layers must be a non-negative integer"):
        resolve({"model_type": "qwen3_5", "text_config": {"mtp_num_hidden_layers": "one"}})


def test_mtp_detection_is_anchored() -> None:
    assert is_mtp_name("mtp.fc.weight")
    assert not is_mtp_name("model.language_model.layers.0.mtp.fc.weight")
    assert not is_mtp_name("mtpx.fc.weight")
    assert classify_tensor("model.language_model.layers.0.mlp.mtp_gate.weight", "model.language_model.") == "main"
    assert classify_tensor("model.visual.blocks.0.attn.qkv.weight", "model.language_model.") == "vision"
    assert classify_tensor("model.language_model.embed_tokens.weight", "model.language_model.") == "embed"
    assert classify_tensor("lm_head.weight", "model.") == "lm_head"
    assert classify_tensor("something.else", "model.") == "other"


def test_one_declaration_rule_sets_and_undeclares(real_layouts: Path) -> None:
    from mtpquant.surgery.metadata import declare_mtp

    config = json.loads((real_layouts / "Qwen3.5-4B_config.json").read_text())
    spec = resolve(config)
    dropped = declare_mtp(spec, 0)
    # un-declared in place: an explicit 0 at the same position, so no engine defaults it back to one layer
    assert dropped["text_config"]["mtp_num_hidden_layers"] == 0
    assert list(dropped["text_config"]) == list(config["text_config"])
    assert config["text_config"]["mtp_num_hidden_layers"] == 1  # the source mapping is untouched
    assert resolve(dropped).mtp.declared is False
    assert declare_mtp(spec, 1)["text_config"]["mtp_num_hidden_layers"] == 1
    # an absent key is restored where the reference config has it (extract + graft == keep)
    absent = json.loads(json.dumps(config))
    del absent["text_config"]["mtp_num_hidden_layers"]
    restored = declare_mtp(resolve(absent), 1, reference=config)
    assert list(restored["text_config"]) == list(config["text_config"])
    assert declare_mtp(resolve(absent), 0) == absent  # nothing to un-declare
