"""MiMo-V2-Flash's MTP forward, as vLLM 0.32's ``MiMoV2MTP`` computes it (``model_executor/models/mimo_v2_mtp.py``);
used by convert (``--mtp quantize`` calibration) and validate.

- vLLM builds the first MTP layer only (``_MIMO_V2_FLASH_NUM_MTP_LAYERS = 1``: ``model.mtp.layers.0``) and runs it at
  every draft step (``spec_step_idx % 1``); the releases' further layers are not read;
- ``MiMoV2MTPLayer.forward``: ``eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))`` (plain RMSNorm ``w * x``), a
  pre-norm block of sliding-window attention ("MTP uses the SWA attention configuration": the SWA heads, the sink bias
  ``attention_sink_bias`` where the release has one) and a dense MLP (``pre_mlp_layernorm`` before it), then
  ``final_layernorm``: that normed output is both what the LM head reads (the target's ``lm_head``) and the next draft
  step's hidden; no masking of position 0.

The block is transformers' ``MiMoV2FlashDecoderLayer`` (a sliding, dense layer: the SWA layer's doubled KV heads and
its sinks), its norm ``MiMoV2FlashRMSNorm`` and RoPE ``MiMoV2FlashRotaryEmbedding`` for the sliding kind, composed by
transformers' generic ``modeling_layers.MtpLayer``; eager attention (transformers' SDPA path has no sinks). Names: the
checkpoint's ``pre_mlp_layernorm`` is the decoder layer's ``post_attention_layernorm``, its ``attention_sink_bias``
the attention's ``sinks`` (transformers' conversion_mapping ``mimo_v2_flash`` renames it so too), its
``final_layernorm`` the MtpLayer's post-norm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtpquant.mtp.step3p5 import Step3p5Mtp

__all__ = ["MimoV2Mtp", "mimo_v2_mtp_config"]

# the checkpoint's leaf -> the module's (MtpLayer's glue, then the decoder block's renamed leaves)
_GLUE = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_layernorm": "post_norm"}
_BLOCK = {"pre_mlp_layernorm": "post_attention_layernorm", "self_attn.attention_sink_bias": "self_attn.sinks"}
# vLLM's MiMoV2MultiTokenPredictor: num_mtp_layers = 1
VLLM_LAYERS = 1


def mimo_v2_mtp_config(text: Mapping[str, Any], depth: int) -> Any:
    """transformers' MiMo-V2-Flash config of the MTP layer(s): sliding attention, a dense MLP, eager attention."""
    from transformers import MiMoV2FlashConfig

    from mtpquant.hfconfig import transformers_config

    skip = {"architectures", "transformers_version", "quantization_config", "layer_types", "mlp_layer_types",
            "num_nextn_predict_layers"}  # fmt: skip
    values = {k: v for k, v in text.items() if k not in skip}
    values |= {"num_hidden_layers": depth, "layer_types": ["sliding_attention"] * depth,
               "mlp_layer_types": ["dense"] * depth}  # fmt: skip
    cfg = transformers_config(values, MiMoV2FlashConfig)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


class MimoV2Mtp(Step3p5Mtp):
    """MiMo-V2-Flash's first MTP layer (``model.mtp.layers.0.*``), drafting every step with the target's head."""

    @staticmethod
    def mtp_config(text: Mapping[str, Any], depth: int) -> Any:
        """transformers' config of the MTP layer (``mimo_v2_mtp_config``)."""
        return mimo_v2_mtp_config(text, depth)

    def checkpoint_name(self, name: str) -> str:
        """A parameter or module name of this module (inside ``layers``) as the checkpoint names it."""
        _, i, rest = name.split(".", 2)
        layer = f"{self.root}{self.first + int(i)}."
        if rest.startswith("mtp_block."):
            rest = rest[len("mtp_block.") :]
            for theirs, ours in _BLOCK.items():
                if rest == ours or rest.startswith(ours + "."):
                    return layer + theirs + rest[len(ours) :]
            return layer + rest
        for theirs, ours in _GLUE.items():
            if rest == ours or rest.startswith(ours + "."):
                return layer + theirs + rest[len(ours) :]
        return layer + rest

    def parameter_name(self, checkpoint: str) -> str:
        """A checkpoint tensor or module name of the MTP as this module names it."""
        if not checkpoint.startswith(self.root):
            raise KeyError(checkpoint)
        number, _, rest = checkpoint[len(self.root) :].partition(".")
        layer = f"layers.{int(number) - self.first}."
        for theirs, ours in _GLUE.items():
            if rest == theirs or rest.startswith(theirs + "."):
                return layer + ours + rest[len(theirs) :]
        for theirs, ours in _BLOCK.items():
            if rest == theirs or rest.startswith(theirs + "."):
                return layer + "mtp_block." + ours + rest[len(theirs) :]
        return layer + "mtp_block." + rest
