"""Differential: mtpquant's quantized MTP == modelopt's own export of the same MtpLayer.

The reference side builds the MTP as an ``nn.Module`` (``mtpquant.mtp.module.MtpLayer`` under an
``mtp`` attribute, so parameter names are checkpoint names), calibrates it with ``mtq.quantize`` and a
forward loop over the given activations (max calibration runs on CPU), and exports it with modelopt's
own export steps: ``requantize_resmooth_fused_llm_layers`` (shared scales of fused groups, experts the
calibration never routed to), ``_process_quantized_modules`` (``_export_quantized_weight`` per Linear)
and ``postprocess_state_dict``. The mtpquant side is ``MtpCalibrator`` + ``quantize_mtp`` (pure torch).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mtpquant.checkpoint.dtypes import tensor_bytes
from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.mtp.module import MtpConfig, MtpLayer
from mtpquant.mtp.quantize import (
    MtpCalibrator,
    mtp_excluded_modules,
    mtp_expert_input_groups,
    mtp_fused_groups,
    mtp_quantized_modules,
    quantize_mtp,
)

pytestmark = pytest.mark.slow


class _Harness(nn.Module):
    """The MTP under ``.mtp`` with just enough of a HF model's surface for modelopt's export helpers."""

    def __init__(self, layer: MtpLayer) -> None:
        super().__init__()
        self.mtp = layer
        self.config = types.SimpleNamespace(architectures=[], is_encoder_decoder=False, use_cache=False)

    @property
    def device(self) -> torch.device:
        return self.mtp.fc.weight.device

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        if not hidden.is_floating_point():  # modelopt's dummy forward (token ids) to find shared inputs
            hidden = torch.ones(*hidden.shape, self.mtp.config.hidden_size, dtype=self.mtp.dtype)
            embeds = hidden
        assert embeds is not None
        return self.mtp(hidden, embeds)[0]


def modelopt_mtp_export(
    config: Mapping[str, Any], weights: Mapping[str, torch.Tensor], activations: Sequence[Any], fmt: str
) -> dict[str, torch.Tensor]:
    """modelopt's calibration + export of the MTP layer on ``activations`` [(hidden, embeds), ...]."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.quant_utils import postprocess_state_dict
    from modelopt.torch.export.unified_export_hf import (
        _process_quantized_modules,
        requantize_resmooth_fused_llm_layers,
    )

    cfg = MtpConfig.from_text_config(config)
    model = _Harness(MtpLayer.from_state_dict(cfg, {k: v.clone() for k, v in weights.items()}))
    qcfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG if fmt == "nvfp4" else mtq.FP8_DEFAULT_CFG)
    # modelopt's defaults skip `mtp.*` entirely; here the MTP is the model, with fc kept in BF16
    # (its router and shared_expert_gate exclusions are modelopt's own).
    qcfg["quant_cfg"] = [e for e in qcfg["quant_cfg"] if e.get("quantizer_name") != "mtp.*"]
    qcfg["quant_cfg"].append({"quantizer_name": "mtp.fc.*", "enable": False})

    def loop(m: nn.Module) -> None:
        for hidden, embeds in activations:
            m(hidden, embeds)

    with torch.no_grad():
        mtq.quantize(model, qcfg, loop)
        requantize_resmooth_fused_llm_layers(model)
        _process_quantized_modules(model, torch.bfloat16)
        state = postprocess_state_dict(model.state_dict(), 448, None)
    return {k: v.detach().cpu() for k, v in state.items()}


def ours(
    config: Mapping[str, Any], weights: Mapping[str, torch.Tensor], activations: Sequence[Any], fmt: str
) -> dict[str, torch.Tensor]:
    """mtpquant's calibration + quantization: new tensors plus the unchanged ones."""
    layer = MtpLayer.from_state_dict(MtpConfig.from_text_config(config), dict(weights))
    calibrator = MtpCalibrator(layer)
    for hidden, embeds in activations:
        calibrator.observe(hidden, embeds)
    result = quantize_mtp(weights, calibrator.amax, fmt)
    return {**{n: weights[n] for n in result.kept_tensors}, **result.tensors}


def _acts(hidden: int, rows: int, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(1, tokens, hidden, generator=g).bfloat16() * 3,
            torch.randn(1, tokens, hidden, generator=g).bfloat16(),
        )
        for _ in range(rows)
    ]


@pytest.fixture(scope="module")
def mtp_weights(tiny_factory: Callable[[str], Path]) -> Callable[[str], tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    def get(family: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        ckpt = Checkpoint.open(tiny_factory(family))
        return ckpt.config, {e.name: ckpt.read_tensor(e.name) for e in ckpt.mtp_tensors()}

    return get


@pytest.mark.parametrize(
    ("family", "fmt", "tokens"),
    [
        ("qwen3_5", "nvfp4", 24),
        ("qwen3_5_moe", "nvfp4", 24),
        ("qwen3_5_moe", "nvfp4", 1),  # one token, top-2 of 4 experts: two experts never calibrated
        ("qwen3_next", "nvfp4", 7),
        ("qwen3_5", "fp8", 24),
        ("qwen3_next", "fp8", 1),
    ],
)
def test_quantized_mtp_bit_identical_to_modelopt(
    mtp_weights: Callable[[str], tuple[dict[str, Any], dict[str, torch.Tensor]]], family: str, fmt: str, tokens: int
) -> None:
    config, weights = mtp_weights(family)
    acts = _acts(int(next(iter(weights.values())).shape[0]), rows=3, tokens=tokens, seed=tokens)
    reference = modelopt_mtp_export(config, weights, acts, fmt)
    mine = ours(config, weights, acts, fmt)
    assert sorted(mine) == sorted(reference)
    for name in sorted(reference):
        a, b = mine[name], reference[name]
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), name
        assert tensor_bytes(a) == tensor_bytes(b), name
    suffix = ".weight_scale_2" if fmt == "nvfp4" else ".weight_scale"
    assert any(n.endswith(suffix) for n in mine)
    assert all(n.startswith("mtp.") for n in mine)


def test_groups_and_exclusions(mtp_weights: Callable[[str], tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> None:
    _, weights = mtp_weights("qwen3_5_moe")
    modules = linear_modules({n: tuple(t.shape) for n, t in weights.items()})
    assert mtp_excluded_modules(modules) == ["mtp.fc", "mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.shared_expert_gate"]
    groups = mtp_fused_groups(modules)
    assert ["mtp.layers.0.self_attn.k_proj", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.self_attn.v_proj"] in [
        sorted(g) for g in groups
    ]
    assert ["mtp.layers.0.mlp.experts.3.gate_proj", "mtp.layers.0.mlp.experts.3.up_proj"] in groups
    assert ["mtp.layers.0.mlp.shared_expert.gate_proj", "mtp.layers.0.mlp.shared_expert.up_proj"] in groups
    assert ["mtp.layers.0.self_attn.o_proj"] in groups
    experts = mtp_expert_input_groups(modules)
    assert [f"mtp.layers.0.mlp.experts.{e}.down_proj" for e in range(4)] in experts
    assert len(experts) == 3
    # the recipe's quantization.exclude holds in the MTP too, matched as modelopt matches it in the main model (a
    # module's pattern covers its sub-Linears): the experts BF16, excluded by name
    bank = [m for m in modules if ".mlp.experts." in m]
    for exclude in (("*mlp.experts*",), ("mtp.layers.0.mlp.experts",)):
        assert mtp_quantized_modules(modules, exclude=exclude) == sorted(set(mtp_quantized_modules(modules)) - {*bank})
        assert mtp_excluded_modules(modules, exclude=exclude) == sorted(
            {*bank, "mtp.fc", "mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.shared_expert_gate"}
        )
    assert mtp_quantized_modules(modules, exclude=("*experts.0*", "mtp.layers.0.self_attn.q_proj")) == sorted(
        set(mtp_quantized_modules(modules))
        - {f"mtp.layers.0.mlp.experts.0.{x}_proj" for x in ("gate", "up", "down")}
        - {"mtp.layers.0.self_attn.q_proj"}
    )


def test_weight_only_has_no_input_scale(
    mtp_weights: Callable[[str], tuple[dict[str, Any], dict[str, torch.Tensor]]],
) -> None:
    _, weights = mtp_weights("qwen3_5")
    result = quantize_mtp(weights, None, "nvfp4", activations=False)
    assert not any(n.endswith(".input_scale") for n in result.tensors)
    assert "mtp.layers.0.mlp.down_proj.weight_scale_2" in result.tensors


def test_missing_calibration_is_refused(
    mtp_weights: Callable[[str], tuple[dict[str, Any], dict[str, torch.Tensor]]],
) -> None:
    _, weights = mtp_weights("qwen3_5")
    with pytest.raises(ValueError, match="recorded no activations"):
        quantize_mtp(weights, {}, "nvfp4")


def test_experts_only_recipe_quantizes_the_mtp_experts_only(
    mtp_weights: Callable[[str], tuple[dict[str, Any], dict[str, torch.Tensor]]],
    tiny_factory: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    config, weights = mtp_weights("qwen3_5_moe")
    modules = linear_modules({n: tuple(t.shape) for n, t in weights.items()})
    experts = [m for m in modules if ".mlp.experts." in m]
    result = quantize_mtp(weights, None, "nvfp4", activations=False, targets="experts")
    assert result.quantized_modules == experts
    # every other Linear the engine builds stays BF16 and is excluded by its exact name
    assert result.excluded_modules == sorted(set(modules) - set(experts))
    assert "mtp.layers.0.self_attn.q_proj.weight" in result.kept_tensors
    del config

    # through convert: the recipe's targets reach --mtp quantize, and the output loads (inspect's verdict)
    from mtpquant.convert.run import ConvertOptions, convert
    from mtpquant.diagnose.report import inspect_checkpoint

    out = tmp_path / "experts"
    run = convert(
        ConvertOptions(
            src=str(tiny_factory("qwen3_5_moe")),
            out=out,
            recipe="qwen3_5_moe-experts-nvfp4",
            mtp="quantize",
            device="cpu",
            calib_samples=2,
            calib_seq_len=32,
            progress=False,
        )
    )
    assert run.plan.mtp_quantized == tuple(experts)
    report = inspect_checkpoint(out)
    disk = {m.module: m.disk for m in report.mtp_modules}
    assert disk["mtp.layers.0.self_attn.qkv_proj"] == "BF16" and disk["mtp.layers.0.mlp.experts"] == "NVFP4"
    assert report.healthy and report.verdicts["vllm"].startswith("vLLM: MTP loads")
