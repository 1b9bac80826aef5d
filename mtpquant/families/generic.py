"""Release day: an architecture the registry does not know, whose config declares an MTP, still gets inspect's checks.

A new family ships before mtpquant knows it. Its config says an MTP is there (``num_nextn_predict_layers``,
``num_mtp_layers``, ``mtp_num_hidden_layers``, ``num_mtp_modules``, Inkling's ``mtp_config``, or some other ``mtp_*``
key); its tensors say where: decoder layers appended to the trunk at ``{prefix}layers.{num_hidden_layers + i}``
(DeepSeek's form, which most families copy), the ``mtp.`` namespace (Qwen's), or ``model.mtp.`` (MiMo-V2's,
LongCat's). The family built here holds only that: inspect checks presence against the declaration, the depth, the
precision and the engines' exclusions under that storage, and says in one line that the family is unknown; every
surgery (graft, extract, ``--fix-metadata``) refuses, convert / validate / heal refuse as for any family without a
reference forward. An architecture whose config declares no MTP stays unsupported (exit 4).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mtpquant.families.schema import UNKNOWN, EngineRules, Family, MtpLayout
from mtpquant.families.storage import APPENDED, NAMESPACE, SUBSPACE, MtpStorage

__all__ = ["GENERIC_DEPTH_KEYS", "declares_mtp", "generic_family"]

# The depth keys of the families vLLM 0.32 serves, in the order the generic family reads them (the first present wins)
GENERIC_DEPTH_KEYS = (
    "num_nextn_predict_layers",
    "num_mtp_layers",
    "mtp_num_hidden_layers",
    "num_mtp_modules",
    "mtp_config.num_nextn_predict_layers",
)
# Where an unknown family's MTP may be, by the first name that shows it: (storage, what the report calls it)
_NAMESPACE = MtpStorage(NAMESPACE)
_SUBSPACE = MtpStorage(SUBSPACE, root="model.mtp.")
_APPENDED = MtpStorage(APPENDED)
# Trunk prefixes of the appended form, as vLLM's get_spec_layer_idx_from_weight_name takes them (utils.py), plus
# the multimodal language_model.model. (Kimi-K3, MiniMax-M3)
_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")


def _mtp_keys(scope: Mapping[str, Any]) -> list[str]:
    """The keys of ``scope`` that speak of an MTP: a depth key, or any ``mtp_*`` / ``use_mtp`` key set truthy."""
    return [k for k, v in scope.items() if (k.startswith("mtp_") or k == "use_mtp") and v not in (None, False, 0, "")]


def declares_mtp(config: Mapping[str, Any]) -> bool:
    """Whether a config the registry does not know declares an MTP (a depth key above 0, or another ``mtp_*`` key)."""
    text = config.get("text_config")
    scopes = [config, *([text] if isinstance(text, Mapping) else [])]
    for scope in scopes:
        for key in GENERIC_DEPTH_KEYS:
            value: Any = scope
            for part in key.split("."):
                value = value.get(part) if isinstance(value, Mapping) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return True
        if _mtp_keys(scope):
            return True
    return False


def _no_inventory(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """An unknown family's MTP has no inventory: presence and depth only."""
    del text, layers, per_expert
    return {}


def _storage(names: Iterable[str] | None) -> MtpStorage:
    """The storage the tensor names show: ``mtp.`` or ``model.mtp.`` where a name starts so, else appended."""
    for name in names or ():
        if name.startswith("mtp."):
            return _NAMESPACE
        if name.startswith("model.mtp."):
            return _SUBSPACE
    return _APPENDED


def generic_family(config: Mapping[str, Any], names: Iterable[str] | None = None) -> Family:
    """The family of an unknown MTP-bearing architecture, its storage from ``names`` (a table's tensor names; None:
    the appended form, the likeliest)."""
    architectures = config.get("architectures") or []
    arch = str(architectures[0]) if architectures else f"model_type {config.get('model_type')!r}"
    storage = _storage(names)
    where = (
        "decoder layers appended at layers.{num_hidden_layers + i}"
        if storage.kind == APPENDED
        else f"the {storage.root} namespace"
    )
    mtp = MtpLayout(
        depth_keys=GENERIC_DEPTH_KEYS,
        default_layers=0,
        setting_keys=(),
        shapes=_no_inventory,
        per_expert=True,
        either_expert_form=False,
        engine_linears=("*_proj", "*.experts", "*.fc"),
        unquantized=("*.eh_proj", "*norm*", "*.gate"),
        fused_groups=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
        storage=storage,
        inventory="none",
    )
    return Family(
        key="unknown",
        display="unknown family",
        model_types=frozenset({str(config.get("model_type"))}),
        architectures=frozenset(map(str, architectures)),
        moe=False,
        wrapper_prefix="model.",
        text_only_prefixes=_PREFIXES,
        has_vision=False,
        mtp=mtp,
        engine=EngineRules(
            packed={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
            built_unquantized=("*.mlp.gate",),
            sglang_plain=(),
        ),
        wrapper_class=None,
        text_class=arch,
        fused_groups=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("gate_proj", "up_proj")),
        unquantized=("lm_head", "*embed_tokens", "*.mlp.gate", "*norm*"),
        fused_main_experts=False,
        mtp_forward=False,
        mtp_heal=False,
        convert=False,
        status=UNKNOWN,
        status_note=(
            f"{arch} is not in mtpquant's registry (mtpquant families lists it): its MTP is checked generically, as "
            f"{where} (presence, depth, precision and exclusions; not its tensor inventory)"
        ),
    )
