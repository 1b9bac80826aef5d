"""Reference forward of Qwen's built-in MTP layer, as vLLM and SGLang compute it.

One module serves calibration (modelopt wraps its ``nn.Linear`` children; hooks read their inputs)
and validation (teacher-forced logits, chained drafting: ``mtpquant.mtp.drafting``). Parameter names,
prefixed with ``mtp.``, are exactly the checkpoint tensor names, so a checkpoint's ``mtp.*`` tensors load
without renaming.

The building blocks are written out here rather than imported from
``transformers.models.qwen3_5.modeling_qwen3_5``: this floor must import without transformers
(``inspect`` and ``graft`` stay light). ``tests/test_mtp_module.py`` checks each block against
transformers' ``Qwen3_5RMSNorm``, ``apply_rotary_pos_emb``, ``Qwen3_5Attention`` and
``Qwen3_5MoeSparseMoeBlock``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtpquant.families import MTP_PREFIX, MtpConfig
from mtpquant.families.qwen3 import qwen3_mtp_shapes
from mtpquant.mtp.step import MtpStep

__all__ = [
    "KVCache",
    "MtpConfig",
    "MtpLayer",
    "MtpLayoutError",
    "mtp_tensor_shapes",
]


class MtpLayoutError(ValueError):
    """The ``mtp.*`` tensors do not match the layout the config implies."""


def mtp_tensor_shapes(cfg: MtpConfig) -> dict[str, tuple[int, ...]]:
    """Every ``mtp.*`` checkpoint tensor name with its shape (15 dense, 17 + 3E MoE): the registry's inventory."""
    text: dict[str, Any] = {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }
    return qwen3_mtp_shapes(text, 1, moe=cfg.is_moe)


def check_mtp_tensors(expected: Mapping[str, tuple[int, ...]], tensors: Mapping[str, Tensor]) -> None:
    """The ``mtp.*`` tensors must be exactly ``expected`` (names and shapes); MtpLayoutError names each missing,
    unexpected or misshapen tensor."""
    problems: list[str] = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshapen = sorted(
        f"{name} {tuple(tensors[name].shape)} (expected {expected[name]})"
        for name in set(expected) & set(tensors)
        if tuple(tensors[name].shape) != expected[name]
    )
    for label, names in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)):
        if names:
            shown = ", ".join(names[:8]) + (f", … ({len(names) - 8} more)" if len(names) > 8 else "")
            problems.append(f"{len(names)} {label}: {shown}")
    if problems:
        raise MtpLayoutError("MTP tensors do not match the config: " + "; ".join(problems))


class ZeroCentredRMSNorm(nn.Module):
    """``y = x / rms(x) * (1 + w)`` in float32, cast back to x's dtype (transformers' Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        # Zero means identity: the checkpoint stores w, not 1 + w.
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dim."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


@dataclass(frozen=True)
class KVCache:
    """The MTP layer's own cache: post-norm, post-RoPE keys and values, ``[B, kv_heads, S, head_dim]``."""

    key: Tensor
    value: Tensor

    @property
    def length(self) -> int:
        """Number of cached positions."""
        return int(self.key.shape[2])

    def expand(self, batch: int) -> KVCache:
        """The batch-1 cache repeated ``batch`` times (views, no copy)."""
        return KVCache(self.key.expand(batch, -1, -1, -1), self.value.expand(batch, -1, -1, -1))

    def last(self, rows: int) -> KVCache:
        """The last ``rows`` cached positions."""
        return KVCache(self.key[:, :, -rows:], self.value[:, :, -rows:])

    def cat(self, parts: Sequence[KVCache]) -> KVCache:
        """This cache followed by the positions of ``parts`` (same batch)."""
        keys = torch.cat([self.key, *(p.key for p in parts)], dim=2)
        return KVCache(keys, torch.cat([self.value, *(p.value for p in parts)], dim=2))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin ``[B, T, rotary_dim]`` of plain (rotate_half) RoPE, computed in float32.

    Qwen3.5's interleaved M-RoPE gives every section the same position for text-only input, so it
    reduces to this (transformers ``Qwen3_5TextRotaryEmbedding`` with 3 equal position rows).
    """
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of x ``[B, heads, T, head_dim]``; pass the rest."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


class MtpAttention(nn.Module):
    """Qwen3.5 gated full attention (``Qwen3_5Attention``) with an explicit, immutable KV cache."""

    def __init__(self, cfg: MtpConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.rope_theta = cfg.rope_theta
        H, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, 2 * self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, H, bias=False)
        self.q_norm = ZeroCentredRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, positions: Tensor, past_kv: KVCache | None, attn_mask: Tensor | None = None
    ) -> tuple[Tensor, KVCache]:
        """x ``[B, T, H]``, positions ``[B, T]``; attends causally over ``past_kv`` then x, or where the bool
        ``attn_mask`` ``[B, 1, T, past + T]`` allows (rows of one batch drafting from different prefixes)."""
        B, T, _ = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # q_proj rows hold, per head, head_dim query rows then head_dim gate rows.
        query, gate = self.q_proj(x).view(B, T, nh, 2 * hd).chunk(2, dim=-1)
        gate = gate.reshape(B, T, nh * hd)
        q = self.q_norm(query).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, nkv, hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
        cos, sin = _rope_cos_sin(positions, self.rotary_dim, self.rope_theta, q.dtype)
        q = _apply_partial_rope(q, cos, sin)
        k = _apply_partial_rope(k, cos, sin)

        past = 0
        if past_kv is not None:
            past = past_kv.length
            k = torch.cat((past_kv.key, k), dim=2)
            v = torch.cat((past_kv.value, v), dim=2)
        mask = attn_mask
        if mask is None and past:
            # Row i (cache index past + i) sees every cached entry and the new rows up to itself.
            key_idx = torch.arange(past + T, device=x.device)
            query_idx = torch.arange(T, device=x.device) + past
            mask = key_idx[None, :] <= query_idx[:, None]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and T > 1,
            scale=hd**-0.5,
            enable_gqa=nh != nkv,
        )
        out = out.transpose(1, 2).reshape(B, T, nh * hd)
        return self.o_proj(out * torch.sigmoid(gate)), KVCache(k, v)


class MtpMLP(nn.Module):
    """SiLU-gated MLP: ``down(silu(gate(x)) * up(x))``; also one expert and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MtpSparseMoe(nn.Module):
    """Softmax top-k router over per-expert MLPs plus a sigmoid-gated shared expert.

    Mirrors transformers ``Qwen3NextSparseMoeBlock`` / ``Qwen3_5MoeSparseMoeBlock`` and vLLM's
    ``FusedMoE(renormalize=norm_topk_prob)``; experts are separate modules here because the MTP
    checkpoint stores them per expert.
    """

    def __init__(self, cfg: MtpConfig) -> None:
        super().__init__()
        assert cfg.num_experts is not None and cfg.num_experts_per_tok is not None
        assert cfg.moe_intermediate_size is not None and cfg.shared_expert_intermediate_size is not None
        H = cfg.hidden_size
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(H, cfg.num_experts, bias=False)
        # modelopt (`_QuantSparseSequentialMoe`, transformers>=5 path) recognises an MoE block by
        # gate.top_k + gate.num_experts and, with `moe_calib_experts_ratio`, raises gate.top_k during
        # calibration so every expert sees tokens; so top_k lives on the gate and forward reads it.
        router: Any = self.gate
        router.top_k = cfg.num_experts_per_tok
        router.num_experts = cfg.num_experts
        self.experts = nn.ModuleList(MtpMLP(H, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = MtpMLP(H, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x ``[..., H]`` → ``[..., H]``."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        top_k: int = cast(Any, self.gate).top_k
        weights, chosen = torch.topk(probs, top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(flat.dtype)
        routed = torch.zeros_like(flat)
        for e in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == e)
            out = self.experts[e](flat[token]) * weights[token, slot, None]
            routed.index_add_(0, token, out.to(routed.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(shape)


class MtpDecoderLayer(nn.Module):
    """One full-attention decoder layer: norm → gated attention → add → norm → MLP/MoE → add."""

    def __init__(self, cfg: MtpConfig) -> None:
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MtpAttention(cfg)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if cfg.is_moe:
            self.mlp = MtpSparseMoe(cfg)
        else:
            assert cfg.intermediate_size is not None
            self.mlp = MtpMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, x: Tensor, positions: Tensor, past_kv: KVCache | None, attn_mask: Tensor | None = None
    ) -> tuple[Tensor, KVCache]:
        """Apply the layer; returns the new hidden and the extended cache."""
        attn, cache = self.self_attn(self.input_layernorm(x), positions, past_kv, attn_mask)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


class MtpLayer(nn.Module):
    """Qwen's MTP layer; ``"mtp." + name`` of every parameter is its checkpoint tensor name."""

    def __init__(self, cfg: MtpConfig) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([MtpDecoderLayer(cfg)])
        self.norm = ZeroCentredRMSNorm(H, cfg.rms_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the projections (that of ``fc.weight``)."""
        return self.fc.weight.dtype

    @classmethod
    def from_state_dict(
        cls,
        cfg: MtpConfig,
        tensors: Mapping[str, Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> MtpLayer:
        """Build from the checkpoint's ``mtp.*`` tensors after checking names and shapes exactly.

        The tensors are adopted, not copied, unless ``dtype``/``device`` asks for a conversion.
        Raises MtpLayoutError naming each missing, unexpected or misshapen tensor.
        """
        check_mtp_tensors(mtp_tensor_shapes(cfg), tensors)
        with torch.device("meta"):
            layer = cls(cfg)
        state = {name[len(MTP_PREFIX) :]: t.to(device=device, dtype=dtype) for name, t in tensors.items()}
        layer.load_state_dict(state, strict=True, assign=True)
        layer.requires_grad_(False)
        return layer.eval()

    def forward(
        self,
        hidden: Tensor,
        next_tokens_embeds: Tensor,
        positions: Tensor | None = None,
        past_kv: KVCache | None = None,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, KVCache]:
        """One causal pass over T new rows.

        Args:
            hidden: the target's hidden state after its final norm, ``h_t``, ``[B, T, H]``.
            next_tokens_embeds: ``embed_tokens(x_{t+1})``, ``[B, T, H]``.
            positions: ``[B, T]`` or ``[T]``; defaults to ``past_kv.length + arange(T)``.
            past_kv: this layer's cache of earlier rows (never modified).
            attn_mask: bool ``[B, 1, T, past + T]`` replacing the causal mask (None: causal).

        Returns:
            ``(m, cache)``: ``m`` after ``mtp.norm`` ``[B, T, H]`` (logits = target ``lm_head(m)``
            predict ``x_{t+2}``) and the cache extended by the T rows.
        """
        if hidden.shape != next_tokens_embeds.shape or hidden.dim() != 3:
            raise ValueError(
                f"hidden {tuple(hidden.shape)} and next_tokens_embeds "
                f"{tuple(next_tokens_embeds.shape)} must both be [B, T, H]"
            )
        B, T, _ = hidden.shape
        start = 0 if past_kv is None else past_kv.length
        if positions is None:
            positions = torch.arange(start, start + T, device=hidden.device)
        if positions.dim() == 1:
            positions = positions[None].expand(B, T)
        dtype = self.dtype
        # Embedding first, hidden second (vLLM Qwen3_5MultiTokenPredictor.forward).
        e = self.pre_fc_norm_embedding(next_tokens_embeds).to(dtype)
        h = self.pre_fc_norm_hidden(hidden).to(dtype)
        z = self.fc(torch.cat((e, h), dim=-1))
        z, cache = self.layers[0](z, positions, past_kv, attn_mask)
        return self.norm(z), cache

    # The drafting loop's interface (``mtp.step.MtpForward``): one layer, its output read by the head and by the
    # next draft step alike, no token selection to share.
    index_share = False

    def step(
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
        """``forward`` as an ``MtpStep`` (``step`` and ``selection`` do not apply: one layer, no indexer)."""
        del step, selection
        out, cache = self(hidden, next_tokens_embeds, positions, past, attn_mask)
        return MtpStep(out, out, cache)
