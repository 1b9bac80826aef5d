"""Registry entries whose MTP is a decoder layer appended to the trunk ("NextN"): DeepSeek-V3 / R1 / V3.1,
DeepSeek-V3.2, GLM-4.5 / 4.6 / 4.7 / 4.5-Air, GLM-5.x (``glm_moe_dsa``), GLM-5.3-Flash (``glm5_next``), Step-3.5 / 3.7.

Each MTP depth ``i`` is ``{prefix}layers.{num_hidden_layers + i}.*``: the glue ``enorm``, ``hnorm``, ``eh_proj``
[H, 2H], ``shared_head.norm`` (DeepSeek-V3 and GLM-4.5 also carry copies of the head and the embedding,
``shared_head.head`` and ``embed_tokens``) around one decoder layer of the trunk's MoE kind. Facts from vLLM 0.32
(``model_executor/models/deepseek_mtp.py``, ``glm4_moe_mtp.py``, ``step3p5_mtp.py``, ``models/glm5next/common/mtp.py``,
``config/speculative.py`` ``hf_config_override``) and transformers 5.19 (the trunk classes, whose
``_keys_to_ignore_on_load_unexpected`` drop these layers on a plain load); see shared/reference/mtp-families.md §5-7.

vLLM builds the drafter from the same checkpoint with the target's quantization config: ``eh_proj`` a plain
``nn.Linear`` (never quantized), the router ``mlp.gate`` unquantized, the block and the head (``{layer}.head``,
a ``ParallelLMHead``) by the exclusions, under the layer's own name (``model.layers.61.self_attn...``; Step's block
under ``model.layers.45.mtp_block.``; GLM-5.3-Flash's ``model.language_model.`` stripped). SGLang's NextN classes
build the whole draft BF16 for ``modelopt_fp4`` and ``eh_proj`` as a plain Linear.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtpquant.families.mtp_config import config_int
from mtpquant.families.schema import EngineRules, Family, MtpGroup, MtpLayout
from mtpquant.families.storage import APPENDED, MtpStorage

__all__ = [
    "COPIES",
    "DEEPSEEK_V3",
    "DEEPSEEK_V32",
    "GLM4_MOE",
    "GLM5_NEXT",
    "GLM_MOE_DSA",
    "NEXTN_FAMILIES",
    "NEXTN_STANDALONE",
    "STEP3P5",
    "AppendedForward",
    "layer_rename",
    "mla_shapes",
    "moe_shapes",
    "nextn_glue_shapes",
    "step3p5_mtp_check",
    "step3p5_mtp_layer_types",
]

_APPENDED = MtpStorage(APPENDED)
# Leaves (relative to the MTP layer) that are the layer's own, not its decoder block (vLLM _rewrite_spec_layer_name)
GLUE = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
COPIES = ("shared_head.head.weight", "embed_tokens.weight")
# SGLang's standalone export of a DeepSeek MTP (scripts/export_deepseek_nextn.py): the draft class it loads as
NEXTN_STANDALONE = "DeepseekV3ForCausalLMNextN"


@dataclass(frozen=True)
class AppendedForward:
    """How one family's appended MTP layer computes, as the engine's drafter computes it (``mtp.nextn``): the glue
    ``eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))`` (``hidden_first``: MiMo-7B's ``[hidden, embed]``), the
    trunk's decoder layer, ``shared_head.norm``, then the target's head (vLLM 0.32 shares the target's embedding and
    LM head with every MTP drafter, ``llm_base_proposer._maybe_share_lm_head``, whatever copies the layer carries).

    The block, norms and RoPE are transformers' classes ``transformers.models.{module}.modeling_{module}.{prefix}*``
    (``DecoderLayer``, ``RMSNorm``, ``RotaryEmbedding``; ``{prefix}Config``), composed by transformers' generic
    ``modeling_layers.MtpLayer``.
    """

    module: str  # transformers model package: "glm4_moe"
    prefix: str  # its class prefix: "Glm4Moe"
    # The stream the next draft step reads: shared_head.norm's output (True: vLLM deepseek_mtp.py returns
    # (hidden, shared_head(hidden)) and the proposer recycles the second) or its input (False: glm4_moe_mtp.py
    # returns the pre-norm hidden alone)
    recycle_normed: bool
    hidden_first: bool = False
    # vLLM's NextN layers zero the token embedding at position 0 ("masking inputs at position 0, as not needed by
    # MTP": deepseek_mtp.py, glm4_moe_mtp.py); Step3p5AMultiTokenPredictorLayer does not
    mask_position_zero: bool = True
    # The head each layer drafts with where it is the layer's own (its leaf under the layer: Step's
    # ``shared_head.output``; vLLM's Step3p5MTPProposer._maybe_share_lm_head keeps it, ``has_own_lm_head``); "": the
    # target's LM head (every other drafter: the proposer shares the target's head into the layer)
    own_head: str = ""


def nextn_glue_shapes(
    p: str, text: Mapping[str, Any], head: str = "head", embed: bool = True
) -> dict[str, tuple[int, ...]]:
    """The NextN glue of one MTP layer under ``p``, with the copy of the head (``shared_head.{head}``) and, with
    ``embed``, of the embedding."""
    H, V = config_int(text, "hidden_size"), config_int(text, "vocab_size")
    shapes: dict[str, tuple[int, ...]] = {
        p + "eh_proj.weight": (H, 2 * H),
        p + "enorm.weight": (H,),
        p + "hnorm.weight": (H,),
        p + "shared_head.norm.weight": (H,),
        p + f"shared_head.{head}.weight": (V, H),
    }
    if embed:
        shapes[p + "embed_tokens.weight"] = (V, H)
    return shapes


def mla_shapes(p: str, text: Mapping[str, Any], indexer: bool) -> dict[str, tuple[int, ...]]:
    """DeepSeek's multi-head latent attention under ``p`` (transformers DeepseekV3Attention; with ``indexer`` the
    V3.2 / GLM-5 sparse-attention indexer, DeepseekV32Indexer)."""
    H, heads = config_int(text, "hidden_size"), config_int(text, "num_attention_heads")
    nope, rope = config_int(text, "qk_nope_head_dim"), config_int(text, "qk_rope_head_dim")
    kv, v = config_int(text, "kv_lora_rank"), config_int(text, "v_head_dim")
    q_rank = text.get("q_lora_rank")
    a = p + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {}
    if q_rank is None:
        shapes[a + "q_proj.weight"] = (heads * (nope + rope), H)
    else:
        q_rank = config_int(text, "q_lora_rank")
        shapes |= {
            a + "q_a_proj.weight": (q_rank, H),
            a + "q_a_layernorm.weight": (q_rank,),
            a + "q_b_proj.weight": (heads * (nope + rope), q_rank),
        }
    shapes |= {
        a + "kv_a_proj_with_mqa.weight": (kv + rope, H),
        a + "kv_a_layernorm.weight": (kv,),
        a + "kv_b_proj.weight": (heads * (nope + v), kv),
        a + "o_proj.weight": (H, heads * v),
    }
    if indexer:
        ih, ihd = config_int(text, "index_n_heads"), config_int(text, "index_head_dim")
        i = a + "indexer."
        shapes |= {
            i + "wq_b.weight": (ih * ihd, config_int(text, "q_lora_rank")),
            i + "wk.weight": (ihd, H),
            i + "k_norm.weight": (ihd,),
            i + "k_norm.bias": (ihd,),
            i + "weights_proj.weight": (ih, H),
        }
    return shapes


def moe_shapes(p: str, text: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The DeepSeek-style MoE block under ``p``: router with its correction bias, shared experts, routed experts per
    expert (as the checkpoints store them)."""
    H, E = config_int(text, "hidden_size"), config_int(text, "n_routed_experts")
    inter = config_int(text, "moe_intermediate_size")
    shared = inter * int(text.get("n_shared_experts") or 1)
    m = p + "mlp."
    shapes: dict[str, tuple[int, ...]] = {
        m + "gate.weight": (E, H),
        m + "gate.e_score_correction_bias": (E,),
        m + "shared_experts.gate_proj.weight": (shared, H),
        m + "shared_experts.up_proj.weight": (shared, H),
        m + "shared_experts.down_proj.weight": (H, shared),
    }
    for e in range(E):
        q = f"{m}experts.{e}."
        shapes |= {q + "gate_proj.weight": (inter, H), q + "up_proj.weight": (inter, H)}
        shapes[q + "down_proj.weight"] = (H, inter)
    return shapes


def _norms(p: str, text: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    H = config_int(text, "hidden_size")
    return {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}


def _layers(text: Mapping[str, Any], layers: int) -> list[str]:
    """Each MTP layer's prefix as the shape functions write it (``model.layers.{N+i}.``; ``ModelSpec`` moves the names
    under the checkpoint's own prefix, GLM-5.3-Flash's ``model.language_model.`` say)."""
    n = config_int(text, "num_hidden_layers")
    return [f"model.layers.{n + i}." for i in range(layers)]


def _deepseek_shapes(indexer: bool) -> Any:
    def shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
        del per_expert  # routed experts are stored per expert
        out: dict[str, tuple[int, ...]] = {}
        for p in _layers(text, layers):
            out |= nextn_glue_shapes(p, text) | _norms(p, text) | mla_shapes(p, text, indexer) | moe_shapes(p, text)
        return out

    return shapes


def glm4_moe_shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """GLM-4.5 / 4.6 / 4.7 / 4.5-Air: grouped-query attention with optional bias and QK norm, the MoE block
    (502 tensors for GLM-4.5 with its head and embedding copies, 500 without: GLM-4.6 / 4.7)."""
    del per_expert
    H, heads, kv = (config_int(text, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    hd = text.get("head_dim") or H // heads
    out: dict[str, tuple[int, ...]] = {}
    for p in _layers(text, layers):
        a = p + "self_attn."
        attn: dict[str, tuple[int, ...]] = {
            a + "q_proj.weight": (heads * hd, H),
            a + "k_proj.weight": (kv * hd, H),
            a + "v_proj.weight": (kv * hd, H),
            a + "o_proj.weight": (H, heads * hd),
        }
        if text.get("attention_bias"):
            attn |= {a + "q_proj.bias": (heads * hd,), a + "k_proj.bias": (kv * hd,), a + "v_proj.bias": (kv * hd,)}
        if text.get("use_qk_norm"):
            attn |= {a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
        out |= nextn_glue_shapes(p, text) | _norms(p, text) | attn | moe_shapes(p, text)
    return out


def _glue_only(head: str, embed: bool) -> Any:
    """The glue of every declared layer (the inventory mtpquant checks where the block's layout follows per-layer
    config it does not model: Step's per-layer attention kinds, GLM-5.3-Flash's KDA / DSA layers)."""

    def shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
        del per_expert
        out: dict[str, tuple[int, ...]] = {}
        for p in _layers(text, layers):
            out |= nextn_glue_shapes(p, text, head, embed)
        return out

    return shapes


def layer_rename(pattern: re.Pattern[str], block_infix: str = "", head: str = "head") -> Any:
    """vLLM's draft name of an MTP module: the layer prefix normalised to ``model.layers.{n}.``; the shared head
    ``{layer}.head`` (DeepSeek / GLM: ``SharedHead(prefix=layer)``; Step: ``{layer}.shared_head.head``); the block
    under ``block_infix`` (Step: ``mtp_block.``)."""

    def rename(name: str, num_hidden_layers: int) -> str:
        del num_hidden_layers
        m = pattern.match(name)
        if m is None:
            return name
        layer, rest = f"model.layers.{m.group(1)}.", name[m.end() :]
        if rest.startswith(("shared_head.head", "shared_head.output")):
            return layer + head + rest[len(rest.split(".", 2)[0]) + len(rest.split(".", 2)[1]) + 1 :]
        if rest.startswith(GLUE):
            return layer + rest
        return layer + block_infix + rest.replace("transformer.", "", 1)

    return rename


def step3p5_mtp_layer_types(text: Mapping[str, Any], depth: int) -> tuple[list[str], list[str]]:
    """The attention and MLP kinds of Step's MTP layers: the trailing entries of the legacy padded per-layer lists (as
    the releases write them: ``layer_types`` / ``mlp_layer_types`` of ``num_hidden_layers + depth`` entries, which
    vLLM's Step3p5DecoderLayer indexes by the layer's number), transformers' ``mtp_layer_types`` /
    ``mtp_mlp_layer_types``, else ``moe_layers_enum`` (MoE where listed, as vLLM and transformers read it) and full
    attention (transformers' Step3p7TextConfig default). ``MtpConfigError`` where the config says neither."""
    from mtpquant.errors import MtpConfigError

    n = config_int(text, "num_hidden_layers")
    kinds: list[list[str]] = []
    for padded, own in (("layer_types", "mtp_layer_types"), ("mlp_layer_types", "mtp_mlp_layer_types")):
        value, mine = text.get(padded), text.get(own)
        if isinstance(value, list) and len(value) == n + depth:
            kinds.append([str(v) for v in value[n:]])
        elif isinstance(mine, list) and len(mine) == depth:
            kinds.append([str(v) for v in mine])
        elif padded == "layer_types" and value is None:
            kinds.append(["full_attention"] * depth)
        elif padded == "mlp_layer_types" and isinstance(enum := text.get("moe_layers_enum"), (str, list)):
            listed = {int(i) for i in (enum.split(",") if isinstance(enum, str) else enum) if str(i).strip()}
            kinds.append(["sparse" if n + i in listed else "dense" for i in range(depth)])
        else:
            raise MtpConfigError(
                f"config.json: {padded} does not list Step's {depth} MTP layers (num_hidden_layers + "
                f"num_nextn_predict_layers entries, as the releases write it) and {own} is not set: the MTP layers' "
                "kinds are unknown"
            )
    return kinds[0], kinds[1]


def step3p5_mtp_check(text: Mapping[str, Any]) -> None:
    """Step's MTP forward needs its layers' attention and MLP kinds (``step3p5_mtp_layer_types``)."""
    depth = text.get("num_nextn_predict_layers")
    if isinstance(depth, int) and depth > 0:
        step3p5_mtp_layer_types(text, depth)


_MODEL_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ANY_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")

# vLLM 0.32 deepseek_mtp.py DeepSeekMTP.load_weights: stacked_params_mapping (wk + weights_proj: V3.2's indexer)
_DEEPSEEK_PACKED = {"gate_up_proj": ("gate_proj", "up_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
_GLM_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# the router is a GateLinear without a quantization config; eh_proj a plain nn.Linear (deepseek_mtp.py 84,
# glm4_moe_mtp.py 87); V3.2's indexer wk_weights_proj is built with quant_config=None (deepseek_v2.py 712)
_NEXTN_UNQUANTIZED = ("*.mlp.gate", "*.eh_proj")
_NEXTN_SGLANG = ("*.eh_proj",)
# the draft's load_weights raises (deepseek_mtp.py 520-533, deepseek_v32/nvidia/mtp.py 485-496, glm5next mtp.py 436-443)
_COMPLETENESS = "ValueError: MTP speculative decoding layer {layer} weights missing from checkpoint"


# The precision groups of an appended-layer MTP (``convert --mtp auto``, ``tune-mtp``): its attention (q/k/v packed by
# vLLM into qkv_proj, GLM-4.5), the shared expert (gate/up packed), the routed experts (FusedMoE: one precision for
# all); eh_proj, the router and the norms stay BF16 (``unquantized``, what vLLM builds without a quantization config)
_ATTENTION_GROUP = MtpGroup("attention", "attention projections", ("*.self_attn.*_proj",))
_SHARED_EXPERT_GROUP = MtpGroup("shared_expert", "shared expert", ("*.mlp.shared_experts.*_proj",))
_EXPERTS_GROUP = MtpGroup("experts", "routed experts", ("*.mlp.experts.*_proj",))
# DeepSeek's and GLM-5's MLA stays BF16 as in their main model (``_MLA_UNQUANTIZED``): no attention group
_GQA_GROUPS = (_ATTENTION_GROUP, _SHARED_EXPERT_GROUP, _EXPERTS_GROUP)
_MLA_GROUPS = (_SHARED_EXPERT_GROUP, _EXPERTS_GROUP)


def _mtp(shapes: Any, **kw: Any) -> MtpLayout:
    return MtpLayout(
        depth_keys=("num_nextn_predict_layers",),
        default_layers=0,
        setting_keys=kw.pop("setting_keys", ()),
        shapes=shapes,
        per_expert=True,
        either_expert_form=False,
        engine_linears=("*.self_attn.*", "*.mlp.*_proj", "*.mlp.experts", "*.shared_head.head"),
        # the head copy stays BF16 as lm_head does (vLLM 0.32 replaces it by the target's head anyway); DeepSeek's
        # MLA as its main model's (the block follows the target's exclusions)
        unquantized=("*.eh_proj", "*.mlp.gate", "*norm*", "*.shared_head.head", *kw.pop("unquantized", ())),
        fused_groups=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa")),
        storage=_APPENDED,
        **kw,
    )


# What NVFP4 leaves in BF16 in every NextN family's main model: what vLLM builds unquantized (routers, with their
# F32 e_score_correction_bias, eh_proj, norms) and modelopt never quantizes (lm_head, embeddings)
_MAIN_UNQUANTIZED = ("lm_head", "*embed_tokens", "*.mlp.gate", "*.eh_proj", "*norm*")
# DeepSeek's multi-head latent attention stays BF16 (NVIDIA's DeepSeek-R1-FP4 / V3-0324-FP4 quantize the MLPs and
# experts only; ModelOpt's examples/deepseek/ptq.py); GLM's grouped-query attention is quantized (vLLM builds
# qkv_proj / o_proj with the checkpoint's quantization)
_MLA_UNQUANTIZED = ("*self_attn*",)


def _family(key: str, display: str, model_types: set[str], archs: set[str], mtp: MtpLayout, engine: EngineRules,
            text_class: str, **kw: Any) -> Family:
    return Family(
        key=key,
        display=display,
        model_types=frozenset(model_types),
        architectures=frozenset(archs),
        moe=True,
        wrapper_prefix=kw.pop("wrapper_prefix", "model."),
        text_only_prefixes=kw.pop("text_only_prefixes", ("model.",)),
        has_vision=kw.pop("has_vision", False),
        mtp=mtp,
        engine=engine,
        wrapper_class=kw.pop("wrapper_class", None),
        text_class=text_class,
        fused_groups=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("gate_proj", "up_proj")),
        unquantized=(*_MAIN_UNQUANTIZED, *kw.pop("unquantized", ())),
        fused_main_experts=False,
        mtp_forward=kw.pop("mtp_forward", False),
        mtp_heal=kw.pop("mtp_heal", False),
        convert=kw.pop("convert", False),
        **kw,
    )


def _engine(packed: Mapping[str, tuple[str, ...]], vllm: str, sglang: str, **kw: Any) -> EngineRules:
    """The family's engine rules; ``trtllm=``: TensorRT-LLM's MTP class where mtpquant reproduces its rules."""
    trtllm = kw.pop("trtllm", None)
    return EngineRules(
        packed=packed,
        built_unquantized=kw.pop("built_unquantized", _NEXTN_UNQUANTIZED),
        sglang_plain=_NEXTN_SGLANG,
        drafters={"vllm": vllm, "sglang": sglang, **({"trtllm": trtllm} if trtllm is not None else {})},
        **kw,
    )


_DEEPSEEK_LINEAGE = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "n_routed_experts", "n_shared_experts", "first_k_dense_replace")

DEEPSEEK_V3 = _family(
    "deepseek_v3",
    "DeepSeek-V3 / R1 / V3.1",
    {"deepseek_v3"},
    {"DeepseekV3ForCausalLM"},
    _mtp(_deepseek_shapes(indexer=False), copies=COPIES, copies_required=True, unquantized=("*.self_attn.*",),
         engine_rename=layer_rename(_MODEL_LAYER), groups=_MLA_GROUPS,
         appended=AppendedForward("deepseek_v3", "DeepseekV3", recycle_normed=True)),
    # TensorRT-LLM: DeepseekV3MTP (_torch/models/modeling_deepseekv3.py)
    _engine(_DEEPSEEK_PACKED, "DeepSeekMTPModel", "DeepseekV3ForCausalLMNextN", trtllm="DeepseekV3MTP",
            missing_mtp_error=_COMPLETENESS),
    "DeepseekV3ForCausalLM",
    sources=("model_executor/models/deepseek_mtp.py", "config/speculative.py"),
    vllm_remap="the head copy -> {layer}.head (SharedHead); embed_tokens -> model.embed_tokens",
    unquantized=_MLA_UNQUANTIZED,
    lineage_keys=_DEEPSEEK_LINEAGE,
    nextn_architecture=NEXTN_STANDALONE,
    mtp_forward=True,
    # BF16 or NVFP4 / FP8 (heal.qat): the MLA block trains on the CPU through transformers' decoder layer
    mtp_heal=True,
    convert=True,
)
# V3.2 and GLM-5.x: the MLA with its sparse-attention indexer; vLLM's DeepseekV32MTPModel (speculative.py 663-694)
# (an FP8 wk is dequantized to BF16 as it loads: _try_load_fp8_indexer_wk, deepseek_v2.py)
_V32_ENGINE = {
    "built_unquantized": (*_NEXTN_UNQUANTIZED, "*.indexer.wk", "*.indexer.weights_proj"),
    "dequantized_on_load": ("*.indexer.wk",),
    "missing_mtp_error": _COMPLETENESS,
}
DEEPSEEK_V32 = _family(
    "deepseek_v32",
    "DeepSeek-V3.2",
    {"deepseek_v32"},
    {"DeepseekV32ForCausalLM"},
    _mtp(_deepseek_shapes(indexer=True), copies=COPIES, copies_required=True, unquantized=("*.self_attn.*",),
         setting_keys=("index_share_for_mtp_iteration",), engine_rename=layer_rename(_MODEL_LAYER), groups=_MLA_GROUPS,
         appended=AppendedForward("deepseek_v32", "DeepseekV32", recycle_normed=True)),
    _engine(_DEEPSEEK_PACKED, "DeepseekV32MTPModel", "DeepseekV3ForCausalLMNextN", **_V32_ENGINE),
    "DeepseekV32ForCausalLM",
    sources=("models/deepseek_v32/nvidia/mtp.py", "config/speculative.py"),
    vllm_remap="the head copy -> {layer}.head; an FP8 indexer wk dequantized to BF16 as it loads",
    unquantized=_MLA_UNQUANTIZED,
    lineage_keys=(*_DEEPSEEK_LINEAGE, "index_n_heads", "index_head_dim"),
    nextn_architecture=NEXTN_STANDALONE,
    mtp_forward=True,
    convert=True,
)
GLM_MOE_DSA = _family(
    "glm_moe_dsa",
    "GLM-5 / 5.1 / 5.2",
    {"glm_moe_dsa"},
    {"GlmMoeDsaForCausalLM"},
    _mtp(_deepseek_shapes(indexer=True), copies=COPIES, unquantized=("*.self_attn.*",),
         setting_keys=("index_share_for_mtp_iteration",), engine_rename=layer_rename(_MODEL_LAYER), groups=_MLA_GROUPS,
         appended=AppendedForward("glm_moe_dsa", "GlmMoeDsa", recycle_normed=True)),
    _engine(_DEEPSEEK_PACKED, "DeepseekV32MTPModel", "GlmMoeDsaForCausalLMNextN", **_V32_ENGINE),
    "GlmMoeDsaForCausalLM",
    sources=("models/deepseek_v32/nvidia/mtp.py", "config/speculative.py"),
    vllm_remap="as DeepSeek-V3.2 (DeepseekV32MTPModel)",
    unquantized=_MLA_UNQUANTIZED,
    lineage_keys=(*_DEEPSEEK_LINEAGE, "index_n_heads", "index_head_dim"),
    mtp_forward=True,
    convert=True,
)
GLM4_MOE = _family(
    "glm4_moe",
    "GLM-4.5 / 4.6 / 4.7 / 4.5-Air",
    {"glm4_moe"},
    {"Glm4MoeForCausalLM"},
    _mtp(glm4_moe_shapes, copies=COPIES, engine_rename=layer_rename(_MODEL_LAYER), groups=_GQA_GROUPS,
         appended=AppendedForward("glm4_moe", "Glm4Moe", recycle_normed=False)),
    # TensorRT-LLM: Glm4MTP (_torch/models/modeling_glm.py)
    _engine(_GLM_PACKED, "Glm4MoeMTPModel", "Glm4MoeForCausalLMNextN", trtllm="Glm4MTP",
            head_from_target="shared_head.head"),
    "Glm4MoeForCausalLM",
    sources=("model_executor/models/glm4_moe_mtp.py", "config/speculative.py"),
    vllm_remap="lm_head -> model.layers.{N}.shared_head.head where the layer has no head copy",
    lineage_keys=("head_dim", "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "use_qk_norm",
                  "attention_bias"),
    mtp_forward=True,
    mtp_heal=True,  # BF16 or NVFP4 / FP8 (heal.qat): the appended-layer forward trains as Qwen3's does
    convert=True,
)
# GLM-5.3-Flash: the text tower under model.language_model.; vLLM's Glm5NextMTP strips that prefix (mtp.py 332-337)
# and builds layer 45 as model.layers.45.*, so an exclusion must match that name too (nvidia/GLM-5.3-Flash-NVFP4)
GLM5_NEXT = _family(
    "glm5_next",
    "GLM-5.3-Flash",
    {"glm5_next", "glm5_next_text"},
    {"Glm5NextForConditionalGeneration", "Glm5NextForCausalLM"},
    _mtp(_glue_only("head", embed=False), copies=COPIES, inventory="glue",
         setting_keys=("index_share_for_mtp_iteration",), engine_rename=layer_rename(_ANY_LAYER)),
    _engine(_DEEPSEEK_PACKED, "Glm5NextMTPModel", "", missing_mtp_error=_COMPLETENESS),
    "Glm5NextForCausalLM",
    sources=("models/glm5next/common/mtp.py", "config/speculative.py"),
    vllm_remap="model.language_model. stripped: model.language_model.layers.{N} -> model.layers.{N}",
    unquantized=_MLA_UNQUANTIZED,
    wrapper_prefix="model.language_model.",
    text_only_prefixes=("model.language_model.", "model."),
    has_vision=True,
    wrapper_class="Glm5NextForConditionalGeneration",
)
# Step-3.5 / 3.7: three appended layers, the head stored as shared_head.output; vLLM's Step3p5MTP builds the block as
# model.layers.{n}.mtp_block.* and strips a .transformer. infix (step3p5_mtp.py 74, 286-289, 323-345). Draft step i runs
# layer N + i (spec_step_idx % num_mtp_layers) and drafts with that layer's own head (has_own_lm_head); its eh_proj is
# a plain nn.Linear (never quantized), its norms GemmaRMSNorm (1 + w), the block and the head take the draft quant
# config (step3p5_mtp.py 46-75, v1/spec_decode/step3p5.py _maybe_share_lm_head)
STEP3P5 = _family(
    "step3p5",
    "Step-3.5 / 3.7-Flash",
    {"step3p5", "step3p7"},
    {"Step3p5ForCausalLM", "Step3p7ForConditionalGeneration"},
    _mtp(_glue_only("output", embed=False), copies=("shared_head.output.weight",), copies_required=True,
         inventory="glue", unquantized=("*.shared_head.output",), config_check=step3p5_mtp_check,
         engine_rename=layer_rename(_MODEL_LAYER, block_infix="mtp_block.", head="shared_head.head"),
         appended=AppendedForward("step3p7", "Step3p7", recycle_normed=False, mask_position_zero=False,
                                  own_head="shared_head.output")),
    _engine({"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
            "Step3p5MTP", "Step3p5MTP",
            missing_mtp_error="RuntimeError: Some parameters like model.layers.{layer}... are not in the checkpoint "
            "and will falsely use random initialization"),
    "Step3p5ForCausalLM",
    sources=("model_executor/models/step3p5_mtp.py", "v1/spec_decode/step3p5.py", "config/speculative.py"),
    vllm_remap="block -> model.layers.{N}.mtp_block.* (a .transformer. infix stripped); shared_head.output -> "
    "shared_head.head",
    wrapper_prefix="model.language_model.",
    text_only_prefixes=("model.language_model.", "model."),
    wrapper_class="Step3p7ForConditionalGeneration",
    # the main model's router (Step3p7TopKRouter) is a Parameter, not a Linear; its head-wise attention gate g_proj a
    # ColumnParallelLinear with the quant config (step3p5.py 226-232): quantized like q/k/v
    mtp_forward=True,
    convert=True,
)

NEXTN_FAMILIES: tuple[Family, ...] = (DEEPSEEK_V3, DEEPSEEK_V32, GLM_MOE_DSA, GLM4_MOE, GLM5_NEXT, STEP3P5)
