"""Registry entries for the other MTP drafters vLLM 0.32 serves: recognition, storage and glue, read from each loader.

Every entry states where the family's published checkpoints keep the MTP (an appended decoder layer, the ``mtp.``
namespace, a sub-namespace of ``model.``, or a separate drafter model), the config key that declares its depth, the
head / embedding copies a layer may carry, how vLLM's drafter renames what it loads, and the MTP's glue (the tensors
outside its decoder block, which mtpquant checks by name and shape; the block follows per-layer config mtpquant does
not model, so the inventory is "glue"). That is what inspect, graft, ``graft --fix-metadata`` and extract need; convert,
validate and heal need a reference MTP forward these families do not have yet (``mtpquant families`` says which
works). Each entry cites the vLLM 0.32 file whose ``load_weights`` (and ``get_spec_layer_idx_from_weight_name`` /
``_rewrite_spec_layer_name`` or ``WeightsMapper``) it is read from, and ``config/speculative.py``'s
``hf_config_override`` for the depth key and the drafter class.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from mtpquant.families.mtp_config import config_int
from mtpquant.families.nextn import layer_rename
from mtpquant.families.schema import SEPARATE, EngineRules, Family, MtpLayout, Shapes
from mtpquant.families.storage import APPENDED, NAMESPACE, SUBSPACE, MtpStorage

__all__ = ["RELEASED_FAMILIES", "glue_shapes"]

NORM, PROJ, SQUARE = "norm", "proj", "square"  # a glue tensor's kind: [H], [H, 2H], [H, H]


def glue_shapes(*glue: tuple[str, str]) -> Shapes:
    """The glue inventory of ``glue`` ((name template, kind) pairs): per MTP depth ``i`` each template with ``{i}``
    (the depth) or ``{n}`` (``num_hidden_layers + i``, an appended layer's index) filled in; a template with neither
    appears once (a namespace's own glue: LongCat's ``model.mtp.norm``). Kinds: ``norm`` [H], ``proj`` [H, 2H],
    ``square`` [H, H]."""

    def shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
        del per_expert
        H = config_int(text, "hidden_size")
        n = config_int(text, "num_hidden_layers") if any("{n}" in t for t, _ in glue) else 0
        dims = {NORM: (H,), PROJ: (H, 2 * H), SQUARE: (H, H)}
        out: dict[str, tuple[int, ...]] = {}
        for i in range(layers):
            out |= {t.format(i=i, n=n + i): dims[kind] for t, kind in glue}
        return out

    return shapes


# DeepSeek-style glue of an appended layer (``model.layers.{n}.``; ModelSpec moves it under the checkpoint's prefix)
_NEXTN_GLUE = (("model.layers.{n}.enorm.weight", NORM), ("model.layers.{n}.hnorm.weight", NORM),
               ("model.layers.{n}.eh_proj.weight", PROJ))
_SHARED_NORM = (("model.layers.{n}.shared_head.norm.weight", NORM),)
_HEAD_COPIES = ("shared_head.head.weight", "embed_tokens.weight")
# Qwen-style glue of the mtp. namespace (EXAONE): mtp.fc over [embed, hidden], its two input norms, the final norm
_FC_GLUE = (("mtp.fc.weight", PROJ), ("mtp.pre_fc_norm_embedding.weight", NORM),
            ("mtp.pre_fc_norm_hidden.weight", NORM), ("mtp.norm.weight", NORM))
_MODEL_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_TEXT_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")
_KIMI_LAYER = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")
_COMPLETENESS = "ValueError: MTP speculative decoding layer {layer} weights missing from checkpoint"


def _subspace_rename(root: str, shift: int = 1) -> Any:
    """vLLM builds depth ``i`` of a sub-namespace as ``model.layers.{shift * num_hidden_layers + i}`` (HY-V4's
    ``model.mtp_layers.{i}``: mtp.py ``_remap_mtp_quant_exclusions``; LongCat's ``model.mtp.layers.{i}``: its MTP
    index is twice the trunk's, longcat_flash_mtp.py)."""
    pattern = re.compile("^" + re.escape(root) + r"(\d+)\.")

    def rename(name: str, num_hidden_layers: int) -> str:
        m = pattern.match(name)
        return name if m is None else f"model.layers.{shift * num_hidden_layers + int(m.group(1))}.{name[m.end() :]}"

    return rename


def _family(key: str, display: str, model_types: set[str], archs: set[str], storage: MtpStorage, **kw: Any) -> Family:
    """One entry: the MTP doctor's facts (status supported unless said), no convert / validate / heal."""
    glue = kw.pop("glue", ())
    mtp = MtpLayout(
        depth_keys=kw.pop("depth_keys", ("num_nextn_predict_layers",)),
        default_layers=kw.pop("default_layers", 0),
        setting_keys=kw.pop("setting_keys", ()),
        shapes=glue_shapes(*glue),
        per_expert=True,
        either_expert_form=False,
        engine_linears=("*_proj", "*.experts", "*.fc"),
        unquantized=("*.eh_proj", "*norm*", "*.gate"),
        fused_groups=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
        storage=storage,
        copies=kw.pop("copies", ()),
        depth_at_top=kw.pop("depth_at_top", False),
        engine_rename=kw.pop("engine_rename", None),
        inventory="glue" if glue else "none",
    )
    engine = EngineRules(
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
        built_unquantized=("*.mlp.gate", *kw.pop("plain", ())),
        sglang_plain=(),
        drafters={"vllm": kw.pop("vllm"), "sglang": kw.pop("sglang", "")},
        missing_mtp_error=kw.pop("missing_mtp_error", ""),
    )
    wrapper = kw.pop("wrapper_prefix", "model.")
    return Family(
        key=key,
        display=display,
        model_types=frozenset(model_types),
        architectures=frozenset(archs),
        moe=kw.pop("moe", False),
        wrapper_prefix=wrapper,
        text_only_prefixes=kw.pop("text_only_prefixes", (wrapper,)),
        has_vision=False,
        mtp=mtp,
        engine=engine,
        wrapper_class=None,
        text_class=kw.pop("text_class", sorted(archs)[0]),
        fused_groups=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("gate_proj", "up_proj")),
        unquantized=("lm_head", "*embed_tokens", "*.mlp.gate", "*norm*"),
        fused_main_experts=False,
        mtp_forward=False,
        mtp_heal=False,
        convert=False,
        **kw,
    )


_APPENDED = MtpStorage(APPENDED)

# ---- an appended decoder layer, model.layers.{num_hidden_layers + i} ------------------------------------------------
BAILING_V25 = _family(
    "bailing_moe_v25", "Ling / Ring 2.5 (Bailing MoE V2.5)", {"bailing_hybrid"}, {"BailingMoeV2_5ForCausalLM"},
    _APPENDED, glue=(*_NEXTN_GLUE, ("model.layers.{n}.final_layernorm.weight", NORM)),
    plain=("*.eh_proj",),  # nn.Linear (bailing_moe_mtp.py 80)
    vllm="BailingMoeV25MTPModel", sglang="BailingMoeForCausalLMNextN", missing_mtp_error=_COMPLETENESS, moe=True,
    vllm_remap=".attention.dense -> .self_attn.o_proj, .attention. -> .self_attn., mlp.gate.e_score_correction_bias "
    "-> expert_bias; model.word_embeddings -> embed_tokens; lm_head -> each layer's shared_head.head",
    sources=("model_executor/models/bailing_moe_mtp.py",),
)
BAILING_V3 = _family(
    "bailing_moe_v3", "Ling 3.0 (Bailing MoE V3)", {"bailing_moe_v3_vl"},
    {"BailingMoeV3ForCausalLM", "BailingMoeV3VLForConditionalGeneration"},
    _APPENDED, glue=(*_NEXTN_GLUE, ("model.layers.{n}.final_layernorm.weight", NORM)),
    vllm="BailingMoeV3MTPModel", missing_mtp_error="ValueError: MTP layer weights are missing from checkpoint",
    moe=True, text_class="BailingMoeV3ForCausalLM",
    vllm_remap="mlp.gate.e_score_correction_bias -> expert_bias; model.word_embeddings -> embed_tokens; lm_head -> "
    "each layer's shared_head.head; eh_proj a ReplicatedLinear with the target's quantization",
    sources=("model_executor/models/bailing_moe_v3_mtp.py",),
)
DOTS3_NOTE = _family(
    "dots3_note", "dots.llm3 Note", {"dots3_note"}, {"Dots3NoteForCausalLM"},
    _APPENDED, glue=(*_NEXTN_GLUE, *_SHARED_NORM), setting_keys=("mtp_layer_types",),
    plain=("*.eh_proj",), vllm="Dots3NoteMTPModel", missing_mtp_error=_COMPLETENESS, moe=True,
    vllm_remap="DeepSeek-V3.2's predictor; the shared model.mtp.embed_tokens -> model.layers.{N}.embed_tokens "
    "(outside the layer on disk: not carried by graft / extract)",
    sources=("models/dots3_note/nvidia/mtp.py", "config/speculative.py"),
)
GLM4_MOE_LITE = _family(
    "glm4_moe_lite", "GLM-4.7-Flash (GLM-4 MoE Lite)", {"glm4_moe_lite"}, {"Glm4MoeLiteForCausalLM"},
    _APPENDED, glue=(*_NEXTN_GLUE, *_SHARED_NORM), copies=_HEAD_COPIES,
    engine_rename=layer_rename(_MODEL_LAYER, block_infix="mtp_block."),
    plain=("*.eh_proj",), vllm="Glm4MoeLiteMTPModel", sglang="Glm4MoeLiteForCausalLMNextN", moe=True,
    vllm_remap="block -> model.layers.{N}.mtp_block.*; embed_tokens -> model.embed_tokens (_rewrite_spec_layer_name)",
    sources=("model_executor/models/glm4_moe_lite_mtp.py",),
)
GLM_OCR = _family(
    "glm_ocr", "GLM-OCR", {"glm_ocr"}, {"GlmOcrForConditionalGeneration"},
    _APPENDED, glue=(*_NEXTN_GLUE, *_SHARED_NORM), copies=_HEAD_COPIES,
    wrapper_prefix="model.language_model.", text_only_prefixes=("model.language_model.", "model."),
    engine_rename=layer_rename(_TEXT_LAYER, block_infix="mtp_block."),
    plain=("*.eh_proj",), vllm="GlmOcrMTPModel",
    vllm_remap="model.language_model.layers -> model.layers; block -> model.layers.{N}.mtp_block.*",
    sources=("model_executor/models/glm_ocr_mtp.py",),
)
HY_V3 = _family(
    "hy_v3", "Hunyuan HY-V3", {"hy_v3"}, {"HYV3ForCausalLM"},
    _APPENDED, glue=(*_NEXTN_GLUE, ("model.layers.{n}.final_layernorm.weight", NORM)),
    engine_rename=layer_rename(_MODEL_LAYER, block_infix="mtp_block."),
    plain=("*.eh_proj",), vllm="HYV3MTPModel", moe=True,
    vllm_remap="block -> model.layers.{N}.mtp_block.*; the layer's embed_tokens and shared_head are skipped (the "
    "target's embedding and lm_head are used)",
    sources=("model_executor/models/hy_v3_mtp.py",),
)
KIMI_K3 = _family(
    "kimi_k3", "Kimi-K3", {"kimi_k3"}, {"KimiK3ForConditionalGeneration", "KimiK3ForCausalLM"},
    _APPENDED, glue=(*_NEXTN_GLUE, *_SHARED_NORM), copies=_HEAD_COPIES,
    wrapper_prefix="language_model.model.", text_only_prefixes=("language_model.model.", "model."),
    engine_rename=layer_rename(_KIMI_LAYER, block_infix="mtp_block."),
    plain=("*.eh_proj",),  # ReplicatedLinear(quant_config=None)
    vllm="KimiK3MTPModel", missing_mtp_error=_COMPLETENESS, moe=True, text_class="KimiK3ForConditionalGeneration",
    vllm_remap="language_model. stripped; block -> model.layers.{N}.mtp_block.*; embed_tokens -> model.embed_tokens",
    sources=("models/kimi_k3/nvidia/mtp.py", "config/speculative.py"),
)
OPENPANGU = _family(
    "pangu_ultra_moe", "openPangu Ultra MoE", {"pangu_ultra_moe"}, {"PanguUltraMoEForCausalLM"},
    _APPENDED, glue=(*_NEXTN_GLUE, *_SHARED_NORM), copies=_HEAD_COPIES,
    engine_rename=layer_rename(_MODEL_LAYER, block_infix="mtp_block."),
    plain=("*.eh_proj",), vllm="OpenPanguMTPModel", moe=True,
    vllm_remap="block -> model.layers.{N}.mtp_block.*; embed_tokens -> model.embed_tokens",
    sources=("model_executor/models/openpangu_mtp.py",),
)

# ---- the mtp. namespace --------------------------------------------------------------------------------------------
EXAONE_MOE = _family(
    "exaone_moe", "EXAONE MoE", {"exaone_moe"}, {"ExaoneMoeForCausalLM", "ExaoneMoEForCausalLM"},
    MtpStorage(NAMESPACE), glue=_FC_GLUE, vllm="ExaoneMoeMTP", moe=True, text_class="ExaoneMoeForCausalLM",
    vllm_remap="mtp. -> model. (the drafter's module is model, its quantization prefix mtp); embed_tokens and "
    "lm_head shared with the target",
    sources=("model_executor/models/exaone_moe_mtp.py",),
)
EXAONE_4_5 = _family(
    "exaone4_5", "EXAONE 4.5", {"exaone4_5"}, {"Exaone4_5_ForConditionalGeneration"},
    MtpStorage(NAMESPACE), glue=_FC_GLUE, vllm="Exaone4_5_MTP", depth_at_top=True,
    wrapper_prefix="model.language_model.", text_only_prefixes=("model.language_model.", "model."),
    vllm_remap="mtp. -> model.; language_model. stripped from the shared embed_tokens",
    sources=("model_executor/models/exaone4_5_mtp.py",),
)
INTERNS2 = _family(
    "interns2", "Intern-S2 (Preview, Mobius)", {"interns2_mobius", "intern_s2_preview"},
    {"InternS2MobiusForConditionalGeneration", "InternS2PreviewForConditionalGeneration"},
    MtpStorage(NAMESPACE), glue=_FC_GLUE, depth_keys=("mtp_num_hidden_layers",), vllm="InternS2MobiusMTP",
    wrapper_prefix="model.language_model.", text_only_prefixes=("model.language_model.", "model."), moe=True,
    vllm_remap="Qwen3.5's MTP loader (mtp. -> model.); Mobius drafts with mtp_num_experts experts; intern_s2_preview "
    "drafts as Qwen3_5MTP / Qwen3_5MoeMTP",
    sources=("model_executor/models/interns2_mobius.py", "model_executor/models/qwen3_5_mtp.py"),
)

DEEPSEEK_V4 = _family(
    "deepseek_v4", "DeepSeek-V4 / V4-Flash", {"deepseek_v4"},
    {"DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration"},
    MtpStorage(NAMESPACE, layer=""),
    glue=(("mtp.{i}.enorm.weight", NORM), ("mtp.{i}.hnorm.weight", NORM), ("mtp.{i}.e_proj.weight", SQUARE),
          ("mtp.{i}.h_proj.weight", SQUARE)),
    engine_rename=_subspace_rename("mtp."), vllm="DeepSeekV4MTPModel", sglang="DeepseekV4ForCausalLMNextN", moe=True,
    text_class="DeepseekV4ForCausalLM",
    vllm_remap="mtp.{i} -> model.layers.{N+i} (_to_spec_layer_name), block -> mtp_block; separate e_proj / h_proj "
    "(ReplicatedLinear, the target's quantization) instead of eh_proj",
    sources=("models/deepseek_v4/nvidia/mtp.py", "config/speculative.py"),
)

# ---- a sub-namespace of model. -------------------------------------------------------------------------------------
ERNIE = _family(
    "ernie4_5_moe", "ERNIE-4.5 MoE", {"ernie4_5_moe"}, {"Ernie4_5_MoeForCausalLM"},
    MtpStorage(SUBSPACE, root="model.mtp_", layers=("emb_norm.", "hidden_norm.", "linear_proj.", "block.")),
    glue=(("model.mtp_emb_norm.{i}.weight", NORM), ("model.mtp_hidden_norm.{i}.weight", NORM),
          ("model.mtp_linear_proj.{i}.weight", PROJ)),  # [H, 2H]: a transposed one was a shipped bug (sgl#7657)
    engine_rename=_subspace_rename("model.mtp_block."), plain=("*.mtp_linear_proj",),  # nn.Linear (ernie_mtp.py 55)
    vllm="ErnieMTPModel", sglang="Ernie4_5_MoeForCausalLMMTP", moe=True,
    vllm_remap="WeightsMapper: model.mtp_*.0. -> model.layers.{N}.mtp_*, model.mtp_block.0. -> "
    "model.layers.{N}.mtp_block.",
    sources=("model_executor/models/ernie_mtp.py",),
)
HY_V4 = _family(
    "hy_v4", "Hunyuan HY-V4", {"hy_v4"}, {"HYV4ForCausalLM"},
    MtpStorage(SUBSPACE, root="model.mtp_layers.", layer=""),
    glue=(("model.mtp_layers.{i}.enorm.weight", NORM), ("model.mtp_layers.{i}.hnorm.weight", NORM),
          ("model.mtp_layers.{i}.eh_proj.weight", PROJ)),
    engine_rename=_subspace_rename("model.mtp_layers."), plain=("*.eh_proj",), vllm="HYV4MTPModel", moe=True,
    vllm_remap="model.mtp_layers.{i} -> model.layers.{N+i} (exclusions remapped too: _remap_mtp_quant_exclusions)",
    sources=("models/hy_v4/nvidia/mtp.py",),
)
INKLING = _family(
    "inkling", "Inkling", {"inkling_model", "inkling_mm_model"},
    {"InklingForCausalLM", "InklingForConditionalGeneration"},
    MtpStorage(SUBSPACE, root="model.mtp."), depth_keys=("mtp_config.num_nextn_predict_layers",),
    vllm="InklingMTPModel", text_class="InklingForCausalLM",
    vllm_remap="model.mtp.layers.{i} -> model.layers.{i}, model.mtp.chain_norm -> model.chain_norm; attention "
    "wq_du / wk_dv / wv_dv / wr_du -> qkvr",
    sources=("models/inkling/nvidia/mtp.py", "config/speculative.py"),
)
LONGCAT = _family(
    "longcat_flash", "LongCat-Flash", {"longcat_flash"}, {"LongcatFlashForCausalLM", "LongcatFlashNgramForCausalLM"},
    MtpStorage(SUBSPACE, root="model.mtp."), default_layers=1, setting_keys=("disable_quant_module",),
    glue=(("model.mtp.layers.{i}.enorm.m.weight", NORM), ("model.mtp.layers.{i}.hnorm.m.weight", NORM),
          ("model.mtp.layers.{i}.eh_proj.weight", PROJ), ("model.mtp.norm.weight", NORM)),
    copies=("model.mtp.embed_tokens.weight",), engine_rename=_subspace_rename("model.mtp.layers.", shift=2),
    vllm="LongCatFlashMTPModel", sglang="LongcatFlashForCausalLMNextN", moe=True,
    text_class="LongcatFlashForCausalLM",
    vllm_remap="new_to_old_names_mapping: model.mtp.layers.0.{enorm,hnorm}.m -> {enorm,hnorm}, model.mtp.embed_tokens "
    "-> model.layers.0.embed_tokens; the layer index is 2 x num_hidden_layers; 'mtp' in disable_quant_module "
    "unquantizes the draft",
    sources=("model_executor/models/longcat_flash_mtp.py",),
)
MIMO_V2_OMNI = _family(
    "mimo_v2_omni", "MiMo-V2-Omni", {"mimo_v2_omni"}, {"MiMoV2OmniForCausalLM"},
    MtpStorage(SUBSPACE, root="model.mtp."), default_layers=1,
    glue=(("model.mtp.layers.{i}.enorm.weight", NORM), ("model.mtp.layers.{i}.hnorm.weight", NORM),
          ("model.mtp.layers.{i}.eh_proj.weight", PROJ), ("model.mtp.layers.{i}.final_layernorm.weight", NORM)),
    plain=("*.eh_proj",), vllm="MiMoV2OmniMTPModel", sglang="MiMoV2MTP",
    vllm_remap="as MiMo-V2 (model.mtp.layers.{i}); vLLM builds the first layer only",
    sources=("model_executor/models/mimo_v2_mtp.py", "config/speculative.py"),
)
MINIMAX_M3 = _family(
    "minimax_m3", "MiniMax-M3", {"minimax_m3_vl"},
    {"MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3SparseForCausalLM"},
    MtpStorage(SUBSPACE, root="language_model.model.mtp."), depth_keys=("num_mtp_modules",), default_layers=1,
    glue=(("language_model.model.mtp.layers.{i}.enorm.weight", NORM),
          ("language_model.model.mtp.layers.{i}.hnorm.weight", NORM),
          ("language_model.model.mtp.layers.{i}.eh_proj.weight", PROJ)),
    wrapper_prefix="language_model.model.", text_only_prefixes=("language_model.model.", "model."),
    vllm="MiniMaxM3MTP", moe=True, text_class="MiniMaxM3SparseForConditionalGeneration",
    vllm_remap="language_model. stripped, .mtp. dropped (model.mtp.layers.{i} -> model.layers.{i}); "
    "weight_scale_inv -> weight_scale; standalone MTP checkpoints (minimax_m3_mtp) load too",
    sources=("models/minimax_m3/nvidia/mtp.py", "config/speculative.py"),
)

# ---- a separate drafter model ---------------------------------------------------------------------------------------
GEMMA4 = _family(
    "gemma4", "Gemma-4", {"gemma4", "gemma4_text", "gemma4_assistant", "gemma4_unified_assistant"},
    {"Gemma4ForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4UnifiedForConditionalGeneration"},
    MtpStorage(NAMESPACE), depth_keys=(), vllm="Gemma4MTPModel", text_class="Gemma4ForCausalLM",
    status=SEPARATE,
    status_note=(
        "Gemma-4's MTP drafter is a separate assistant model (model_type gemma4_assistant, vLLM Gemma4MTPModel), "
        "not stored in the target: nothing to inspect, graft or extract here; quantize and serve the assistant "
        "checkpoint on its own"
    ),
    vllm_remap="the assistant checkpoint's own names (hf_to_vllm_mapper); it shares the target's KV cache",
    sources=("model_executor/models/gemma4_mtp.py", "config/speculative.py"),
)

RELEASED_FAMILIES: tuple[Family, ...] = (
    BAILING_V25, BAILING_V3, DOTS3_NOTE, GLM4_MOE_LITE, GLM_OCR, HY_V3, KIMI_K3, OPENPANGU,
    EXAONE_MOE, EXAONE_4_5, INTERNS2, DEEPSEEK_V4,
    ERNIE, HY_V4, INKLING, LONGCAT, MIMO_V2_OMNI, MINIMAX_M3,
    GEMMA4,
)
