"""Step-3.5 / 3.7-Flash's MTP forward: three appended layers, draft step ``i`` on layer ``N + i``, each drafting with
its own head, as vLLM 0.32's ``Step3p5MTP`` computes it; used by convert (``--mtp quantize`` calibration) and validate.

vLLM (``model_executor/models/step3p5_mtp.py``, ``v1/spec_decode/step3p5.py``):

- ``Step3p5AMultiTokenPredictor.forward`` runs layer ``N + (spec_step_idx % num_mtp_layers)``: draft step 0 (the rows
  the target accepted) on the first layer, step ``i`` on layer ``i``;
- ``Step3p5AMultiTokenPredictorLayer.forward``: ``eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))`` (``GemmaRMSNorm``,
  ``1 + w``), the decoder block (``Step3p5DecoderLayer``: sliding or full attention with the head-wise gate, dense or
  MoE by the layer's entry in the per-layer lists), no masking of position 0, and the block's output is both the next
  step's hidden and what ``compute_logits`` reads: ``shared_head.head(shared_head.norm(x))`` with the layer's **own**
  head (``shared_head.output`` on disk; ``Step3p5MTPProposer._maybe_share_lm_head`` keeps it, ``has_own_lm_head``);
- every layer has its own KV cache (``Step3p5MTPProposer``: per-group block tables and slot mappings).

The block, norms and RoPE are transformers' Step3p7 classes (``Step3p7DecoderLayer``, ``Step3p7RMSNorm``,
``Step3p7RotaryEmbedding``) composed by transformers' generic ``modeling_layers.MtpLayer`` (``NextnMtp``'s names).

**The caches** (``LayeredKVCache``): the rows a draft step 0 takes run through every layer (vLLM prefills only the
first; a later layer's cache holds the rows it drafted), so a layer's cache holds its own keys for every accepted row:
an engine whose later layers had drafted at every row would hold these. A chain step's row enters only the cache of
the layer that ran it (the others mask it), and a sliding layer sees the last ``sliding_window`` positions.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mtpquant.families.nextn import AppendedForward, step3p5_mtp_layer_types
from mtpquant.mtp.module import KVCache, check_mtp_tensors
from mtpquant.mtp.nextn import NextnMtp, _CacheAdapter
from mtpquant.mtp.step import MtpStep

__all__ = ["LayeredKVCache", "Step3p5Mtp", "step3p5_mtp_config"]

# Per-layer lists of the text config whose MTP entries trail the trunk's in the releases' padded form
_PER_LAYER = ("swiglu_limits", "swiglu_limits_shared", "rope_theta", "partial_rotary_factors")


def step3p5_mtp_config(text: Mapping[str, Any], depth: int) -> Any:
    """transformers' Step3p7 text config of the ``depth`` MTP layers (as ``Step3p7Config.get_mtp_config`` makes it:
    the layers' own attention and MLP kinds, ``num_hidden_layers`` the depth), SDPA attention, the experts' loop."""
    from transformers import Step3p7TextConfig

    from mtpquant.hfconfig import transformers_config

    n = int(text["num_hidden_layers"])
    attn, mlp = step3p5_mtp_layer_types(text, depth)
    skip = {"architectures", "transformers_version", "quantization_config", "layer_types", "mlp_layer_types",
            "mtp_layer_types", "mtp_mlp_layer_types", "moe_layers_enum", "per_layer_config", "rope_parameters",
            *_PER_LAYER}  # fmt: skip
    values = {k: v for k, v in text.items() if k not in skip}
    for key in _PER_LAYER:
        value = text.get(key)
        if isinstance(value, list) and len(value) == n + depth:
            values[key] = value[n:]
        elif value is not None and not isinstance(value, list):
            values[key] = value
    values |= {"num_hidden_layers": depth, "layer_types": attn, "mlp_layer_types": mlp, "num_nextn_predict_layers": 0}
    cfg = transformers_config(values, Step3p7TextConfig)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return cfg


@dataclass(frozen=True)
class LayeredKVCache:
    """The caches of Step's MTP layers over one sequence of rows: per layer its keys and values ``[B, kv, L, d]``, and
    which rows it computed (``valid`` ``[B, depth, L]``); the rows' positions ``[B, L]``."""

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    valid: Tensor
    positions: Tensor

    @property
    def length(self) -> int:
        """Number of cached rows."""
        return int(self.positions.shape[1])

    def layer(self, i: int) -> KVCache:
        """Layer ``i``'s keys and values."""
        return KVCache(self.keys[i], self.values[i])

    def expand(self, batch: int) -> LayeredKVCache:
        """The batch-1 cache repeated ``batch`` times (views, no copy)."""
        return LayeredKVCache(
            tuple(k.expand(batch, -1, -1, -1) for k in self.keys),
            tuple(v.expand(batch, -1, -1, -1) for v in self.values),
            self.valid.expand(batch, -1, -1),
            self.positions.expand(batch, -1),
        )

    def last(self, rows: int) -> LayeredKVCache:
        """The last ``rows`` cached rows."""
        return LayeredKVCache(
            tuple(k[:, :, -rows:] for k in self.keys),
            tuple(v[:, :, -rows:] for v in self.values),
            self.valid[:, :, -rows:],
            self.positions[:, -rows:],
        )

    def cat(self, parts: Sequence[LayeredKVCache]) -> LayeredKVCache:
        """This cache followed by the rows of ``parts`` (same batch)."""
        every = (self, *parts)
        return LayeredKVCache(
            tuple(torch.cat([p.keys[i] for p in every], dim=2) for i in range(len(self.keys))),
            tuple(torch.cat([p.values[i] for p in every], dim=2) for i in range(len(self.values))),
            torch.cat([p.valid for p in every], dim=2),
            torch.cat([p.positions for p in every], dim=1),
        )


class Step3p5Mtp(NextnMtp):
    """Step's ``depth`` appended MTP layers (``NextnMtp``'s names: ``layers.{i}.mtp_block.X`` <-> ``{root}{N+i}.X``),
    each with its own head (a buffer ``layers.{i}.own_head``, ``shared_head.output`` on disk: drafted with, never
    trained or quantized)."""

    def __init__(self, text: Mapping[str, Any], forward: AppendedForward, depth: int, root: str, first: int) -> None:
        from transformers.modeling_layers import MtpLayer as HfMtpLayer

        nn.Module.__init__(self)
        if depth < 1:
            raise ValueError(f"an MTP has at least one layer, got {depth}")
        cfg = self.mtp_config(text, depth)
        classes = importlib.import_module(f"transformers.models.{forward.module}.modeling_{forward.module}")
        decoder, norm = getattr(classes, f"{forward.prefix}DecoderLayer"), getattr(classes, f"{forward.prefix}RMSNorm")
        self.config = cfg
        self.forward_data = forward
        self.root, self.first = root, first
        self.index_share = False
        layers = []
        for i in range(depth):
            layer = HfMtpLayer(cfg, decoder, norm, i, use_post_norm=False)
            layer.post_norm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)  # shared_head.norm, applied in forward()
            if forward.own_head:
                layer.register_buffer("own_head", torch.empty(cfg.vocab_size, cfg.hidden_size), persistent=False)
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = getattr(classes, f"{forward.prefix}RotaryEmbedding")(cfg)

    @staticmethod
    def mtp_config(text: Mapping[str, Any], depth: int) -> Any:
        """transformers' config of the MTP layers (``step3p5_mtp_config``)."""
        return step3p5_mtp_config(text, depth)

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
    ) -> Step3p5Mtp:
        """Build from the checkpoint's MTP tensors: every tensor the module has, and only those, by the checkpoint's
        names and shapes (the glue of ``expected``, the registry's inventory, included; MtpLayoutError names what
        does not fit); per-expert banks fused as transformers keeps them; each layer's own head as its buffer."""
        from mtpquant.mtp.quantize import fuse_mtp_experts

        with torch.device("meta"):
            mtp = cls(text, forward, depth, root, first)
        head = "." + forward.own_head + ".weight" if forward.own_head else None
        fused = fuse_mtp_experts(tensors, int(text.get("n_routed_experts") or 0), skip=(head,) if head else ())
        want = {mtp.checkpoint_name(n): tuple(p.shape) for n, p in mtp.named_parameters()}
        want |= {mtp.checkpoint_name(n): tuple(b.shape) for n, b in mtp.named_buffers() if _persistent(mtp, n)}
        have = dict(fused)
        if head is not None:
            have |= {n: tensors[n] for n in tensors if n.endswith(head)}
            want |= {f"{root}{first + i}{head}": (mtp.config.vocab_size, mtp.config.hidden_size) for i in range(depth)}
        del expected  # the registry's glue inventory: a subset of the module's (tests/test_mtp_step3p5.py)
        check_mtp_tensors(want, have)
        state = {mtp.parameter_name(n): t.to(device=device, dtype=dtype) for n, t in fused.items()}
        mtp.load_state_dict(state, strict=True, assign=True)
        target = next(iter(state.values())).device
        for i, layer in enumerate(mtp.layers):
            if head is None:
                break
            own = tensors[f"{root}{first + i}{head}"]
            layer.own_head = own.to(device=target if own.device.type != "meta" else "meta", dtype=dtype or own.dtype)
        with torch.device(target):
            mtp.rotary_emb = type(mtp.rotary_emb)(mtp.config)
        mtp.requires_grad_(False)
        return mtp.eval()

    def forward(
        self,
        hidden: Tensor,
        next_tokens_embeds: Tensor,
        positions: Tensor | None = None,
        past: Any = None,
        attn_mask: Tensor | None = None,
        *,
        step: int = 0,
        selection: Tensor | None = None,
    ) -> MtpStep:
        """Draft step ``step`` over T new rows: layer ``step % depth``; at step 0 every layer takes the rows into its
        cache (``LayeredKVCache``). ``out`` after ``shared_head.norm``, ``head`` the layer's own, ``next_hidden`` the
        block's output (the tensor ``Step3p5AMultiTokenPredictorLayer.forward`` returns). ``selection`` unused (no
        indexer)."""
        del selection
        if past is not None and not isinstance(past, LayeredKVCache):
            raise TypeError(f"Step's MTP layers extend a LayeredKVCache, got {type(past).__name__}")
        if hidden.dim() != 3 or hidden.shape != next_tokens_embeds.shape:
            raise ValueError(
                f"hidden {tuple(hidden.shape)} and next_tokens_embeds {tuple(next_tokens_embeds.shape)} must both be "
                "[B, T, H]"
            )
        B, T, _ = hidden.shape
        device = hidden.device
        depth = len(self.layers)
        start = 0 if past is None else past.length
        if positions is None:
            positions = torch.arange(start, start + T, device=device)
        if positions.dim() == 1:
            positions = positions[None].expand(B, T)
        if attn_mask is None:
            key_idx = torch.arange(start + T, device=device)
            query_idx = torch.arange(T, device=device) + start
            attn_mask = (key_idx[None, :] <= query_idx[:, None])[None, None].expand(B, 1, T, start + T)
        key_pos = positions if past is None else torch.cat((past.positions.to(device), positions), dim=1)
        dtype = self.dtype
        embeds, hid = next_tokens_embeds.to(dtype), hidden.to(dtype)
        current = step % depth
        run = range(depth) if step == 0 else (current,)
        keys, values = [], []
        valid = []
        result: tuple[Tensor, Tensor] | None = None
        for i in range(depth):
            if i not in run:  # a row this layer did not compute: masked for it
                shape = (B, self.config.num_key_value_heads, T, self.config.head_dim)
                keys.append(torch.zeros(shape, dtype=dtype, device=device))
                values.append(torch.zeros(shape, dtype=dtype, device=device))
                valid.append(torch.zeros(B, T, dtype=torch.bool, device=device))
                continue
            layer: Any = self.layers[i]
            kind = self.config.layer_types[i]
            mask = attn_mask
            if past is not None:
                mine = torch.cat((past.valid[:, i].to(device), torch.ones(B, T, dtype=torch.bool, device=device)), 1)
                mask = mask & mine[:, None, None, :]
            window = self.config.sliding_window
            if kind == "sliding_attention" and window:
                mask = mask & (key_pos[:, None, None, :] > positions[:, None, :, None] - window)
            if self.config._attn_implementation == "eager":  # an additive mask (MiMo's sinks need eager attention)
                mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
            cache = _CacheAdapter(past.layer(i) if past is not None else None)
            x = layer(
                embeds,
                hid,
                position_embeddings=self.rotary_emb(embeds, positions, kind),
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
            )
            new = cache.cache()
            keys.append(new.key[:, :, -T:])
            values.append(new.value[:, :, -T:])
            valid.append(torch.ones(B, T, dtype=torch.bool, device=device))
            if i == current:
                result = (x, layer.post_norm(x))
        assert result is not None
        rows = LayeredKVCache(tuple(keys), tuple(values), torch.stack(valid, dim=1), positions)
        cache_out = rows if past is None else past.cat([rows])
        x, out = result
        head: Tensor | None = getattr(self.layers[current], "own_head", None)
        return MtpStep(out, out if self.forward_data.recycle_normed else x, cache_out, None, head)


def _persistent(module: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    return leaf not in sub._non_persistent_buffers_set
