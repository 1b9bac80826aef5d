"""The family registry: everything mtpquant knows about each supported Qwen architecture.

Architecture knowledge lives here and nowhere else: recognition from ``config.json`` (day-0 aliases
included), tensor prefixes, how the MTP is declared, its exact tensor inventory and shapes, which MTP modules
engines build as quantizable Linears, fused and packed groups, the modules NVFP4 must leave unquantized, the
engine's MTP layer-index remap, the MTP's precision groups, and the torch-free MTP config parse. Other modules ask
the registry instead of testing ``model_type`` or naming MTP tensors themselves.

- ``schema``: the dataclasses one family fills in (``Family``, ``MtpLayout``, ``EngineRules``);
- ``qwen3``, ``qwen4_exp``: the entries (Qwen3.5 dense / MoE and Qwen3-Next; Qwen3.8-Flash-Next);
- ``spec``: a family resolved against one config (``ModelSpec``, ``resolve``, tensor classes);
- ``mtp_config``: the reference MTP forward's dimensions, every refusal at plan time.
"""

from __future__ import annotations

from mtpquant.families.mtp_config import MtpConfig, config_int
from mtpquant.families.schema import (
    MTP_PREFIX,
    NEVER_SHIPPED,
    NOT_MTP,
    RECOGNISED,
    SEPARATE,
    SUPPORTED,
    UNKNOWN,
    EngineRules,
    Family,
    ForcedUnquantized,
    MtpGroup,
    MtpLayout,
    is_mtp_name,
    matches,
    mtp_layer_count,
)
from mtpquant.families.spec import (
    FAMILIES,
    QWEN_MTP_NAMES,
    VISION_PREFIX,
    ModelSpec,
    MtpDeclaration,
    TensorClass,
    check_mtp_forward,
    classify_tensor,
    dimension_differences,
    group_by_class,
    mtp_config,
    nested_key,
    resolve,
    supported_architectures,
    surgery_refusal,
    tensor_classifier,
)
from mtpquant.families.storage import APPENDED, NAMESPACE, SUBSPACE, MtpNames, MtpStorage

__all__ = [
    "APPENDED",
    "FAMILIES",
    "FUSED_EXPERT_PIECES",
    "MTP_PREFIX",
    "NAMESPACE",
    "NEVER_SHIPPED",
    "NOT_MTP",
    "QWEN_MTP_NAMES",
    "RECOGNISED",
    "SEPARATE",
    "SUBSPACE",
    "SUPPORTED",
    "UNKNOWN",
    "VISION_PREFIX",
    "EngineRules",
    "Family",
    "ForcedUnquantized",
    "ModelSpec",
    "MtpConfig",
    "MtpDeclaration",
    "MtpGroup",
    "MtpLayout",
    "MtpNames",
    "MtpStorage",
    "TensorClass",
    "check_mtp_forward",
    "classify_tensor",
    "config_int",
    "dimension_differences",
    "family",
    "group_by_class",
    "is_mtp_name",
    "matches",
    "mtp_config",
    "mtp_layer_count",
    "nested_key",
    "resolve",
    "supported_architectures",
    "surgery_refusal",
    "tensor_classifier",
]

# transformers' fused experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]): per expert, the
# per-expert Linears it concatenates along the rows, in this order (the gate first), experts stacked in order.
FUSED_EXPERT_PIECES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def family(key: str) -> Family:
    """The registry entry called ``key`` (e.g. ``"qwen4_exp"``)."""
    for f in FAMILIES:
        if f.key == key:
            return f
    raise KeyError(key)
