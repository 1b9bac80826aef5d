"""Generated tiny checkpoints follow the real naming rules and load in transformers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mtpquant.checkpoint.table import Checkpoint
from tests.support.layouts import expand_layout

pytestmark = pytest.mark.dev

CASES = [
    ("qwen3_5", "Qwen3.5-4B", "Qwen3.5-4B_config.json"),
    ("qwen3_5-tied", "Qwen3.5-4B", "Qwen3.5-4B_config.json"),
    ("qwen3_5_moe", "Qwen3.5-35B-A3B", "Qwen3.5-35B-A3B_config_as_loaded_by_transformers-5.7.0.json"),
    ("qwen3_next", "Qwen3-Next-80B-A3B-Instruct", "Qwen3-Next-80B-A3B-Instruct_config.json"),
]


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.)", ".N", name)


@pytest.mark.parametrize(("variant", "model", "config_file"), CASES, ids=[c[0] for c in CASES])
def test_same_naming_rules_as_real_checkpoint(
    tiny_factory: Callable[[str], Path], real_layouts: Path, variant: str, model: str, config_file: str
) -> None:
    rows = expand_layout(
        real_layouts / f"{model}_weights_table.md", json.loads((real_layouts / config_file).read_text())
    )
    real = {_pattern(r.name): (r.dtype, len(r.shape)) for r in rows}
    ckpt = Checkpoint.open(tiny_factory(variant))
    tiny = {_pattern(n): (e.dtype, len(e.shape)) for n, e in ckpt.tensors.items()}
    if variant == "qwen3_5":  # untied variant of the same layout: lm_head added
        real["lm_head.weight"] = ("BF16", 2)
    assert tiny == real  # same name patterns, dtypes and ranks: prefixes, fused vs per-expert split
    assert set(ckpt.spec.expected_mtp_shapes()) == {n for n in ckpt.tensors if n.startswith("mtp.")}
    for name, shape in ckpt.spec.expected_mtp_shapes().items():
        assert ckpt.tensors[name].shape == shape


def test_moe_main_experts_fused_and_mtp_experts_per_expert(tiny_factory: Callable[[str], Path]) -> None:
    ckpt = Checkpoint.open(tiny_factory("qwen3_5_moe"))
    t = ckpt.tensors
    assert t["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 128)
    assert t["model.language_model.layers.0.mlp.experts.down_proj"].shape == (4, 128, 64)
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in t
    assert ckpt.shards[0].startswith("model.safetensors-00001-of-00003")


def test_mtp_spread_over_two_shards_and_norms_zero_centred(tiny_factory: Callable[[str], Path]) -> None:
    ckpt = Checkpoint.open(tiny_factory("qwen3_5"))
    assert len({e.shard for e in ckpt.mtp_tensors()}) == 2
    norm = ckpt.read_tensor("mtp.pre_fc_norm_hidden.weight").float()
    assert norm.abs().max() < 0.2
    assert "lm_head.weight" in ckpt.tensors
    assert "lm_head.weight" not in Checkpoint.open(tiny_factory("qwen3_5-tied")).tensors


def test_linear_input_dims_are_multiples_of_16(tiny_factory: Callable[[str], Path]) -> None:
    for variant in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        ckpt = Checkpoint.open(tiny_factory(variant))
        for name, e in ckpt.tensors.items():
            if len(e.shape) >= 2 and name.endswith(("proj.weight", "proj", "fc.weight")) and "visual" not in name:
                assert e.shape[-1] % 16 == 0, name


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5-tied", "qwen3_5-text", "qwen3_5_moe", "qwen3_next"])
def test_main_model_loads_in_transformers_and_gives_logits(tiny_factory: Callable[[str], Path], variant: str) -> None:
    import transformers

    path = tiny_factory(variant)
    ckpt = Checkpoint.open(path)
    cls = getattr(transformers, ckpt.spec.architecture)
    model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    logits = model(input_ids=torch.tensor([[1, 5, 7, 9, 11]])).logits
    assert logits.shape == (1, 5, 512)
    assert torch.isfinite(logits).all()
    # the weights transformers loaded are the ones on disk (e.g. the per-expert Qwen3-Next split)
    sd = model.state_dict()
    name = next(n for n in ckpt.tensors if n.endswith("layers.3.self_attn.k_proj.weight"))
    key = name if name in sd else name.replace("model.", "model.language_model.", 1)
    assert torch.equal(sd[key].to(torch.bfloat16), ckpt.read_tensor(name))
