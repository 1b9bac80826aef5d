"""The MTP forward of Nemotron-H / Nemotron-3 (``mtp.layers.{j}``: one depth of ``len(mtp_hybrid_override_pattern)``
sub-layers, Super's ``"*E"``: attention, then MoE), from transformers' own NemotronH classes and wired as vLLM 0.32's
drafter wires it (``model_executor/models/nemotron_h_mtp.py``):

- the first sub-layer of a depth fuses the inputs, ``eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))``
  (``has_start_projections``), ``h_t`` the target's post-``norm_f`` hidden state; the token embedding is not masked
  at position 0 (unlike DeepSeek's and GLM's drafters);
- each sub-layer is the trunk's block of its pattern character: ``x + mixer(norm(x))`` (transformers'
  ``NemotronHBlock``; vLLM's decoder layers carry the same residual through ``norm(x, residual)``); attention has no
  rotary embedding (NemotronHAttention: the Mamba layers carry position in the trunk);
- the last sub-layer adds the residual and applies ``final_layernorm`` (``has_end_norm``); that normed stream is what
  the target's LM head reads (vLLM shares the target's ``lm_head`` and embedding) and what the next draft step reads
  (``NemotronHMultiTokenPredictor.forward`` returns it; the proposer recycles it).

vLLM builds one depth (``assert self.num_mtp_layers == 1``) and applies it at every draft step. The routed experts
are held per expert, as the checkpoint stores them (``mixer.experts.{e}.up_proj``, ungated squared-ReLU), so every
parameter is named as its checkpoint tensor less ``mtp.`` and calibration sees each expert Linear by name.
``tests/test_mtp_nemotron_h.py`` checks it against transformers' ``NemotronHBlock`` / ``NemotronHRMSNorm`` (fused
experts) composed by hand on the same weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from mtpquant.mtp.module import KVCache
from mtpquant.mtp.step import MtpStep

__all__ = ["NemotronHMtp", "nemotron_h_mtp_config"]


def nemotron_h_mtp_config(text: Mapping[str, Any], depth: int) -> Any:
    """transformers' ``NemotronHConfig`` of the text config with ``layers_block_type`` the MTP's sub-layers (its
    ``mtp_layers_block_type``, once per depth), SDPA attention."""
    from transformers import NemotronHConfig

    from mtpquant.hfconfig import transformers_config

    skip = {"architectures", "transformers_version", "quantization_config"}
    cfg = transformers_config({k: v for k, v in text.items() if k not in skip}, NemotronHConfig)
    cfg.layers_block_type = list(cfg.mtp_layers_block_type) * depth
    cfg._attn_implementation = "sdpa"
    return cfg


class _PerExpert(nn.ModuleList):
    """transformers' ``NemotronHExperts`` (ungated: ``down(act(up(x)))`` per routed expert, weighted) over one
    ``nn.Linear`` pair per expert, named as the checkpoint names them (``experts.{e}.up_proj``)."""

    def __init__(self, cfg: Any) -> None:
        from transformers.activations import ACT2FN

        width = cfg.moe_latent_size if cfg.moe_latent_size is not None else cfg.hidden_size
        super().__init__(
            nn.ModuleDict(
                {
                    "up_proj": nn.Linear(width, cfg.moe_intermediate_size, bias=False),
                    "down_proj": nn.Linear(cfg.moe_intermediate_size, width, bias=False),
                }
            )
            for _ in range(cfg.n_routed_experts)
        )
        self.__dict__["act_fn"] = ACT2FN[cfg.mlp_hidden_act]  # not a child: the list holds the experts only

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden, dtype=top_k_weights.dtype)
        for e in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == e)
            expert: Any = self[e]
            act: Any = self.act_fn
            y = expert["down_proj"](act(expert["up_proj"](hidden[token])))
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out.to(hidden.dtype)


class _CacheAdapter:
    """What transformers' attention asks of ``past_key_values`` over an immutable cache: ``update`` (the new keys and
    values after the earlier rows'), recording the extended tensors."""

    def __init__(self, past: KVCache | None) -> None:
        self.past = past
        self.cache: KVCache | None = None

    def update(self, key: Tensor, value: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
        del layer_idx
        if self.past is not None:
            key = torch.cat((self.past.key.to(key.dtype), key), dim=2)
            value = torch.cat((self.past.value.to(value.dtype), value), dim=2)
        self.cache = KVCache(key, value)
        return key, value


class NemotronHMtp(nn.Module):
    """A Nemotron-H MTP of ``depth`` depths, ``layers.{j}`` the checkpoint's ``mtp.layers.{j}`` (``NemotronHBlock``
    with the glue of its place in the depth). One attention sub-layer per depth carries a KV cache."""

    index_share = False  # no sparse-attention indexer

    def __init__(self, text: Mapping[str, Any], depth: int) -> None:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock, NemotronHRMSNorm

        super().__init__()
        if depth < 1:
            raise ValueError(f"an MTP has at least one depth, got {depth}")
        cfg = nemotron_h_mtp_config(text, depth)
        self.config = cfg
        self.per_depth = len(cfg.mtp_layers_block_type)
        H, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        layers = []
        for j in range(self.per_depth * depth):
            block = NemotronHBlock(cfg, j)
            if block.block_type == "moe":
                block.mixer.experts = _PerExpert(cfg)
            if j % self.per_depth == 0:  # has_start_projections
                block.enorm = NemotronHRMSNorm(H, eps=eps)
                block.hnorm = NemotronHRMSNorm(H, eps=eps)
                block.eh_proj = nn.Linear(2 * H, H, bias=False)
            if j % self.per_depth == self.per_depth - 1:  # has_end_norm
                block.final_layernorm = NemotronHRMSNorm(H, eps=eps)
            layers.append(block)
        self.layers = nn.ModuleList(layers)
        attention = [i for i in range(self.per_depth) if cfg.layers_block_type[i] == "full_attention"]
        if len(attention) != 1:
            raise ValueError(f"a Nemotron-H MTP depth has one attention sub-layer, its pattern has {len(attention)}")
        self.attention = attention[0]

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the projections (that of the first ``eh_proj``)."""
        first: Any = self.layers[0]
        return first.eh_proj.weight.dtype

    @classmethod
    def from_state_dict(
        cls,
        text: Mapping[str, Any],
        depth: int,
        tensors: Mapping[str, Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NemotronHMtp:
        """Build from the checkpoint's ``mtp.*`` tensors (every parameter present: ``load_state_dict(strict=True)``;
        the router's ``e_score_correction_bias`` kept in F32, as the router computes in F32)."""
        with torch.device("meta"):
            mtp = cls(text, depth)
        state = {}
        for name, t in tensors.items():
            keep = name.endswith("e_score_correction_bias")
            state[name.removeprefix("mtp.")] = t.to(device=device, dtype=torch.float32 if keep else dtype)
        mtp.load_state_dict(state, strict=True, assign=True)
        mtp.requires_grad_(False)
        return mtp.eval()

    def forward(
        self,
        hidden: Tensor,
        next_tokens_embeds: Tensor,
        positions: Tensor | None = None,
        past: KVCache | None = None,
        attn_mask: Tensor | None = None,
        *,
        step: int = 0,
        selection: Tensor | None = None,
    ) -> MtpStep:
        """One causal pass of draft step ``step`` over T new rows (``mtp.step.MtpForward``): ``out`` after
        ``final_layernorm`` (the target's LM head reads it), and the same tensor as ``next_hidden``.

        Args:
            hidden: the target's post-``norm_f`` hidden ``h_t`` (or the previous step's ``next_hidden``) ``[B, T, H]``.
            next_tokens_embeds: ``embeddings(x_{t+1})`` with the target's table, ``[B, T, H]``.
            positions: unused (no rotary embedding); accepted for the drafting loop's interface.
            past: the attention sub-layer's cache of earlier rows (never modified).
            attn_mask: bool ``[B, 1, T, L + T]`` of the keys each row may see (None: causal).
            step: the draft step: the depth is ``step % depth`` (vLLM builds one and reuses it).
            selection: ignored (no indexer).
        """
        del positions, selection
        if hidden.dim() != 3 or hidden.shape != next_tokens_embeds.shape:
            raise ValueError(
                f"hidden {tuple(hidden.shape)} and next_tokens_embeds {tuple(next_tokens_embeds.shape)} must both be "
                "[B, T, H]"
            )
        B, T, _ = hidden.shape
        start = 0 if past is None else past.length
        if attn_mask is None:
            key_idx = torch.arange(start + T, device=hidden.device)
            query_idx = torch.arange(T, device=hidden.device) + start
            attn_mask = (key_idx[None, :] <= query_idx[:, None])[None, None].expand(B, 1, T, start + T)
        dtype = self.dtype
        depth = step % (len(self.layers) // self.per_depth)
        first: Any = self.layers[depth * self.per_depth]
        fused = torch.cat((first.enorm(next_tokens_embeds.to(dtype)), first.hnorm(hidden.to(dtype))), dim=-1)
        x = first.eh_proj(fused)
        cache = _CacheAdapter(past)
        for j in range(self.per_depth):
            block: Any = self.layers[depth * self.per_depth + j]
            if j == self.attention:
                x = block(x, past_key_values=cache, attention_mask=attn_mask)
            else:
                x = block(x)
        last: Any = self.layers[(depth + 1) * self.per_depth - 1]
        out = last.final_layernorm(x)
        assert cache.cache is not None
        return MtpStep(out, out, cache.cache)

    def step(self, *args: Any, **kwargs: Any) -> MtpStep:
        """The drafting loop's interface (``mtp.step.MtpForward``): ``forward``, through ``__call__``."""
        result: MtpStep = self(*args, **kwargs)
        return result
