"""Disk offload of experts transformers fuses while loading: rebuilt from SRC's per-expert tensors, exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.convert.offload import FUSED_ENTRY, FusedWeightsLoader, fused_entry, fused_offload

pytestmark = pytest.mark.dev


@pytest.fixture(scope="module")
def next_model(tiny_factory: Callable[[str], Path]) -> tuple[Path, Checkpoint, dict[str, torch.Tensor]]:
    import transformers

    src = tiny_factory("qwen3_next")
    model = transformers.Qwen3NextForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    return src, Checkpoint.open(src), dict(model.state_dict())


def test_fused_entries_rebuild_what_transformers_fused(next_model: tuple[Path, Checkpoint, dict]) -> None:
    src, ckpt, state = next_model
    fused = {n: t for n, t in state.items() if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    assert len(fused) == 2 * ckpt.spec.text["num_hidden_layers"]
    index = {}
    for name, param in fused.items():
        entry = fused_entry(name, param, ckpt, src)
        assert entry is not None, name
        assert len(entry[FUSED_ENTRY]) == param.shape[0]  # one list of pieces per expert
        index[name] = entry
    index["lm_head.weight"] = {"safetensors_file": str(src / ckpt.tensors["lm_head.weight"].shard),
                               "weight_name": "lm_head.weight", "dtype": "bfloat16"}  # fmt: skip
    loader = FusedWeightsLoader(index=index)
    for name, param in fused.items():
        assert torch.equal(loader[name], param), name  # same values, dtype and shape
    assert torch.equal(loader["lm_head.weight"], state["lm_head.weight"])  # accelerate's own entries unchanged
    loader.state_dict[next(iter(fused))] = torch.zeros(1)  # a write-back (modelopt) comes first
    assert loader[next(iter(fused))].shape == (1,)


def test_layouts_it_cannot_describe_are_left_to_transformers(next_model: tuple[Path, Checkpoint, dict]) -> None:
    src, ckpt, state = next_model
    name = "model.layers.0.mlp.experts.gate_up_proj"
    param = state[name]
    assert fused_entry("model.layers.0.mlp.shared_expert.gate_proj.weight", param, ckpt, src) is None
    assert fused_entry(name, param[:-1], ckpt, src) is None  # fewer experts than SRC holds
    assert fused_entry(name, param[:, :-1], ckpt, src) is None  # rows that do not add up
    assert fused_entry(name, torch.zeros(param.shape[0] + 1, *param.shape[1:]), ckpt, src) is None  # a missing expert


def test_the_offload_hook_point_is_restored(next_model: tuple[Path, Checkpoint, dict]) -> None:
    import transformers.core_model_loading as loading

    src, ckpt, _ = next_model
    original = loading.offload_and_maybe_resave_param
    with pytest.raises(RuntimeError, match="boom"), fused_offload(ckpt, src) as recorded:
        assert loading.offload_and_maybe_resave_param is not original and recorded == []
        raise RuntimeError("boom")
    assert loading.offload_and_maybe_resave_param is original
