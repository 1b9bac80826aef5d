"""Train a tiny Qwen3.5 dense model together with its MTP layer, on CPU, seeded and reproducible.

The main model is transformers' ``Qwen3_5ForConditionalGeneration`` built from a tiny config in the
real layout (``mtpquant.synth.tiny``: wrapper config, tiny vision tower, real head dims 256/128).
The MTP layer is ``mtpquant.mtp.module.MtpLayer`` itself, so the trained weights are exactly what
the engines (and ``mtpquant validate``) compute with. Objective, per window of T tokens:

- main: cross-entropy of ``lm_head(h_t)`` against ``x_{t+1}``;
- MTP (auxiliary, weight ``mtp_weight``): cross-entropy of ``lm_head(MTP(h_t, embed(x_{t+1})))``
  against ``x_{t+2}``, with ``h_t`` the post-final-norm hidden state. Gradients flow into the
  trunk (as in Qwen's and DeepSeek's joint MTP training); embeddings and ``lm_head`` are shared.

The vision tower is never trained (no images); it is saved as initialised, in BF16 like real
checkpoints. Only ``scripts/train_tiny_mtp.py`` and tests call this module.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mtpquant.checkpoint.dtypes import planned
from mtpquant.checkpoint.index import SINGLE_NAME
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.mtp.module import MtpConfig, MtpLayer
from mtpquant.synth.tiny import TinySpec, _assign_shards, check_synthetic_replaceable, tiny_config, tiny_tokenizer

__all__ = ["TINY_MTP_ASSET", "TrainResult", "TrainSpec", "load_history", "train_tiny_mtp", "trained_config"]

log = logging.getLogger(__name__)

# The trained checkpoint shipped with the package (scripts/train_tiny_mtp.py writes it).
TINY_MTP_ASSET = Path(__file__).resolve().parent.parent / "assets" / "tiny-qwen3_5-mtp"

# Real Qwen3.5 checkpoints keep the Gated DeltaNet A_log and gated norm in float32 (as synth.tiny).
_KEEP_F32 = (".linear_attn.A_log", ".linear_attn.norm.weight")


@dataclass(frozen=True)
class TrainSpec:
    """What to train and how; every field is recorded in the asset's ``training.json``."""

    hidden_size: int = 128
    intermediate_size: int = 384
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


def trained_config(spec: TrainSpec) -> dict[str, Any]:
    """The wrapper ``config.json`` of the trained model (synth.tiny's layout with the spec's sizes)."""
    cfg = tiny_config(TinySpec("qwen3_5", shards=spec.shards, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size))
    cfg["text_config"]["intermediate_size"] = spec.intermediate_size
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


def _lr_at(step: int, spec: TrainSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _token_stream(tok: Any, docs: Sequence[tuple[str, str]], eos: int) -> torch.Tensor:
    ids: list[int] = []
    for _, text in docs:
        ids.extend(tok.encode(text).ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def _batch(stream: torch.Tensor, spec: TrainSpec, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - spec.seq_len, (spec.batch_size,), generator=gen)
    return torch.stack([stream[s : s + spec.seq_len] for s in starts.tolist()])


def _losses(model: Any, mtp: MtpLayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    lm = model.model.language_model
    h = lm(input_ids=x).last_hidden_state  # after the final norm
    logits = model.lm_head(h[:, :-1])
    V = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
    m, _ = mtp(h[:, :-2], lm.embed_tokens(x[:, 1:-1]))
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


def train_tiny_mtp(
    out: Path | str,
    train_docs: Sequence[tuple[str, str]],
    eval_docs: Sequence[tuple[str, str]],
    spec: TrainSpec | None = None,
    *,
    overwrite: bool = False,
) -> TrainResult:
    """Train and write the checkpoint (BF16 safetensors, index, configs, tokenizer) to ``out``."""
    import transformers

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
    hf_config = transformers.Qwen3_5Config.from_dict(copy.deepcopy(config))
    model = transformers.Qwen3_5ForConditionalGeneration(hf_config).float()
    mtp = MtpLayer(MtpConfig.from_text_config(config)).float()
    with torch.no_grad():
        std = float(getattr(hf_config.text_config, "initializer_range", 0.02))
        for p in mtp.parameters():
            if p.dim() == 2:  # match the trunk's initializer (transformers: normal, std 0.02)
                p.normal_(0.0, std)
    lm = model.model.language_model
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
    bar = tqdm(range(spec.steps), desc="train tiny MTP", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, spec)
        main, aux, _ = _losses(model, mtp, _batch(train_stream, spec, gen))
        loss = main + spec.mtp_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        opt.step()
        bar.set_postfix(main=f"{main.item():.3f}", mtp=f"{aux.item():.3f}")
        if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
            history.append(_evaluate(model, mtp, eval_batches, step + 1, time.perf_counter() - t0))
            model.train()
            mtp.train()

    seconds = time.perf_counter() - t0
    cpu_seconds = time.process_time() - c0
    path = _save(out, model, mtp, config, tok, spec, history, seconds, cpu_seconds, overwrite=overwrite)
    return TrainResult(path, seconds, cpu_seconds, history)


def _evaluate(model: Any, mtp: MtpLayer, batches: list[torch.Tensor], step: int, elapsed: float) -> dict[str, float]:
    model.eval()
    mtp.eval()
    sums: dict[str, float] = {}
    with torch.no_grad():
        for x in batches:
            main, aux, stats = _losses(model, mtp, x)
            for k, v in {"main_loss": main.item(), "mtp_loss": aux.item(), **stats}.items():
                sums[k] = sums.get(k, 0.0) + v / len(batches)
    record = {"step": float(step), "seconds": round(elapsed, 1), **{k: round(v, 4) for k, v in sums.items()}}
    log.info("held-out @%d: %s", step, record)
    return record


def _save(
    out: Path | str,
    model: Any,
    mtp: MtpLayer,
    config: dict[str, Any],
    tok: Any,
    spec: TrainSpec,
    history: list[dict[str, float]],
    seconds: float,
    cpu_seconds: float,
    *,
    overwrite: bool,
) -> Path:
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        dtype = torch.float32 if name.endswith(_KEEP_F32) else torch.bfloat16
        tensors[name] = t.detach().to(dtype).contiguous()
    for name, t in mtp.state_dict().items():
        tensors["mtp." + name] = t.detach().to(torch.bfloat16).contiguous()
    names = sorted(tensors)
    where = _assign_shards(names, TinySpec("qwen3_5", shards=spec.shards))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
    }
    with OutputDir(Path(out), overwrite=overwrite, replace_check=check_synthetic_replaceable) as od:
        for i in range(spec.shards):
            shard = SINGLE_NAME if spec.shards == 1 else f"model-{i + 1:05d}-of-{spec.shards:05d}.safetensors"
            od.write_shard(shard, [planned(n, tensors[n]) for n in names if where[n] == i], {"format": "pt"})
        if spec.shards > 1:
            od.write_index()
        od.write_json("config.json", config)
        od.write_json("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
        od.write_text("tokenizer.json", tok.to_str())
        od.write_json("tokenizer_config.json", tok_config)
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
                "note": "trained by scripts/train_tiny_mtp.py; held-out text: mtpquant.validate.prompts",
            },
        )
        return od.finalize()


def load_history(path: Path) -> list[dict[str, float]]:
    """The held-out history recorded in a trained checkpoint's ``training.json``."""
    return list(json.loads((path / "training.json").read_text())["history"])
