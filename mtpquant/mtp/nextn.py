"""The MTP forward of the appended-layer ("NextN") families (GLM-4.5 / 4.6 / 4.7, DeepSeek-V3 / R1 / V3.1), from
transformers' own classes and wired as vLLM 0.32's drafters wire them; used by convert (calibration of
``--mtp quantize``), validate's built-in prediction and heal.

One MTP depth ``i`` is the checkpoint's layer ``model.layers.{N+i}``. vLLM (``model_executor/models/glm4_moe_mtp.py``
``Glm4MoeMultiTokenPredictorLayer.forward``, ``deepseek_mtp.py`` ``DeepSeekMultiTokenPredictorLayer.forward``):

- the token embedding is zeroed at position 0 ("masking inputs at position 0, as not needed by MTP");
- ``eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))``, ``h_t`` the target's post-final-norm hidden state (the
  concatenation order is family data: ``AppendedForward.hidden_first``);
- the decoder block (``mtp_block``: the trunk's decoder layer, MoE), its residual added back;
- the logits: ``shared_head.head(shared_head.norm(x))`` with the target's LM head (``llm_base_proposer``
  ``_maybe_share_lm_head`` puts the target's head into every ``shared_head.head``, and ``_maybe_share_embeddings``
  the target's embedding, whatever copies the layer carries);
- the next draft step reads ``x`` (GLM: the pre-norm hidden, the one tensor ``Glm4MoeMTP.forward`` returns) or
  ``shared_head.norm(x)`` (DeepSeek: ``(hidden, shared_head(hidden))``, the proposer recycles the second):
  ``AppendedForward.recycle_normed``.

The composition is transformers 5.19's generic DeepSeek-style ``modeling_layers.MtpLayer`` (``enorm``, ``hnorm``,
``eh_proj``, ``mtp_block``) built with the family's ``{Prefix}DecoderLayer`` and ``{Prefix}RMSNorm``, without its
post-norm (the pre-norm stream is needed too), the norm added as the layer's ``post_norm`` (transformers'
``MtpModel`` conversion renames ``shared_head.norm`` to it); RoPE is the family's ``{Prefix}RotaryEmbedding``. The
cache is explicit and never modified: what the attention hands ``past_key_values.update`` (GLM: keys and values after
norm and RoPE; DeepSeek's MLA: the compressed latent and the rotated key part), a ``module.KVCache``.

DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``) add the sparse-attention indexer to the MLA (transformers'
``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``: the top ``index_topk`` visible keys per row, folded into the attention
mask): its keys are cached beside the MLA's (``IndexedKVCache``), its choice is the step's ``selection``, and with
``index_share_for_mtp_iteration`` (GLM-5) draft steps after the first attend to the first step's choice, as vLLM's
``DeepseekV32MultiTokenPredictor`` shares it (``models/deepseek_v32/nvidia/mtp.py``).

``tests/test_mtp_nextn.py`` checks the logits against transformers' own ``MtpModel`` loaded from the checkpoint
(``MtpModel.from_pretrained``, the target's head) and a hand-written composition of vLLM's step.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mtpquant.families.nextn import AppendedForward
from mtpquant.mtp.module import KVCache, check_mtp_tensors
from mtpquant.mtp.step import MtpStep

__all__ = ["IndexedKVCache", "NextnMtp", "nextn_mtp_config"]

# The layer's own leaves (not its decoder block) and their names in transformers' MtpLayer
_GLUE = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "post_norm"}
_BLOCK = "mtp_block."


def _classes(forward: AppendedForward) -> Any:
    return importlib.import_module(f"transformers.models.{forward.module}.modeling_{forward.module}")


def nextn_mtp_config(text: Mapping[str, Any], forward: AppendedForward, depth: int) -> Any:
    """transformers' config of the family for ``depth`` MTP layers (as ``PreTrainedConfig.get_mtp_config`` makes
    it: ``num_hidden_layers`` the depth, every layer MoE, ``first_k_dense_replace`` 0), SDPA attention, the experts'
    eager loop."""
    from mtpquant.hfconfig import transformers_config

    # per-layer lists of the trunk (GLM-5's indexer_types, mlp_layer_types) are made again for the MTP's layers
    skip = {"architectures", "transformers_version", "quantization_config", "indexer_types", "mlp_layer_types",
            "layer_types"}
    values = {k: v for k, v in text.items() if k not in skip}
    values |= {"num_hidden_layers": depth, "first_k_dense_replace": 0, "num_nextn_predict_layers": depth}
    cls = getattr(importlib.import_module("transformers"), f"{forward.prefix}Config")
    cfg = transformers_config(values, cls)
    cfg.mtp_hidden_states_first = forward.hidden_first  # read by modeling_layers.MtpLayer.forward
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return cfg


@dataclass(frozen=True)
class IndexedKVCache(KVCache):
    """The cache of a layer with the sparse-attention indexer: the MLA's ``key`` / ``value`` and the indexer's keys
    ``index_key`` ``[B, L, index_head_dim]`` (after its norm and RoPE, as transformers' ``update_indexer`` gets
    them)."""

    index_key: Tensor

    def expand(self, batch: int) -> IndexedKVCache:
        """The batch-1 cache repeated ``batch`` times (views, no copy)."""
        base = super().expand(batch)
        return IndexedKVCache(base.key, base.value, self.index_key.expand(batch, -1, -1))

    def last(self, rows: int) -> IndexedKVCache:
        """The last ``rows`` cached positions."""
        return IndexedKVCache(self.key[:, :, -rows:], self.value[:, :, -rows:], self.index_key[:, -rows:])

    def cat(self, parts: Sequence[KVCache]) -> IndexedKVCache:
        """This cache followed by the positions of ``parts`` (same batch)."""
        keys = [self.index_key]
        for part in parts:
            if not isinstance(part, IndexedKVCache):
                raise TypeError(f"an indexed cache extends by indexed caches only, got {type(part).__name__}")
            keys.append(part.index_key)
        base = super().cat(parts)
        return IndexedKVCache(base.key, base.value, torch.cat(keys, dim=1))


class _CacheAdapter:
    """What transformers' attention asks of ``past_key_values`` (``update``; the indexer's ``update_indexer``) over
    an immutable cache; records the extended tensors."""

    def __init__(self, past: KVCache | None) -> None:
        self.past = past
        self.key: Tensor | None = None
        self.value: Tensor | None = None
        self.index_key: Tensor | None = None

    def update(self, key: Tensor, value: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
        del layer_idx
        if self.past is not None:
            key = torch.cat((self.past.key.to(key.dtype), key), dim=2)
            value = torch.cat((self.past.value.to(value.dtype), value), dim=2)
        self.key, self.value = key, value
        return key, value

    def update_indexer(self, index_key: Tensor, layer_idx: int) -> Tensor:
        del layer_idx
        if isinstance(self.past, IndexedKVCache):
            index_key = torch.cat((self.past.index_key.to(index_key.dtype), index_key), dim=1)
        self.index_key = index_key
        return index_key

    def cache(self) -> KVCache:
        """The extended cache."""
        assert self.key is not None and self.value is not None
        if self.index_key is None:
            return KVCache(self.key, self.value)
        return IndexedKVCache(self.key, self.value, self.index_key)


def _as_indices(selection: Tensor) -> Tensor:
    """A bool selection ``[B, T, L]`` as the top-k indices transformers' attention scatters into its mask
    (``[B, T, M]``, M the most keys a row selects; a row with fewer repeats its first, which selects nothing more)."""
    count = selection.sum(-1, keepdim=True)
    order = torch.argsort((~selection).to(torch.int8), dim=-1, stable=True)[..., : max(int(count.max()), 1)]
    slot = torch.arange(order.shape[-1], device=order.device)
    return torch.where(slot < count.clamp_min(1), order, order[..., :1]).to(torch.int32)


class NextnMtp(nn.Module):
    """An appended-layer MTP of ``depth`` layers; ``checkpoint_name`` maps its parameter and module names to the
    checkpoint's (``layers.{i}.mtp_block.X`` <-> ``{root}{N+i}.X``, ``layers.{i}.post_norm`` <->
    ``{root}{N+i}.shared_head.norm``)."""

    def __init__(self, text: Mapping[str, Any], forward: AppendedForward, depth: int, root: str, first: int) -> None:
        from transformers.modeling_layers import MtpLayer as HfMtpLayer

        super().__init__()
        if depth < 1:
            raise ValueError(f"an MTP has at least one layer, got {depth}")
        cfg = nextn_mtp_config(text, forward, depth)
        classes = _classes(forward)
        decoder, norm = getattr(classes, f"{forward.prefix}DecoderLayer"), getattr(classes, f"{forward.prefix}RMSNorm")
        self.config = cfg
        self.forward_data = forward
        self.root, self.first = root, first
        # DeepSeek-V3.2 / GLM-5: steps after the first reuse the first step's token selection (vLLM's
        # DeepseekV32MultiTokenPredictor, models/deepseek_v32/nvidia/mtp.py)
        self.index_share = "index_n_heads" in text and bool(text.get("index_share_for_mtp_iteration", False))
        layers = []
        for i in range(depth):
            layer = HfMtpLayer(cfg, decoder, norm, i, use_post_norm=False)
            layer.post_norm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)  # shared_head.norm, applied in step()
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = getattr(classes, f"{forward.prefix}RotaryEmbedding")(cfg)  # non-persistent buffers

    # ---- names -------------------------------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        """A parameter or module name of this module (inside ``layers``) as the checkpoint names it."""
        _, i, rest = name.split(".", 2)
        layer = f"{self.root}{self.first + int(i)}."
        if rest.startswith(_BLOCK):
            return layer + rest[len(_BLOCK) :]
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
        return layer + _BLOCK + rest

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the projections (that of the first ``eh_proj``)."""
        layer: Any = self.layers[0]
        return layer.eh_proj.weight.dtype

    @classmethod
    def from_state_dict(
        cls,
        text: Mapping[str, Any],
        forward: AppendedForward,
        depth: int,
        root: str,
        first: int,
        expected: Mapping[str, tuple[int, ...]],
        tensors: Mapping[str, Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> NextnMtp:
        """Build from the checkpoint's MTP tensors (names and shapes checked against ``expected``, the registry's
        inventory; per-expert banks fused as transformers keeps them; the head / embedding copies are not read: the
        drafter uses the target's). Every parameter must be present (``load_state_dict(strict=True)``)."""
        from mtpquant.mtp.quantize import fuse_mtp_experts

        check_mtp_tensors(expected, tensors)
        with torch.device("meta"):
            mtp = cls(text, forward, depth, root, first)
        experts = int(text.get("n_routed_experts") or 0)
        fused = fuse_mtp_experts(tensors, experts, skip=(".shared_head.head.weight", ".embed_tokens.weight"))
        state = {mtp.parameter_name(n): t.to(device=device, dtype=dtype) for n, t in fused.items()}
        mtp.load_state_dict(state, strict=True, assign=True)
        # the rotary embedding holds buffers only, built on meta above: build it again where the weights are
        with torch.device(next(iter(state.values())).device):
            mtp.rotary_emb = getattr(_classes(forward), f"{forward.prefix}RotaryEmbedding")(mtp.config)
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
        ``shared_head.norm`` (the target's LM head reads it), ``next_hidden`` the stream the next step reads.

        Args:
            hidden: the target's post-final-norm hidden ``h_t`` (or the previous step's ``next_hidden``) ``[B, T, H]``.
            next_tokens_embeds: ``embed_tokens(x_{t+1})`` with the target's table, ``[B, T, H]``.
            positions: ``[B, T]`` or ``[T]``; defaults to ``past.length + arange(T)``.
            past: the layer's cache of earlier rows (never modified).
            attn_mask: bool ``[B, 1, T, L + T]`` of the keys each row may see (None: causal).
            step: the draft step: the layer is ``layers[step % depth]``.
            selection: bool ``[B, 1, T, L + T]`` replacing the indexer's choice (index sharing: step 0's); the
                indexer still caches its keys. Ignored by a layer without an indexer.
        """
        if hidden.dim() != 3 or hidden.shape != next_tokens_embeds.shape:
            raise ValueError(
                f"hidden {tuple(hidden.shape)} and next_tokens_embeds {tuple(next_tokens_embeds.shape)} must both be "
                "[B, T, H]"
            )
        B, T, _ = hidden.shape
        device = hidden.device
        start = 0 if past is None else past.length
        if positions is None:
            positions = torch.arange(start, start + T, device=device)
        if positions.dim() == 1:
            positions = positions[None].expand(B, T)
        if attn_mask is None:
            key_idx = torch.arange(start + T, device=device)
            query_idx = torch.arange(T, device=device) + start
            attn_mask = (key_idx[None, :] <= query_idx[:, None])[None, None].expand(B, 1, T, start + T)
        dtype = self.dtype
        embeds = next_tokens_embeds.to(dtype)
        if self.forward_data.mask_position_zero:
            embeds = torch.where(positions.unsqueeze(-1) == 0, torch.zeros_like(embeds), embeds)
        layer: Any = self.layers[step % len(self.layers)]
        position_embeddings = self.rotary_emb(embeds, positions)
        cache = _CacheAdapter(past)
        indexer = getattr(layer.mtp_block.self_attn, "indexer", None)
        chosen: list[Tensor] = []
        if indexer is not None:
            visible = attn_mask[:, 0]

            def select(*args: Any, **kwargs: Any) -> Tensor:
                indices: Tensor = type(indexer).forward(indexer, *args, **kwargs)  # caches the rows' indexer keys
                if selection is not None:
                    indices = _as_indices(selection[:, 0].to(visible.device) & visible)
                mask = torch.zeros_like(visible).scatter(-1, indices.long(), True) & visible
                chosen.append(mask[:, None])
                return indices

            indexer.forward = select
        try:
            x = layer(
                embeds,
                hidden.to(dtype),
                position_embeddings=position_embeddings,
                attention_mask=attn_mask,
                position_ids=positions,
                past_key_values=cache,
            )
        finally:
            if indexer is not None:
                del indexer.forward  # the class's forward again
        if isinstance(x, tuple):  # GLM-5's decoder layer also returns its top-k, for the next layer to share
            x = x[0]
        out = layer.post_norm(x)
        nxt = out if self.forward_data.recycle_normed else x
        return MtpStep(out, nxt, cache.cache(), chosen[0] if chosen else None)

    def step(self, *args: Any, **kwargs: Any) -> MtpStep:
        """The drafting loop's interface (``mtp.step.MtpForward``): ``forward``, through ``__call__``."""
        result: MtpStep = self(*args, **kwargs)
        return result
