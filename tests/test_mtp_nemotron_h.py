"""Nemotron-H's MTP forward (mtp/nemotron_h.py) against an oracle composed by hand from transformers' own NemotronH
mixers and norms (its fused ``NemotronHExperts``, not the per-expert Linears under test) with vLLM 0.32's wiring
(nemotron_h_mtp.py: ``eh_proj(cat(enorm(e), hnorm(h)))``; each decoder layer ``residual`` carried through
``norm(x, residual)``; the end norm adds the residual, then ``final_layernorm``), on the tiny checkpoint's weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.mtp.nemotron_h import NemotronHMtp, nemotron_h_mtp_config
from mtpquant.surgery.modes import load_mtp_layer

pytestmark = pytest.mark.slow

H = 128


def _mtp_tensors(path: Path) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint.open(path, strict=True)
    return {e.name: ckpt.read_tensor(e.name) for e in ckpt.mtp_tensors()}


def _oracle(text: dict[str, Any], w: dict[str, torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """vLLM's NemotronHMultiTokenPredictor.forward for "*E", in float32, from transformers' NemotronHAttention,
    NemotronHMoE (fused experts) and NemotronHRMSNorm."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHAttention, NemotronHMoE, NemotronHRMSNorm

    cfg = nemotron_h_mtp_config(text, 1)
    cfg._experts_implementation = "eager"

    def norm(name: str) -> NemotronHRMSNorm:
        n = NemotronHRMSNorm(H, eps=cfg.layer_norm_epsilon)
        n.weight.data = w[name].float()
        return n

    attn = NemotronHAttention(cfg, layer_idx=0).float()
    for leaf in ("q", "k", "v", "o"):
        getattr(attn, f"{leaf}_proj").weight.data = w[f"mtp.layers.0.mixer.{leaf}_proj.weight"].float()
    moe = NemotronHMoE(cfg).float()
    p = "mtp.layers.1.mixer."
    moe.gate.weight.data = w[p + "gate.weight"].float()
    moe.gate.e_score_correction_bias.data = w[p + "gate.e_score_correction_bias"].float()
    experts = range(cfg.n_routed_experts)
    moe.experts.up_proj.data = torch.stack([w[f"{p}experts.{e}.up_proj.weight"].float() for e in experts])
    moe.experts.down_proj.data = torch.stack([w[f"{p}experts.{e}.down_proj.weight"].float() for e in experts])
    moe.shared_experts.up_proj.weight.data = w[p + "shared_experts.up_proj.weight"].float()
    moe.shared_experts.down_proj.weight.data = w[p + "shared_experts.down_proj.weight"].float()
    enorm, hnorm = norm("mtp.layers.0.enorm.weight"), norm("mtp.layers.0.hnorm.weight")
    norm0, norm1, final = norm("mtp.layers.0.norm.weight"), norm("mtp.layers.1.norm.weight"),\
        norm("mtp.layers.1.final_layernorm.weight")  # fmt: skip
    eh = w["mtp.layers.0.eh_proj.weight"].float()

    def run(hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        x = F.linear(torch.cat((enorm(embeds), hnorm(hidden)), dim=-1), eh)
        residual = x  # layer 0 (attention, has_start_projections): residual None -> residual = x
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        x, _ = attn(norm0(x), attention_mask=causal)
        residual = x + residual  # layer 1 (MoE): norm(x, residual) adds first
        x = moe(norm1(residual))
        return final(x + residual)  # has_end_norm: the residual consumed, then final_layernorm

    return run


def test_forward_is_vllms_composition_of_transformers_layers(tiny_factory: Callable[[str], Path]) -> None:
    """Exact wiring, float32: the same weights through the oracle and the reference forward agree to rounding
    (1e-5: the per-expert Linears sum the same products as the fused bank, in another order)."""
    path = tiny_factory("nemotron_h")
    ckpt = Checkpoint.open(path, strict=True)
    tensors = _mtp_tensors(path)
    mtp = NemotronHMtp.from_state_dict(ckpt.spec.text, 1, tensors, dtype=torch.float32)
    oracle = _oracle(dict(ckpt.spec.text), tensors)
    gen = torch.Generator().manual_seed(0)
    hidden, embeds = torch.randn(2, 7, H, generator=gen), torch.randn(2, 7, H, generator=gen)
    with torch.no_grad():
        step = mtp.step(hidden, embeds)
        want = oracle(hidden, embeds)
    torch.testing.assert_close(step.out, want, rtol=0, atol=1e-5)
    assert step.next_hidden is step.out  # the normed stream is recycled (nemotron_h_mtp.py returns it)
    assert step.cache.key.shape == (2, 1, 7, 64)  # num_key_value_heads 1, head_dim 64: no RoPE, no position input
    # the same rows in two passes, the second over the first's cache: the same outputs
    with torch.no_grad():
        first = mtp.step(hidden[:, :3], embeds[:, :3])
        second = mtp.step(hidden[:, 3:], embeds[:, 3:], past=first.cache)
    torch.testing.assert_close(torch.cat((first.out, second.out), 1), step.out, rtol=0, atol=1e-5)
    # every draft step applies the one depth vLLM builds
    with torch.no_grad():
        torch.testing.assert_close(mtp.step(hidden, embeds, step=2).out, step.out, rtol=0, atol=0)


def test_reference_mtp_is_built_from_the_checkpoint_by_its_names(tiny_factory: Callable[[str], Path]) -> None:
    """The registry's builder (mtp/build.py) gives the Nemotron-H forward; every parameter is a checkpoint tensor by
    its own name (less ``mtp.``), so calibration and quantization name each Linear as the checkpoint does."""
    from mtpquant.mtp.names import checkpoint_name

    path = tiny_factory("nemotron_h")
    layer = load_mtp_layer(Checkpoint.open(path, strict=True))
    assert isinstance(layer, NemotronHMtp)
    tensors = _mtp_tensors(path)
    state = {checkpoint_name(layer, n): t for n, t in layer.state_dict().items()}
    assert sorted(state) == sorted(tensors)
    assert all(torch.equal(state[n], tensors[n].to(state[n].dtype)) for n in tensors)
    assert state["mtp.layers.1.mixer.gate.e_score_correction_bias"].dtype == torch.float32
    linears = {checkpoint_name(layer, n) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "mtp.layers.1.mixer.experts.3.down_proj" in linears and "mtp.layers.0.eh_proj" in linears


def test_the_inventory_has_nemotron_3_supers_published_count() -> None:
    """1,040 MTP tensors in Nemotron-3 Super (shared/reference/mtp-families.md §8, as ml-explore/mlx-lm#1161 counts
    them): "*E" with 512 experts and the latent MoE. The sizes here are Super-like; the count depends only on the
    pattern, the expert count and the latent projections."""
    from mtpquant.families import resolve

    config = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4096,
              "num_hidden_layers": 88, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
              "n_routed_experts": 512, "moe_intermediate_size": 2688, "moe_shared_expert_intermediate_size": 5376,
              "n_shared_experts": 1, "moe_latent_size": 1024, "mtp_hybrid_override_pattern": "*E",
              "num_nextn_predict_layers": 1, "vocab_size": 131072}  # fmt: skip
    spec = resolve(config)
    shapes = spec.expected_mtp_shapes()
    assert len(shapes) == 1040 and spec.family.mtp.inventory == "exact"
    assert shapes["mtp.layers.1.mixer.experts.511.up_proj.weight"] == (2688, 1024)  # experts read the latent
    assert shapes["mtp.layers.1.mixer.fc1_latent_proj.weight"] == (1024, 4096)
    assert shapes["mtp.layers.0.mixer.k_proj.weight"] == (256, 4096)
