"""Tiny random-weight checkpoints in the exact real layouts of each family (for tests and demos).

The main model comes from the transformers class of its family (so it loads and runs there), its
tensors renamed and split exactly as real Hub checkpoints store them (Qwen3.5-MoE: fused 3-D main
experts; Qwen3-Next: per-expert experts), plus the ``mtp.*`` tensors with their real shapes and
zero-centred norms. Dimensions are small, but head dims are real (256 full attention, 128 linear
attention) and every Linear input dimension is a multiple of 16.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.dtypes import planned
from mtpquant.checkpoint.index import SINGLE_NAME
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.families import FAMILIES, resolve
from mtpquant.synth.qwen4_exp import ROPE_PARAMETERS

__all__ = [
    "TINY_VARIANTS",
    "TinySpec",
    "check_synthetic_replaceable",
    "make_tiny_checkpoint",
    "tiny_config",
    "tiny_tokenizer",
    "vision_processor_configs",
]

log = logging.getLogger(__name__)

_TEXT_BASE: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "attn_output_gate": True,
}
_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
TINY_VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "deepstack_visual_indexes": [],
}


@dataclass(frozen=True)
class TinySpec:
    """Which tiny checkpoint to build."""

    family: str = "qwen3_5"  # qwen3_5 | qwen3_5_moe | qwen3_next | qwen4_exp
    text_only: bool = False  # Qwen3_5ForCausalLM-style re-export (no wrapper, no vision)
    text_only_prefix: str = "model.language_model."  # or "model." for model.layers.* re-exports
    tied: bool = False
    shards: int = 1
    # "hf": model-00001-of-00003.safetensors; "qwen": model.safetensors-00001-of-00003.safetensors
    naming: str = "hf"
    mtp: bool = True
    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 128
    alias: bool = False  # qwen4_exp: the day-0 qwen3_8_flash_next labels over the same weights
    copies: bool = True  # families whose MTP may carry head / embedding copies (GLM-4.5 does, GLM-4.6+ do not)
    mtp_file: str | None = None  # the MTP in a file of its own (GLM-4.6 / 4.7: mtp.safetensors), in the index
    overrides: tuple[tuple[str, Any], ...] = ()  # families beyond Qwen: config keys set over the tiny defaults


TINY_VARIANTS: dict[str, TinySpec] = {
    "qwen3_5": TinySpec("qwen3_5", shards=2),
    "qwen3_5-tied": TinySpec("qwen3_5", tied=True),
    "qwen3_5-text": TinySpec("qwen3_5", text_only=True, text_only_prefix="model."),
    "qwen3_5_moe": TinySpec("qwen3_5_moe", shards=3, naming="qwen"),
    "qwen3_next": TinySpec("qwen3_next", shards=2),
    "qwen4_exp": TinySpec("qwen4_exp", shards=2),
    "qwen4_exp-alias": TinySpec("qwen4_exp", shards=2, alias=True),
    # beyond Qwen (synth.nextn): the whole MTP in the last shard (DeepSeek-V3: model-00163-of-000163), or in its own
    # mtp.safetensors (GLM-4.6 / 4.7, without head / embedding copies)
    "deepseek_v3": TinySpec("deepseek_v3", shards=3),
    "deepseek_v32": TinySpec("deepseek_v32", shards=3),
    "glm_moe_dsa": TinySpec("glm_moe_dsa", shards=3),
    # DeepSeek's own MLA dimensions (kv_lora_rank 512 + qk_rope_head_dim 64 = 576: what vLLM's GPU MLA backends take;
    # its CPU build refuses MLA), 16 heads: the GPU serve check's (scripts/nextn_serve_check.py)
    "deepseek_v3-mla": TinySpec(
        "deepseek_v3",
        shards=3,
        overrides=(("kv_lora_rank", 512), ("qk_rope_head_dim", 64), ("qk_nope_head_dim", 128), ("v_head_dim", 128),
                   ("num_attention_heads", 16), ("num_key_value_heads", 16), ("hidden_size", 256)),
    ),
    "glm4_moe": TinySpec("glm4_moe", shards=2, copies=False, mtp_file="mtp.safetensors"),
    "glm4_moe-copies": TinySpec("glm4_moe", shards=3),
    "nemotron_h": TinySpec("nemotron_h", shards=3),
    "mimo_v2_flash": TinySpec("mimo_v2_flash", shards=3),
    "mimo": TinySpec("mimo", shards=3),
    "step3p5": TinySpec("step3p5", shards=3),
}


def tiny_config(spec: TinySpec) -> dict[str, Any]:
    """The config.json of a tiny checkpoint, shaped like the real one of its family."""
    from mtpquant.synth.nextn import NEXTN_CONFIGS, nextn_config

    if spec.family in NEXTN_CONFIGS:
        return {**nextn_config(spec.family, spec.mtp), **dict(spec.overrides)}
    if spec.family == "qwen4_exp":
        from mtpquant.synth.qwen4_exp import TINY_TEXT_CONFIG, qwen4_exp_config

        text = dict(TINY_TEXT_CONFIG, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size)
        if not spec.mtp:
            text["mtp_num_hidden_layers"] = 0
        return qwen4_exp_config(text, TINY_VISION, alias=spec.alias, tied=spec.tied)
    text = dict(_TEXT_BASE, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, tie_word_embeddings=spec.tied)
    n = text["num_hidden_layers"]
    text["layer_types"] = [
        "full_attention" if (i + 1) % text["full_attention_interval"] == 0 else "linear_attention" for i in range(n)
    ]
    if spec.family != "qwen3_5":
        text |= _MOE
    if spec.family == "qwen3_next":
        text.pop("attn_output_gate")
        text.pop("layer_types")
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            **text,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10_000_000.0,
            "rope_scaling": None,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": "bfloat16",
        }
    moe = spec.family == "qwen3_5_moe"
    text |= {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "mtp_num_hidden_layers": 1 if spec.mtp else 0,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": dict(ROPE_PARAMETERS),
        "mamba_ssm_dtype": "float32",
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }
    if not spec.mtp:
        text.pop("mtp_num_hidden_layers")
    if spec.text_only:
        arch = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
        return {"architectures": [arch], **text}
    vision = dict(
        TINY_VISION, out_hidden_size=spec.hidden_size, model_type="qwen3_5_moe_vision" if moe else "qwen3_5_vision"
    )
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": spec.tied,
        "image_token_id": spec.vocab_size - 4,
        "video_token_id": spec.vocab_size - 3,
        "vision_start_token_id": spec.vocab_size - 2,
        "vision_end_token_id": spec.vocab_size - 1,
    }


def _main_state_dict(spec: TinySpec, config: dict[str, Any]) -> dict[str, Any]:
    """Random weights from the family's transformers class, in its in-memory naming."""
    import torch
    import transformers

    model_spec = resolve(config)
    family = model_spec.family
    torch.manual_seed(spec.seed)
    cls_name = family.text_class if spec.text_only or family.wrapper_class is None else family.wrapper_class
    cls = getattr(transformers, cls_name)
    cfg_cls = cls.config_class
    hf_config = cfg_cls.from_dict(copy.deepcopy(config))
    model = cls(hf_config)
    # Real Qwen3.5 checkpoints keep the Gated DeltaNet A_log and gated norm in float32.
    keep_f32 = (".linear_attn.A_log", ".linear_attn.norm.weight") if family.key != "qwen3_next" else ()
    sd = {
        k: v.detach().to(torch.float32 if k.endswith(keep_f32) else torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
    }
    if spec.tied:
        sd.pop("lm_head.weight", None)
    return sd


def _disk_layout(spec: TinySpec, sd: dict[str, Any]) -> dict[str, Any]:
    """Rename/split in-memory tensors into the family's on-disk layout."""
    out: dict[str, Any] = {}
    for name, t in sd.items():
        if spec.text_only and name.startswith("model.") and spec.text_only_prefix == "model.":
            name = name.replace("model.language_model.", "model.", 1)
        if spec.family == "qwen3_next" and ".mlp.experts." in name:
            # transformers keeps experts fused in memory; Qwen3-Next checkpoints store them per expert.
            stem = name.rsplit(".experts.", 1)[0] + ".experts."
            if name.endswith("gate_up_proj"):
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{stem}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                    out[f"{stem}{e}.up_proj.weight"] = t[e, inter:].contiguous()
            elif name.endswith("down_proj"):
                for e in range(t.shape[0]):
                    out[f"{stem}{e}.down_proj.weight"] = t[e].contiguous()
            continue
        out[name] = t
    return out


def _mtp_tensors(spec: TinySpec, config: dict[str, Any]) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 1)
    shapes = resolve(config).expected_mtp_shapes()
    # zero-centred RMSNorm weights near 0 (identity), weights scaled by their input width
    return {name: _random(shape, gen) for name, shape in shapes.items()}


def _random(shape: tuple[int, ...], gen: Any) -> Any:
    """A random BF16 tensor: zero-centred norms near 0, weights scaled by their input width."""
    import torch

    if len(shape) == 1:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    return (torch.randn(shape, generator=gen) * (1.0 / shape[-1] ** 0.5)).to(torch.bfloat16)


def _qwen4_exp_tensors(spec: TinySpec, config: dict[str, Any]) -> dict[str, Any]:
    """Qwen4-Exp main model in its real layout (``synth.qwen4_exp``, our own code: the installed transformers
    predates the family), the PLE int64 buffers with their real values, and a Qwen3.5-style vision tower."""
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from mtpquant.synth.qwen4_exp import main_tensors, ngram_buffers

    text = config["text_config"]
    gen = torch.Generator().manual_seed(spec.seed)
    ple_ids = sorted(text["ple_layer_ids"])
    out: dict[str, Any] = {}
    for name, shape, dtype in main_tensors(config):
        if dtype == "I64":
            layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
            values = ngram_buffers(text, ple_ids.index(layer + 1))[name.rsplit(".", 1)[1]]
            out[name] = torch.tensor(values, dtype=torch.int64)
        elif name.endswith(".A_log"):
            out[name] = torch.log(torch.rand(shape, generator=gen) * 15.99 + 0.01).float()
        else:
            t = _random(shape, gen)
            out[name] = t.float() if dtype == "F32" else t
    torch.manual_seed(spec.seed)
    vision_cfg = {k: v for k, v in config["vision_config"].items() if k != "model_type"}
    visual = Qwen3_5VisionModel(Qwen3_5VisionConfig(**vision_cfg))
    for name, t in visual.state_dict().items():
        out["model.visual." + name] = t.detach().to(torch.bfloat16).contiguous()
    return out


def _assign_shards(names: list[str], spec: TinySpec, config: dict[str, Any]) -> dict[str, int]:
    """Shard number per tensor: main tensors spread in order; MTP split over first and last shard."""
    count = spec.shards
    is_mtp = resolve(config).is_mtp
    main = [n for n in names if not is_mtp(n)]
    mtp = [n for n in names if is_mtp(n)]
    where = {n: min(count - 1, i * count // max(1, len(main))) for i, n in enumerate(main)}
    for n in mtp:
        # Like Qwen3.5-4B: the MTP MLP sits in the first shard, the rest in the last.
        where[n] = 0 if (count > 1 and ".mlp." in n) else count - 1
    return where


def _nextn_shards(names: list[str], spec: TinySpec, config: dict[str, Any]) -> dict[str, int]:
    """The published layout of the families beyond Qwen: the trunk over the first shards in order, the whole MTP
    alone in the last one (DeepSeek-V3), or in ``spec.mtp_file`` (-1; GLM-4.6 / 4.7's ``mtp.safetensors``)."""
    is_mtp = resolve(config).is_mtp
    main = [n for n in names if not is_mtp(n)]
    trunk = spec.shards if spec.mtp_file is not None else max(1, spec.shards - 1)
    where = {n: min(trunk - 1, i * trunk // max(1, len(main))) for i, n in enumerate(main)}
    for n in names:
        if is_mtp(n):
            where[n] = -1 if spec.mtp_file is not None else spec.shards - 1
    return where


def vision_processor_configs(vision: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``preprocessor_config.json`` and ``video_preprocessor_config.json`` as the Qwen3.5 checkpoints on the Hub ship
    them (Qwen/Qwen3.5-2B-Base: transformers' ``Qwen3VLProcessor``, its image and video processors), the patch, merge
    and temporal sizes those of ``vision`` (the checkpoint's ``vision_config``). An engine that serves the wrapper
    architecture builds its multimodal processor from them even for text (SGLang 0.5.23 does not start without)."""
    sizes = {
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
    }
    return {
        "preprocessor_config.json": {
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            **sizes,
            "image_processor_type": "Qwen2VLImageProcessorFast",
        },
        "video_preprocessor_config.json": {
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
            **sizes,
            "video_processor_type": "Qwen3VLVideoProcessor",
        },
    }


def tiny_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on offline text shipped with CPython."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mtpquant.text.corpus import offline_corpus

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|bos|>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 4,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(offline_corpus(limit_chars=400_000), trainer=trainer)
    return tok


def _tokenizer_files(vocab_size: int) -> dict[str, str]:
    tok = tiny_tokenizer(vocab_size)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
    }
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


_CHECKPOINT_SUFFIXES = (".safetensors", ".json", ".md", ".txt", ".jinja")


def check_synthetic_replaceable(path: Path) -> None:
    """``--overwrite`` of the synthetic writers (tiny, skeleton, the trained tiny model) replaces only a checkpoint
    directory such as they write: ``config.json`` and nothing but a checkpoint's files (no subdirectory, no link);
    anything else is refused (exit 5), naming it."""
    from mtpquant.errors import OutputExistsError

    if path.is_symlink() or not path.is_dir():
        raise OutputExistsError(f"{path}: not a checkpoint directory; not replacing it")
    entries = sorted(path.iterdir())
    odd = [p.name for p in entries if p.is_symlink() or not p.is_file() or not p.name.endswith(_CHECKPOINT_SUFFIXES)]
    if entries and (odd or not (path / "config.json").is_file()):
        what = f"{odd[0]} is not a checkpoint file" if odd else "it has no config.json"
        raise OutputExistsError(f"{path}: not a checkpoint directory ({what}); not replacing it")


def make_tiny_checkpoint(
    out: Path | str, spec: TinySpec | str = "qwen3_5", *, overwrite: bool = False, tokenizer: bool = True
) -> Path:
    """Write a tiny checkpoint of ``spec`` (or a TINY_VARIANTS name) to ``out``; returns ``out``."""
    if isinstance(spec, str):
        spec = TINY_VARIANTS[spec]
    if spec.family not in {f.key for f in FAMILIES}:
        raise ValueError(f"unknown family {spec.family!r}")
    from mtpquant.synth.nextn import NEXTN_CONFIGS, nextn_tensors

    config = tiny_config(spec)
    nextn = spec.family in NEXTN_CONFIGS
    if nextn:
        tensors = nextn_tensors(spec.family, config, spec.seed, spec.copies)
    elif spec.family == "qwen4_exp":
        tensors = _qwen4_exp_tensors(spec, config)
    else:
        tensors = _disk_layout(spec, _main_state_dict(spec, config))
    if spec.mtp and not nextn:
        tensors |= _mtp_tensors(spec, config)
    names = sorted(tensors)
    where = _nextn_shards(names, spec, config) if nextn else _assign_shards(names, spec, config)
    count = spec.shards
    with OutputDir(Path(out), overwrite=overwrite, replace_check=check_synthetic_replaceable) as od:
        for i in range(count):
            if count == 1:
                shard = SINGLE_NAME
            elif spec.naming == "qwen":
                shard = f"model.safetensors-{i + 1:05d}-of-{count:05d}.safetensors"
            else:
                shard = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            od.write_shard(shard, [planned(n, tensors[n]) for n in names if where[n] == i], {"format": "pt"})
        if spec.mtp_file is not None:
            od.write_shard(spec.mtp_file, [planned(n, tensors[n]) for n in names if where[n] == -1], {"format": "pt"})
        if count > 1 or spec.mtp_file is not None:
            od.write_index()
        od.write_json("config.json", config)
        od.write_json("generation_config.json", {"eos_token_id": 2, "do_sample": False})
        if tokenizer:
            for fname, text in _tokenizer_files(spec.vocab_size).items():
                od.write_text(fname, text)
        return od.finalize()
