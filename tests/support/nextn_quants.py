"""The published quant layouts of the families beyond Qwen, on tiny configs (header-level: names, dtypes, shapes,
shards and metadata as published; tensor data zeros), for inspect's verdicts and the repairs inspect prints.

- ``deepseek-nvidia-fp4``: nvidia/DeepSeek-R1-FP4's layout: experts and MLPs NVFP4, attention BF16 and excluded,
  the MTP layer BF16 and excluded as ``model.layers.{N}*`` (ModelOpt's examples/deepseek/ptq.py);
- ``deepseek-mtp-lost``: the same quant without its MTP layer, still declared (AutoAWQ's DeepSeek-R1: "accepted
  tokens remains 0"; vllm#21874);
- ``deepseek-eh-proj-nvfp4``: the MTP quantized with the model, ``eh_proj`` included (vLLM builds it as a plain
  ``nn.Linear``);
- ``deepseek-mtp-nvfp4``: the MTP quantized but ``eh_proj``, the router and the head, those excluded by their
  checkpoint names (ModelOpt's summary: ``model.layers.{N}.shared_head*``), which vLLM's ``{layer}.head`` misses;
- ``glm5-next-one-prefix``: a GLM-5.3-Flash quant whose BF16 MTP is excluded as ``model.language_model.layers.N*``
  only (nvidia/GLM-5.3-Flash-NVFP4 needs ``model.layers.N*`` too: vLLM's draft strips the prefix);
- ``step-not-shipped``: a Step-3.5 NVFP4 quant whose config declares 3 MTP layers it did not ship
  (stepfun-ai/Step-3.7-Flash-NVFP4), and ``step-bf16``, the BF16 source with its 3 MTP layers;
- ``glm47-mtp-unindexed`` (from the tiny ``glm4_moe``, real bytes): GLM-4.7's ``mtp.safetensors`` left out of the
  index (a ModelOpt export, NVIDIA/Model-Optimizer#750).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.families import resolve
from mtpquant.synth.nextn import nextn_config
from tests.support.nextn_skeleton import (
    Planned,
    modelopt_nvfp4_metadata,
    nvfp4,
    shard_names,
    spread,
    trunk_and_mtp,
    write_layout,
)
from tests.support.skeleton import SkeletonTensor, modelopt_exclusions

__all__ = ["QUANT_KINDS", "STEP_CONFIG", "make_nextn_quant"]

QUANT_KINDS = (
    "deepseek-nvidia-fp4",
    "deepseek-mtp-lost",
    "deepseek-eh-proj-nvfp4",
    "deepseek-mtp-nvfp4",
    "glm5-next-one-prefix",
    "step-not-shipped",
    "step-bf16",
    "glm47-mtp-unindexed",
)
_TEXT = {k: v for k, v in nextn_config("glm4_moe").items() if k not in ("architectures", "model_type")}
STEP_CONFIG: dict[str, Any] = {
    "architectures": ["Step3p5ForCausalLM"],
    "model_type": "step3p5",
    **{k: v for k, v in _TEXT.items() if k not in ("first_k_dense_replace", "use_qk_norm", "attention_bias")},
    "num_nextn_predict_layers": 3,
}
_GLM5_NEXT: dict[str, Any] = {
    "architectures": ["Glm5NextForConditionalGeneration"],
    "model_type": "glm5_next",
    "text_config": {
        **{k: v for k, v in nextn_config("deepseek_v3").items() if k not in ("architectures", "model_type")},
        "model_type": "glm5_next_text",
        "pad_token_id": 0,
        "qk_rope_head_dim": 0,  # GLM-5.3-Flash's DSA attention is NoPE (transformers' Glm5NextTextConfig checks it)
        "qk_nope_head_dim": 96,
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 16,
        "index_share_for_mtp_iteration": True,
    },
}


def _mtp_quantized(m: str) -> bool:
    return not m.endswith((".mlp.gate", ".shared_head.head", "lm_head"))


def _deepseek(kind: str, out: Path) -> Path:
    config = nextn_config("deepseek_v3")
    n = config["num_hidden_layers"]
    trunk, mtp = trunk_and_mtp(config)
    main, quantized, plain = nvfp4(trunk, lambda m: ".mlp." in m and not m.endswith(".mlp.gate"))
    shards = shard_names(3)
    if kind == "deepseek-mtp-lost":
        mtp = []
    elif kind == "deepseek-eh-proj-nvfp4":
        mtp, q, _ = nvfp4(mtp, _mtp_quantized)
        quantized += q
    elif kind == "deepseek-mtp-nvfp4":
        mtp, q, mtp_plain = nvfp4(mtp, lambda m: _mtp_quantized(m) and not m.endswith(".eh_proj"))
        quantized += q
        plain += mtp_plain
    extra = [f"model.layers.{n}*"] if kind in ("deepseek-nvidia-fp4", "deepseek-mtp-lost") else []
    exclude = sorted({*modelopt_exclusions(["lm_head", *(p for p in plain if "layers." + str(n) not in p)], quantized),
                      *extra, *(modelopt_exclusions(plain, quantized) if kind == "deepseek-mtp-nvfp4" else [])})
    cfg, hfq = modelopt_nvfp4_metadata(config, exclude)
    tensors = spread(main, shards[:-1]) + [SkeletonTensor(name, d, s, shards[-1]) for name, d, s in mtp]
    if not mtp:
        tensors = spread(main, shards[:-1])
    return write_layout(out, cfg, tensors, hfq)


def _glm5_next(out: Path) -> Path:
    trunk, mtp = trunk_and_mtp(_GLM5_NEXT)
    main, quantized, plain = nvfp4(trunk, lambda m: ".mlp." in m and not m.endswith(".mlp.gate"))
    n = _GLM5_NEXT["text_config"]["num_hidden_layers"]
    attention = [p for p in plain if ".layers." + str(n) not in p]
    exclude = sorted({*modelopt_exclusions(["lm_head", *attention], quantized), f"model.language_model.layers.{n}*"})
    cfg, hfq = modelopt_nvfp4_metadata(_GLM5_NEXT, exclude)
    shards = shard_names(2)
    return write_layout(out, cfg, spread(main, shards[:1]) + [SkeletonTensor(x, d, s, shards[1]) for x, d, s in mtp],
                        hfq)


def _step(kind: str, out: Path) -> Path:
    trunk, mtp = trunk_and_mtp(STEP_CONFIG)
    shards = shard_names(2)
    if kind == "step-bf16":
        return write_layout(out, STEP_CONFIG, spread(trunk, shards[:1]) + spread(mtp, shards[1:]))
    main, quantized, plain = nvfp4(trunk, lambda m: ".mlp." in m and not m.endswith(".mlp.gate"))
    cfg, hfq = modelopt_nvfp4_metadata(STEP_CONFIG, modelopt_exclusions(["lm_head", *plain], quantized))
    return write_layout(out, cfg, spread(main, shards), hfq)


def _unindexed(tiny_glm4_moe: Path, out: Path) -> Path:
    shutil.copytree(tiny_glm4_moe, out, copy_function=shutil.copy)
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != "mtp.safetensors"}
    tensors = Checkpoint.open(tiny_glm4_moe).tensors  # total_size: the listed shards' bytes, as the export wrote it
    index["metadata"]["total_size"] = sum(tensors[k].nbytes for k in index["weight_map"])
    spec = resolve(json.loads((out / "config.json").read_text()))
    assert not any(spec.is_mtp(k) for k in index["weight_map"])
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return out


def make_nextn_quant(kind: str, out: Path, tiny_glm4_moe: Path | None = None) -> Path:
    """Write the quant layout ``kind`` (``QUANT_KINDS``) to ``out``; ``glm47-mtp-unindexed`` is made from the tiny
    ``glm4_moe`` checkpoint ``tiny_glm4_moe``."""
    if kind.startswith("deepseek-"):
        return _deepseek(kind, out)
    if kind == "glm5-next-one-prefix":
        return _glm5_next(out)
    if kind.startswith("step-"):
        return _step(kind, out)
    if kind == "glm47-mtp-unindexed":
        assert tiny_glm4_moe is not None
        return _unindexed(tiny_glm4_moe, out)
    raise ValueError(f"unknown quant layout {kind!r}")


def planned_names(planned: Planned) -> list[str]:
    """The names of planned tensors (for tests)."""
    return [name for name, _, _ in planned]
