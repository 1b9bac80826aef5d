"""The Qwen3.8-Flash-Next (``qwen4_exp``) MTP forward, built from transformers' own Qwen4-Exp classes and wired
as vLLM's ``Qwen4ExpMTP`` wires them; used by convert (calibration of ``--mtp quantize``) and validate.

vLLM 0.32 ``vllm/models/qwen4_exp/nvidia/mtp.py``, ``Qwen4ExpMultiTokenPredictor``, one draft step:

- the token embedding: ``pre_fc_norm_embedding`` then ``fc_embedding`` ([H] -> [H]; lines 305-307);
- the hidden input is the *multi-stream* state ``[T, hc_count * H]``: on step 0 the target's state before its final
  hyper-connection mixer (``Qwen4ExpModel.forward`` keeps ``multi_hidden`` for the drafter, model.py 636-642), on
  later steps the previous draft step's multi stream; ``pre_fc_norm_hidden`` normalises all ``hc_count * H``
  features at once, then ``fc_hidden`` projects every stream with the same [H, H] weight (lines 309-319);
- the layer ``layers[spec_step_idx % num_mtp_layers]`` (a QSA decoder layer with hyper-connections, no PLE:
  lines 223-229, 325, 342) runs with ``prev_block_output = fc_embedding(...)`` and ``prev_injection = None``
  (lines 320, 343-351): its first hyper-connection consumes that pending combine with unit weight on every stream
  (``hc_combine_norm`` without injection logits, nvidia/ops/hc.py 315-325), i.e. the layer's input is
  ``fc_hidden(...)`` plus the embedding branch added to each stream;
- the MTP's own ``hyper_connection_mixer`` (a gated residual without combine, lines 243-256) returns TWO streams
  (lines 360-380): the collapsed ``[T, H]`` one goes to the LM head, the multi-stream ``[T, hc_count * H]`` one is
  the next draft step's hidden input.

With ``index_share_for_mtp_iteration`` (vllm/config/speculative.py 845-864; v1/spec_decode/llm_base_proposer.py
578-613: ``set_skip_topk`` / ``compact_topk_indices``, mtp.py 271-282) step 0 runs the QSA indexer and every later
step reuses step 0's selected tokens for the row it drafts from (nvidia/indexer_qsa.py 258-262, 409-411): those
steps attend to exactly the tokens step 0 selected, none of the draft chain's own rows.

The blocks are transformers' (5.19 ``models/qwen4_exp/modeling_qwen4_exp.py``): ``Qwen4ExpTextDecoderLayer``
(gated residuals, QSA attention with its indexer, sparse MoE with fused experts), ``Qwen4ExpTextRMSNorm``,
``Qwen4ExpTextGatedResidual``, ``Qwen4ExpTextRotaryEmbedding``. Parameter names, prefixed with ``mtp.``, are the
checkpoint's tensor names (fused experts as on disk). The MTP's cache is explicit and never modified
(``Qwen4ExpMtpCache``): keys and values after norm and RoPE, the indexer's raw keys, and each cached row's position.
``tests/test_mtp_qwen4_exp.py`` checks the composition against transformers' decoder layer run directly and a
hand-written re-implementation of vLLM's two-stream step.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mtpquant.families import MTP_PREFIX
from mtpquant.mtp.step import MtpStep

__all__ = [
    "Qwen4ExpMtp",
    "Qwen4ExpMtpCache",
    "exact_selections",
    "qwen4_exp_mtp_config",
]

def qwen4_exp_mtp_config(text: Mapping[str, Any] | Any, num_layers: int) -> Any:
    """transformers' ``Qwen4ExpTextConfig`` for ``num_layers`` MTP layers: every layer QSA, no PLE (vLLM builds the
    draft's layers as ``qwen_sparse_attention`` with PLE forced off: mtp.py 5-8, 223-229).

    ``text`` is the checkpoint's ``text_config`` (a mapping) or a ``Qwen4ExpTextConfig``.
    """
    from transformers import Qwen4ExpTextConfig

    if isinstance(text, Mapping):
        values = {k: v for k, v in text.items() if k not in {"model_type", "architectures", "transformers_version"}}
        cfg = Qwen4ExpTextConfig(**values)
    else:
        cfg = copy.deepcopy(text)
    cfg.num_hidden_layers = num_layers
    cfg.layer_types = ["indexed_attention"] * num_layers
    cfg.ple_layer_ids = []
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"  # the experts' own per-expert loop (Qwen4ExpTextExperts.forward)
    return cfg


@dataclass(frozen=True)
class Qwen4ExpMtpCache:
    """One MTP layer's cache of earlier rows: post-norm, post-RoPE ``key``/``value`` ``[B, kv_heads, L, head_dim]``,
    the indexer's raw keys ``index_key`` ``[B, L, index_head_dim]`` and ``positions`` ``[B, L]``."""

    key: Tensor
    value: Tensor
    index_key: Tensor
    positions: Tensor

    @property
    def length(self) -> int:
        """Number of cached rows."""
        return int(self.key.shape[2])

    def expand(self, batch: int) -> Qwen4ExpMtpCache:
        """The batch-1 cache repeated ``batch`` times (views, no copy)."""
        return Qwen4ExpMtpCache(
            self.key.expand(batch, -1, -1, -1),
            self.value.expand(batch, -1, -1, -1),
            self.index_key.expand(batch, -1, -1),
            self.positions.expand(batch, -1),
        )

    def last(self, rows: int) -> Qwen4ExpMtpCache:
        """The last ``rows`` cached rows."""
        return Qwen4ExpMtpCache(
            self.key[:, :, -rows:], self.value[:, :, -rows:], self.index_key[:, -rows:], self.positions[:, -rows:]
        )

    def cat(self, parts: Sequence[Qwen4ExpMtpCache]) -> Qwen4ExpMtpCache:
        """This cache followed by the rows of ``parts`` (same batch)."""
        every = [self, *parts]
        return Qwen4ExpMtpCache(
            torch.cat([p.key for p in every], dim=2),
            torch.cat([p.value for p in every], dim=2),
            torch.cat([p.index_key for p in every], dim=1),
            torch.cat([p.positions for p in every], dim=1),
        )


class _CacheAdapter:
    """What transformers' ``Qwen4ExpTextAttention`` asks of ``past_key_values`` (``update``, ``update_indexer``),
    over an immutable ``Qwen4ExpMtpCache``; records the extended tensors."""

    def __init__(self, past: Qwen4ExpMtpCache | None) -> None:
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
        if self.past is not None:
            index_key = torch.cat((self.past.index_key.to(index_key.dtype), index_key), dim=1)
        self.index_key = index_key
        return index_key


def _index_keys(indexer: Any, hidden_states: Tensor, past_key_values: Any) -> None:
    """The part of transformers' ``Qwen4ExpTextQSAIndexer.forward`` that feeds the cache: the new rows' raw indexer
    keys, appended by ``update_indexer`` (the selection itself is then not needed: every key is selected, or step
    0's selection is shared)."""
    B, T, _ = hidden_states.shape
    heads, kv_heads, dim = indexer.index_n_heads, indexer.index_kv_heads, indexer.index_head_dim
    _, token_k = torch.split(indexer.index_qk_proj(hidden_states), [heads * dim, kv_heads * dim], dim=-1)
    raw_keys = token_k.reshape(B, T, -1, dim).squeeze(2)
    if past_key_values is not None:
        past_key_values.update_indexer(raw_keys, indexer.layer_idx)


def _select(indexer: Any, hidden_states: Tensor, embeddings: Any, attention_mask: Tensor, past: Any) -> Tensor:
    """transformers' QSA selection, exactly, without its per-(row, query) loop where it selects every visible key:
    when the keys fit the token budget (the indexer keeps ``budget // ratio`` blocks of the visible ones, and the
    tail), the selection is the mask of visible keys itself (in the mask's form: bool, or 0 / the dtype's min)."""
    if attention_mask.shape[-1] > indexer.token_budget:
        selected: Tensor = type(indexer).forward(indexer, hidden_states, embeddings, attention_mask, past)
        return selected
    _index_keys(indexer, hidden_states, past)
    if not attention_mask.is_floating_point():
        return attention_mask
    visible = attention_mask == 0
    return torch.where(visible, attention_mask.new_zeros(()), torch.finfo(attention_mask.dtype).min)


def exact_selections(model: nn.Module) -> int:
    """Give every transformers ``Qwen4ExpTextQSAIndexer`` in ``model`` the loop-free selection where it selects every
    visible key (``_select``: the same mask, bit for bit); returns how many. The target model validate and heal run
    (``measure.target``) spends most of its time in that loop otherwise."""
    found = [m for m in model.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer"]  # other families: none
    if not found:
        return 0
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    indexers = [m for m in found if isinstance(m, Qwen4ExpTextQSAIndexer)]
    for module in indexers:
        module.forward = functools.partial(_select, module)  # type: ignore[method-assign]
    return len(indexers)


class Qwen4ExpMtp(nn.Module):
    """The Qwen4-Exp MTP; ``"mtp." + name`` of every parameter is its checkpoint tensor name."""

    def __init__(self, text_config: Any, num_layers: int = 1, *, index_share: bool = False) -> None:
        from transformers.models.qwen4_exp.modeling_qwen4_exp import (
            Qwen4ExpTextDecoderLayer,
            Qwen4ExpTextGatedResidual,
            Qwen4ExpTextRMSNorm,
            Qwen4ExpTextRotaryEmbedding,
        )

        super().__init__()
        if num_layers < 1:
            raise ValueError(f"an MTP has at least one layer, got {num_layers}")
        cfg = qwen4_exp_mtp_config(text_config, num_layers)
        self.config = cfg
        self.index_share = index_share
        H, hc = int(cfg.hidden_size), int(cfg.hc_count)
        self.hidden_size, self.hc_count = H, hc
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(hc * H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen4ExpTextDecoderLayer(cfg, i) for i in range(num_layers))
        self.hyper_connection_mixer = Qwen4ExpTextGatedResidual(cfg, use_combine=False)
        self.rotary_emb = Qwen4ExpTextRotaryEmbedding(cfg)  # buffers only, not persistent

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the projections (that of ``fc_hidden.weight``)."""
        return self.fc_hidden.weight.dtype

    @classmethod
    def from_state_dict(
        cls,
        text_config: Mapping[str, Any] | Any,
        num_layers: int,
        tensors: Mapping[str, Tensor],
        *,
        index_share: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Qwen4ExpMtp:
        """Build from the checkpoint's ``mtp.*`` tensors (fused experts); every parameter must be present with its
        shape (``load_state_dict(strict=True)``). Tensors are adopted unless ``dtype``/``device`` asks for a copy."""
        with torch.device("meta"):
            mtp = cls(text_config, num_layers, index_share=index_share)
        state = {name[len(MTP_PREFIX) :]: t.to(device=device, dtype=dtype) for name, t in tensors.items()}
        mtp.load_state_dict(state, strict=True, assign=True)
        # the rotary embedding holds buffers only, built on meta above: build it again where the weights are
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

        mtp.rotary_emb = Qwen4ExpTextRotaryEmbedding(mtp.config, device=mtp.fc_hidden.weight.device)
        mtp.requires_grad_(False)
        return mtp.eval()

    def forward(
        self,
        hidden: Tensor,
        next_tokens_embeds: Tensor,
        positions: Tensor | None = None,
        past: Qwen4ExpMtpCache | None = None,
        attn_mask: Tensor | None = None,
        *,
        step: int = 0,
        selection: Tensor | None = None,
    ) -> MtpStep:
        """One causal pass of draft step ``step`` over T new rows: ``out`` is the collapsed stream (the LM head's
        input), ``next_hidden`` the multi-stream one (the next step's hidden input), ``selection`` the indexer's.

        Args:
            hidden: the multi-stream hidden ``[B, T, hc_count * H]`` (target's state before its final mixer, or the
                previous step's ``multi``).
            next_tokens_embeds: ``embed_tokens`` of the tokens after the hidden's positions, ``[B, T, H]``.
            positions: ``[B, T]`` or ``[T]``; defaults to ``past.length + arange(T)``.
            past: the cache of the layer this step runs (never modified).
            attn_mask: bool ``[B, 1, T, L + T]`` of the keys each row may see (None: causal over ``past`` then the
                new rows).
            step: the draft step (``spec_step_idx``): the layer is ``layers[step % len(layers)]``.
            selection: bool ``[B, 1, T, L + T]`` replacing the QSA indexer's selection (index sharing: step 0's).
        """
        H, hc = self.hidden_size, self.hc_count
        if hidden.dim() != 3 or hidden.shape[-1] != hc * H or next_tokens_embeds.shape != (*hidden.shape[:2], H):
            raise ValueError(
                f"hidden {tuple(hidden.shape)} must be [B, T, {hc * H}] and next_tokens_embeds "
                f"{tuple(next_tokens_embeds.shape)} [B, T, {H}]"
            )
        B, T, _ = hidden.shape
        device = hidden.device
        start = 0 if past is None else past.length
        if positions is None:
            positions = torch.arange(start, start + T, device=device)
        if positions.dim() == 1:
            positions = positions[None].expand(B, T)
        key_positions = positions if past is None else torch.cat((past.positions.to(device), positions), dim=1)
        if attn_mask is None:
            key_idx = torch.arange(start + T, device=device)
            query_idx = torch.arange(T, device=device) + start
            attn_mask = (key_idx[None, :] <= query_idx[:, None])[None, None].expand(B, 1, T, start + T)

        dtype = self.dtype
        # mtp.py 305-320: embedding branch, then the multi-stream hidden normalised as one vector, fc_hidden per stream
        e = self.fc_embedding(self.pre_fc_norm_embedding(next_tokens_embeds.to(dtype)))
        h = self.pre_fc_norm_hidden(hidden.to(dtype)).unflatten(-1, (hc, H))
        h = self.fc_hidden(h)
        # the layer's pending combine with prev_injection None: the block output added to every stream (hc.py 315-325)
        x = (h + e.unsqueeze(-2)).flatten(-2)

        layer: Any = self.layers[step % len(self.layers)]
        cos, sin = self.rotary_emb(x, key_positions[None].expand(3, -1, -1))
        cache = _CacheAdapter(past)
        recorded: list[Tensor] = []
        indexer = layer.self_attn.indexer

        def select(hidden_states: Tensor, embeddings: Any, attention_mask: Tensor, past_key_values: Any) -> Tensor:
            if selection is None:
                chosen = _select(indexer, hidden_states, embeddings, attention_mask, past_key_values)
            else:  # step 0's selection shared: the indexer only extends its keys
                _index_keys(indexer, hidden_states, past_key_values)
                chosen = selection.to(attention_mask.device)
            recorded.append(chosen)
            return chosen

        own = indexer.__dict__.get("forward")  # an instance's own forward, put back after
        indexer.forward = select
        try:
            x = layer(
                x,
                position_embeddings=(cos, sin),
                attention_mask=attn_mask,
                past_key_values=cache,
            )
        finally:
            if own is None:
                del indexer.forward  # the class's forward again
            else:
                indexer.forward = own
        assert cache.key is not None and cache.value is not None and cache.index_key is not None
        out = self.hyper_connection_mixer(x)
        return MtpStep(out, x, Qwen4ExpMtpCache(cache.key, cache.value, cache.index_key, key_positions), recorded[0])

    def step(self, *args: Any, **kwargs: Any) -> MtpStep:
        """The drafting loop's interface (``mtp.step.MtpForward``): ``forward``, through ``__call__``."""
        result: MtpStep = self(*args, **kwargs)
        return result
