"""Train a tiny model together with its MTP layer, on CPU, seeded and reproducible: Qwen3.5 dense (the shipped
``tiny-qwen3_5-mtp``), Qwen3.5-MoE (``tiny-qwen3_5_moe-mtp``: 4 narrow routed experts and a shared expert in every
layer and in the MTP, ``_MOE_SIZES``), Qwen3.8-Flash-Next (``tiny-qwen4_exp-mtp``, ``TrainSpec.family =
"qwen4_exp"``) or the GLM-4.5 layout (``tiny-glm4_moe-mtp``: transformers' ``Glm4MoeForCausalLM`` in
``synth.nextn``'s tiny layout, the MTP ``mtp.nextn.NextnMtp``, written as ``model.layers.{N}`` in ``mtp.safetensors``,
experts per expert).

The main model is transformers' ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` /
``Qwen4ExpForConditionalGeneration`` built from a tiny config in the real layout (``mtpquant.synth.tiny`` /
``synth.qwen4_exp``: wrapper config, tiny vision tower, the family's real head dims). The MTP is the family's
reference forward itself (``mtp.module.MtpLayer``, ``mtp.qwen4_exp.Qwen4ExpMtp``), so the trained weights are exactly
what the engines (and ``mtpquant validate``) compute with. Objective, per window of T tokens:

- main: cross-entropy of ``lm_head(h_t)`` against ``x_{t+1}``;
- MTP (auxiliary, weight ``mtp_weight``): cross-entropy of ``lm_head(MTP(h_t, embed(x_{t+1})))``
  against ``x_{t+2}``, with ``h_t`` the MTP's hidden input (Qwen3.5: the post-final-norm hidden state; Qwen4-Exp:
  the multi-stream state before the final hyper-connection mixer). Gradients flow into the
  trunk (as in Qwen's and DeepSeek's joint MTP training); embeddings and ``lm_head`` are shared.

Qwen4-Exp's QSA indexer selects every visible token while a row sees no more than ``indexer_budget`` tokens
(transformers' per-row loop then returns the attention mask itself); training windows are far below the budget, so
the indexers are bypassed during training (``_all_visible``) instead of looping over every row.

The vision tower is never trained (no images); it is saved as initialised, in BF16 like real
checkpoints. ``scripts/train_tiny_mtp.py`` trains (and rebuilds the shipped assets); the rest of mtpquant reads only
where those assets are (``TINY_MTP_ASSET``, ``TINY_MTP_ASSETS``: the demo, ``mtpquant.api``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mtpquant.checkpoint.dtypes import planned
from mtpquant.checkpoint.index import SINGLE_NAME
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.families import family, resolve
from mtpquant.mtp.module import MtpConfig, MtpLayer
from mtpquant.mtp.names import checkpoint_name
from mtpquant.mtp.schedule import warmup_cosine
from mtpquant.synth.tiny import (
    TinySpec,
    _assign_shards,
    _nextn_shards,
    check_synthetic_replaceable,
    tiny_config,
    tiny_tokenizer,
    vision_processor_configs,
)

__all__ = [
    "TINY_MTP_ASSET",
    "TINY_MTP_ASSETS",
    "TrainResult",
    "TrainSpec",
    "train_tiny_mtp",
    "trained_config",
]

log = logging.getLogger(__name__)

# The trained checkpoints shipped with the package (scripts/train_tiny_mtp.py writes them), by family.
_ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_MTP_ASSETS = {
    key: _ASSETS / f"tiny-{key}-mtp" for key in ("qwen3_5", "qwen3_5_moe", "qwen4_exp", "glm4_moe", "deepseek_v3")
}
TINY_MTP_ASSET = TINY_MTP_ASSETS["qwen3_5"]  # the default (demo, skeleton tokenizer)

# Real Qwen3.5 checkpoints keep the Gated DeltaNet A_log and gated norm in float32 (as synth.tiny).
_KEEP_F32 = (".linear_attn.A_log", ".linear_attn.norm.weight")


@dataclass(frozen=True)
class TrainSpec:
    """What to train and how; every field is recorded in the asset's ``training.json``."""

    family: str = "qwen3_5"  # qwen3_5 | qwen3_5_moe | qwen4_exp | glm4_moe | deepseek_v3
    hidden_size: int = 128
    intermediate_size: int = 384  # qwen3_5 (dense MLP); qwen4_exp keeps synth.qwen4_exp's tiny expert sizes
    vocab_size: int = 2048
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    mtp_weight: float = 1.0
    seed: int = 0
    threads: int = 2
    eval_every: int = 200
    shards: int = 2


FAMILIES = tuple(TINY_MTP_ASSETS)
# The appended-layer families trained here, in synth.nextn's tiny layout (GLM-4.7-style: the MTP in its own file)
# DeepSeek-V3's layout: MLA, the MTP (with its head and embedding copies, which its drafter loads) in the last shard
_NEXTN = {
    "glm4_moe": TinySpec("glm4_moe", shards=2, copies=False, mtp_file="mtp.safetensors"),
    "deepseek_v3": TinySpec("deepseek_v3", shards=2),
}
# The head / embedding copy a DeepSeek MTP layer carries (COPIES), from the trunk tensor it copies
_COPY_OF = {"shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "model.embed_tokens.weight"}
# Qwen3.5-MoE's experts: synth.tiny's 4 (top 2), twice its width, so a token's routed + shared MLP width (2 x 128 +
# 128) is the dense model's intermediate_size (384)
_MOE_SIZES = {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
# The Qwen3.5 wrapper layout (VL wrapper, processor files): transformers' config and model class per family
_QWEN3_5 = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}


def _tiny_spec(spec: TrainSpec) -> TinySpec:
    return _NEXTN.get(spec.family, TinySpec(spec.family, shards=spec.shards))


def trained_config(spec: TrainSpec) -> dict[str, Any]:
    """The wrapper ``config.json`` of the trained model (synth.tiny's layout with the spec's sizes)."""
    if spec.family not in FAMILIES:
        raise ValueError(f"family {spec.family!r} is not one of {', '.join(FAMILIES)}")
    if spec.family in _NEXTN:
        sizes = (("vocab_size", spec.vocab_size), ("hidden_size", spec.hidden_size), ("pad_token_id", 0))
        return tiny_config(dataclasses.replace(_NEXTN[spec.family], overrides=sizes))
    tiny = TinySpec(spec.family, shards=spec.shards, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size)
    cfg = tiny_config(tiny)
    if spec.family == "qwen3_5":
        cfg["text_config"]["intermediate_size"] = spec.intermediate_size
    elif spec.family == "qwen3_5_moe":
        cfg["text_config"] |= _MOE_SIZES
    else:  # narrower gated-DeltaNet heads than synth.qwen4_exp's tiny (128, for vLLM's CPU kernel): a quarter the work
        cfg["text_config"] |= {"linear_key_head_dim": 64, "linear_value_head_dim": 64}
    cfg["text_config"]["bos_token_id"] = 1
    cfg["text_config"]["pad_token_id"] = 0
    return cfg


@dataclass(frozen=True)
class TrainResult:
    """Where the checkpoint went, how long it took and the final held-out numbers."""

    path: Path
    seconds: float
    cpu_seconds: float
    history: list[dict[str, float]]


def _token_stream(tok: Any, docs: Sequence[tuple[str, str]], eos: int) -> torch.Tensor:
    ids: list[int] = []
    for _, text in docs:
        ids.extend(tok.encode(text).ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def _batch(stream: torch.Tensor, spec: TrainSpec, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - spec.seq_len, (spec.batch_size,), generator=gen)
    return torch.stack([stream[s : s + spec.seq_len] for s in starts.tolist()])


def _language_model(model: Any) -> Any:
    """The text tower: under the wrapper's ``language_model`` (Qwen) or the causal LM's ``model`` (GLM)."""
    return getattr(model.model, "language_model", model.model)


def _mtp_input(model: Any, x: torch.Tensor, source: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The language model's final hidden state (the LM head's input) and the MTP's hidden input over ``x``."""
    lm = _language_model(model)
    if source is None:
        h = lm(input_ids=x, use_cache=False).last_hidden_state  # after the final norm
        return h, h
    seen: list[torch.Tensor] = []
    handle = getattr(lm, source).register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        h = lm(input_ids=x, use_cache=False).last_hidden_state
    finally:
        handle.remove()
    return h, seen[-1]


def _losses(
    model: Any, mtp: Any, x: torch.Tensor, source: str | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    lm = _language_model(model)
    h, h_mtp = _mtp_input(model, x, source)
    logits = model.lm_head(h[:, :-1])
    V = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
    m = mtp.step(h_mtp[:, :-2], lm.embed_tokens(x[:, 1:-1])).out
    mtp_logits = model.lm_head(m)
    aux = F.cross_entropy(mtp_logits.reshape(-1, V), x[:, 2:].reshape(-1))
    with torch.no_grad():
        main_pred = logits.argmax(-1)
        # MTP top-1 against the text, and against what the target itself would say at t+1.
        stats = {
            "main_acc": float((main_pred == x[:, 1:]).float().mean()),
            "mtp_acc": float((mtp_logits.argmax(-1) == x[:, 2:]).float().mean()),
            "mtp_vs_target": float((mtp_logits.argmax(-1) == main_pred[:, 1:]).float().mean()),
        }
    return main, aux, stats


def _all_visible(
    indexer: Any, hidden_states: Any, position_embeddings: Any, attention_mask: Any, past_key_values: Any
) -> Any:
    """Qwen4-Exp's QSA indexer for rows that see at most ``indexer_budget`` tokens: every visible token (its cache
    still gets the raw keys, as ``Qwen4ExpTextQSAIndexer.forward`` stores them)."""
    del position_embeddings
    if past_key_values is not None:
        width = indexer.index_n_heads * indexer.index_head_dim
        keys = indexer.index_qk_proj(hidden_states)[..., width:]
        past_key_values.update_indexer(keys.reshape(*keys.shape[:2], indexer.index_head_dim), indexer.layer_idx)
    return attention_mask


@contextlib.contextmanager
def _indexers_select_all(modules: Sequence[Any], seq_len: int) -> Iterator[None]:
    """Bypass every QSA indexer under ``modules`` while training windows of ``seq_len`` tokens fit its budget."""
    indexers = [m for root in modules for m in root.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer"]
    if any(seq_len > m.token_budget for m in indexers):
        raise ValueError(f"seq_len {seq_len} exceeds the QSA budget: the indexer would select, not pass through")
    for m in indexers:
        m.forward = functools.partial(_all_visible, m)
    try:
        yield
    finally:
        for m in indexers:
            del m.forward


def _build(spec: TrainSpec, config: dict[str, Any]) -> tuple[Any, Any]:
    """The family's transformers model (float32) and its reference MTP, initialised like the trunk."""
    import transformers

    if spec.family in _NEXTN:
        from mtpquant.mtp.nextn import NextnMtp

        skip = ("architectures", "model_type", "dtype", "num_nextn_predict_layers")
        hf_config: Any = transformers.CONFIG_MAPPING[spec.family](**{k: v for k, v in config.items() if k not in skip})
        model = getattr(transformers, config["architectures"][0])(hf_config).float()
        forward = family(spec.family).mtp.appended
        assert forward is not None
        mtp: Any = NextnMtp(config, forward, 1, "model.layers.", config["num_hidden_layers"]).float()
        with torch.no_grad():  # transformers' blocks outside a PreTrainedModel are not initialised: as the trunk
            for name, p in mtp.named_parameters():
                if p.dim() < 2:
                    p.fill_(0.0 if name.endswith(".bias") else 1.0)
            for name, b in mtp.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.zero_()
    elif spec.family == "qwen4_exp":
        from mtpquant.mtp.qwen4_exp import Qwen4ExpMtp

        hf_config = transformers.Qwen4ExpConfig.from_dict(copy.deepcopy(config))
        model = transformers.Qwen4ExpForConditionalGeneration(hf_config).float()
        mtp = Qwen4ExpMtp(config["text_config"], 1).float()
    else:
        prefix = _QWEN3_5[spec.family]
        hf_config = getattr(transformers, f"{prefix}Config").from_dict(copy.deepcopy(config))
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(hf_config).float()
        mtp = MtpLayer(MtpConfig.from_text_config(config)).float()
    with torch.no_grad():
        std = float(getattr(getattr(hf_config, "text_config", hf_config), "initializer_range", 0.02))
        for p in mtp.parameters():
            if p.dim() >= 2:  # match the trunk's initializer (transformers: normal, std 0.02)
                p.normal_(0.0, std)
    return model, mtp


def train_tiny_mtp(
    out: Path | str,
    train_docs: Sequence[tuple[str, str]],
    eval_docs: Sequence[tuple[str, str]],
    spec: TrainSpec | None = None,
    *,
    overwrite: bool = False,
) -> TrainResult:
    """Train and write the checkpoint (BF16 safetensors, index, configs, tokenizer) to ``out``."""

    spec = spec or TrainSpec()
    torch.manual_seed(spec.seed)
    torch.set_num_threads(spec.threads)
    # Denormals appear in tiny Adam updates and make CPU kernels crawl.
    torch.set_flush_denormal(True)
    t0 = time.perf_counter()
    c0 = time.process_time()

    tok = tiny_tokenizer(spec.vocab_size)
    eos = tok.token_to_id("<|endoftext|>")
    train_stream = _token_stream(tok, train_docs, eos)
    eval_stream = _token_stream(tok, eval_docs, eos)
    log.info("tokens: train %d, held-out %d", train_stream.numel(), eval_stream.numel())

    config = trained_config(spec)
    model, mtp = _build(spec, config)
    source = family(spec.family).mtp.hidden_source  # where the MTP reads the trunk (None: after the final norm)
    lm = _language_model(model)
    if hasattr(model.model, "visual"):
        model.model.visual.requires_grad_(False)
    params = [*lm.parameters(), *model.lm_head.parameters(), *mtp.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(spec.seed)
    eval_gen = torch.Generator().manual_seed(spec.seed + 1)
    eval_batches = [_batch(eval_stream, spec, eval_gen) for _ in range(4)]

    history: list[dict[str, float]] = []
    model.train()
    mtp.train()
    with _indexers_select_all([model, mtp], spec.seq_len):
        bar = tqdm(range(spec.steps), desc="train tiny MTP", unit="step")
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = warmup_cosine(
                    step, steps=spec.steps, peak=spec.lr, warmup=spec.warmup_steps, min_ratio=spec.min_lr_ratio
                )
            main, aux, _ = _losses(model, mtp, _batch(train_stream, spec, gen), source)
            loss = main + spec.mtp_weight * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
            opt.step()
            bar.set_postfix(main=f"{main.item():.3f}", mtp=f"{aux.item():.3f}")
            if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
                history.append(_evaluate(model, mtp, eval_batches, source, step + 1, time.perf_counter() - t0))
                model.train()
                mtp.train()

    seconds = time.perf_counter() - t0
    cpu_seconds = time.process_time() - c0
    path = _save(out, model, mtp, config, tok, spec, history, seconds, cpu_seconds, overwrite=overwrite)
    return TrainResult(path, seconds, cpu_seconds, history)


def _evaluate(
    model: Any, mtp: Any, batches: list[torch.Tensor], source: str | None, step: int, elapsed: float
) -> dict[str, float]:
    model.eval()
    mtp.eval()
    sums: dict[str, float] = {}
    with torch.no_grad():
        for x in batches:
            main, aux, stats = _losses(model, mtp, x, source)
            for k, v in {"main_loss": main.item(), "mtp_loss": aux.item(), **stats}.items():
                sums[k] = sums.get(k, 0.0) + v / len(batches)
    record = {"step": float(step), "seconds": round(elapsed, 1), **{k: round(v, 4) for k, v in sums.items()}}
    log.info("held-out @%d: %s", step, record)
    return record


def _save(
    out: Path | str,
    model: Any,
    mtp: Any,
    config: dict[str, Any],
    tok: Any,
    spec: TrainSpec,
    history: list[dict[str, float]],
    seconds: float,
    cpu_seconds: float,
    *,
    overwrite: bool,
) -> Path:
    tensors = _checkpoint_tensors(spec, model, config)
    tensors |= _layout({checkpoint_name(mtp, n): t for n, t in mtp.state_dict().items()}, spec.family in _NEXTN)
    layout = family(spec.family).mtp
    if layout.copies_required:  # the trained trunk's head and embedding, copied into each MTP layer as releases do
        for name in resolve(config).expected_mtp_shapes():
            leaf = next((c for c in layout.copies if name.endswith("." + c)), None)
            if leaf is not None and name not in tensors:
                tensors[name] = tensors[_COPY_OF[leaf]].clone()
    names = sorted(tensors)
    tiny = _tiny_spec(spec)
    where = (_nextn_shards if spec.family in _NEXTN else _assign_shards)(names, tiny, config)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
    }
    with OutputDir(Path(out), overwrite=overwrite, replace_check=check_synthetic_replaceable) as od:
        for i in range(tiny.shards):
            shard = SINGLE_NAME if tiny.shards == 1 else f"model-{i + 1:05d}-of-{tiny.shards:05d}.safetensors"
            od.write_shard(shard, [planned(n, tensors[n]) for n in names if where[n] == i], {"format": "pt"})
        if tiny.mtp_file is not None:
            od.write_shard(tiny.mtp_file, [planned(n, tensors[n]) for n in names if where[n] == -1], {"format": "pt"})
        if tiny.shards > 1 or tiny.mtp_file is not None:
            od.write_index()
        od.write_json("config.json", config)
        od.write_json("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
        od.write_text("tokenizer.json", tok.to_str())
        od.write_json("tokenizer_config.json", tok_config)
        if spec.family in _QWEN3_5:  # the Qwen3.5 layout's processor files (the engines build the VL processor)
            for name, processor in vision_processor_configs(config["vision_config"]).items():
                od.write_json(name, processor)
        od.write_json(
            "training.json",
            {
                "spec": asdict(spec),
                "seconds": round(seconds, 1),
                # Process CPU time over all threads: on a shared machine, cpu_seconds / threads is the
                # wall time the run would take with its cores to itself.
                "cpu_seconds": round(cpu_seconds, 1),
                "torch": torch.__version__,
                "history": history,
                "note": "trained by scripts/train_tiny_mtp.py; held-out text: mtpquant.text.prompts",
            },
        )
        return od.finalize()


def _layout(state: Mapping[str, torch.Tensor], nextn: bool) -> dict[str, torch.Tensor]:
    """Tensors as the checkpoint stores them: BF16; the appended-layer families' routers' correction bias in F32 and
    their fused experts one Linear per expert (``synth.nextn``)."""
    from mtpquant.synth.nextn import per_expert

    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        keep_f32 = nextn and name.endswith("e_score_correction_bias")
        t = t.detach().to(torch.float32 if keep_f32 else torch.bfloat16).contiguous()
        if nextn and t.dim() == 3 and ".experts." in name:
            out |= per_expert(name, t)
        else:
            out[name] = t
    return out


def _checkpoint_tensors(spec: TrainSpec, model: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The main model's tensors in the family's real checkpoint layout and dtypes (Qwen4-Exp: each PLE n-gram
    table as its ``shard_{i}`` row shards, int64 buffers, float32 A_log / gated norm, per ``synth.qwen4_exp``)."""
    state = model.state_dict()
    if spec.family in _NEXTN:
        return _layout(state, True)
    if spec.family != "qwen4_exp":
        return {
            name: t.detach().to(torch.float32 if name.endswith(_KEEP_F32) else torch.bfloat16).contiguous()
            for name, t in state.items()
        }
    from mtpquant.checkpoint.dtypes import torch_dtype
    from mtpquant.checkpoint.sharded import SHARD_INFIX
    from mtpquant.synth.qwen4_exp import main_tensors

    out: dict[str, torch.Tensor] = {}
    offsets: dict[str, int] = {}
    for name, shape, dtype in main_tensors(config):
        stem, sep, _ = name.rpartition(SHARD_INFIX)
        if sep:  # row shards of the table transformers holds concatenated
            start = offsets.get(stem, 0)
            t = state[f"{stem}.weight"][start : start + shape[0]]
            offsets[stem] = start + shape[0]
        else:
            t = state[name]
        if tuple(t.shape) != tuple(shape):
            raise RuntimeError(f"internal: {name} is {tuple(t.shape)} in the model, {shape} in the layout")
        out[name] = t.detach().to(torch_dtype(dtype)).contiguous()
    for name, t in state.items():
        if name.startswith("model.visual."):
            out[name] = t.detach().to(torch.bfloat16).contiguous()
    return out

