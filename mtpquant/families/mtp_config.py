"""The MTP's config rules, torch-free: one parse of the dimensions the reference MTP forward needs.

``MtpConfig.from_text_config`` reads a Qwen3.5 ``text_config`` (or its wrapper) or a Qwen3-Next top-level
config and refuses, with one line, anything the forward in ``mtpquant.mtp.module`` cannot compute (another
activation, no output gate, a RoPE other than default, missing MoE keys); ``families.mtp_config`` adds the
refusal of a family without a reference forward. Convert's plan and validate call it before anything loads, so
every refusal happens at plan time; ``MtpLayer`` is built from the same object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtpquant.errors import ConfigError, MtpConfigError

__all__ = ["MtpConfig", "config_int"]

# Defaults of transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig / Qwen3NextConfig (5.x) for keys
# that real configs may omit; vLLM uses the same values (`getattr(config, "norm_topk_prob", True)`).
_DEFAULT_HEAD_DIM = 256
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25  # `kwargs.setdefault("partial_rotary_factor", 0.25)`
_DEFAULT_ROPE_THETA = 10_000.0  # `RotaryEmbeddingConfigMixin.default_theta`


def config_int(text: Mapping[str, Any], key: str) -> int:
    """An integer of the text config, or a one-line error naming the key."""
    value = text.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config.json: text config key {key!r} is missing or not an integer")
    return value


@dataclass(frozen=True)
class MtpConfig:
    """Dimensions of one Qwen3.5 / Qwen3-Next MTP layer (what the reference forward computes with)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    partial_rotary_factor: float
    rope_theta: float
    vocab_size: int
    intermediate_size: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise MtpConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        rot = self.rotary_dim
        if rot <= 0 or rot % 2 or rot > self.head_dim:
            raise MtpConfigError(f"rotary dim {rot} (head_dim {self.head_dim} × {self.partial_rotary_factor})")
        if self.is_moe:
            missing = [
                name
                for name in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
                if getattr(self, name) is None
            ]
            if missing:
                raise MtpConfigError(f"MoE MTP config lacks {', '.join(missing)}")
            assert self.num_experts is not None and self.num_experts_per_tok is not None
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise MtpConfigError(f"num_experts_per_tok {self.num_experts_per_tok} of {self.num_experts}")
        elif self.intermediate_size is None:
            raise MtpConfigError("dense MTP config lacks intermediate_size")

    @property
    def is_moe(self) -> bool:
        """Whether the MTP's MLP is a sparse MoE block."""
        return self.num_experts is not None

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that rotate (``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_text_config(cls, cfg: Mapping[str, Any]) -> MtpConfig:
        """Read a Qwen3.5 ``text_config`` (or its wrapper), or a Qwen3-Next top-level config."""
        return _parse(cfg)


def _parse(cfg: Mapping[str, Any]) -> MtpConfig:
    text = cfg.get("text_config")
    if isinstance(text, Mapping):
        cfg = text
    required = ["hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size"]
    is_moe = cfg.get("num_experts") is not None
    if is_moe:
        required += ["num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
    else:
        required.append("intermediate_size")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise MtpConfigError(f"config lacks {', '.join(missing)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise MtpConfigError(f"hidden_act {act!r} is not supported (Qwen MTP uses silu)")
    if cfg.get("attn_output_gate", True) is not True:
        raise MtpConfigError("attn_output_gate false is not supported (every Qwen3.5/Qwen3-Next MTP has it)")

    rope = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if rope_type != "default":
        raise MtpConfigError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
    # transformers moves top-level rope_theta / partial_rotary_factor into rope_parameters with
    # setdefault, so rope_parameters wins where both are present.
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY_FACTOR))

    def opt_int(key: str) -> int | None:
        value = cfg.get(key)
        return None if value is None else int(value)

    return MtpConfig(
        hidden_size=int(cfg["hidden_size"]),
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg.get("head_dim") or _DEFAULT_HEAD_DIM),
        rms_norm_eps=float(cfg.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
        partial_rotary_factor=float(partial),
        rope_theta=float(rope_theta),
        vocab_size=int(cfg["vocab_size"]),
        intermediate_size=opt_int("intermediate_size"),
        num_experts=opt_int("num_experts"),
        num_experts_per_tok=opt_int("num_experts_per_tok") if is_moe else None,
        moe_intermediate_size=opt_int("moe_intermediate_size") if is_moe else None,
        shared_expert_intermediate_size=opt_int("shared_expert_intermediate_size") if is_moe else None,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
    )
