"""Self-distillation of the MTP layer to the quantized target: only ``mtp.*`` weights train.

For row t of a sequence the layer sees what the engines feed it, ``(m_t, embed(x_{t+1}))`` with ``m_t`` the quantized
target's hidden state the family's MTP reads (Qwen3.5 / Qwen3-Next: post-final-norm ``h_t``; Qwen4-Exp: the
multi-stream state before the final hyper-connection mixer), and is trained so that its distribution for
``x_{t+2}``, ``softmax(lm_head(MTP(...)))``, matches the target's own, ``softmax(lm_head(h_{t+1}))``: the loss is
KL(target || MTP), summed over the vocabulary and averaged over rows. Trunk, embeddings and LM head are frozen (the
shared embedding and head are plain tensors here, never parameters). Every family's MTP trains through this one
path, by its ``step`` (``mtp.step.MtpForward``: ``mtp.module.MtpLayer``, ``mtp.qwen4_exp.Qwen4ExpMtp``).

``chain`` > 1 also trains the drafts after the first as the engines make them (``mtp.drafting.chain_logits``): step
j feeds the layer its own next-step hidden of step j - 1 (Qwen3.5: its post-norm output; Qwen4-Exp: its
multi-stream output) and the token ``x_{t+j}`` (the draft itself wherever the chain can still be accepted), at
position t + j - 1, attending to the teacher-forced rows up to t and to its own chain (with Qwen4-Exp's index
sharing: to the keys the first step's indexer selected for row t); its target is the target's distribution for
``x_{t+j+1}``. Gradients flow through the chain.

The KL over a large vocabulary is computed a chunk of rows at a time (the logits of a 248k vocabulary are ~1 MB a
row), with the layer's outputs detached in between, so memory holds one chunk of logits. Seeded: the order of the
sequences comes from a generator seeded by ``seed``; on the CPU the same inputs give the same weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.heal.data import HealData
from mtpquant.heal.plan import Schedule
from mtpquant.heal.precision import MtpStorage
from mtpquant.mtp.schedule import warmup_cosine
from mtpquant.mtp.step import MtpForward

__all__ = ["TrainLog", "chain_mask", "distill", "distill_loss", "train", "train_layer"]

log = logging.getLogger(__name__)

# Rows of [rows, vocab] logits computed at once (bounded memory for 248k-token vocabularies).
_KL_CHUNK_ROWS = 256


@dataclass(frozen=True)
class TrainLog:
    """What training did: the loss at its start and end (means over the first and last tenth), time, rows seen."""

    steps: int
    first_loss: float
    last_loss: float
    seconds: float
    rows: int  # MTP rows (positions x chain steps) the loss covered, over all steps


def chain_mask(rows: int, step: int, device: torch.device | str = "cpu") -> Tensor:
    """Attention mask ``[1, 1, rows, step * rows]`` of chain step ``step`` (2..k) over the keys of steps 1..step:
    row t sees the teacher-forced keys of rows <= t and its own keys of steps 2..step."""
    ar = torch.arange(rows, device=device)
    causal = ar[None, :] <= ar[:, None]
    diag = torch.eye(rows, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * (step - 1), dim=1)[None, None]


def _head_logits(x: Tensor, head: Tensor) -> Tensor:
    return F.linear(x.to(head.dtype), head).float()


def distill_loss(outputs: Tensor, teacher_hidden: Tensor, head: Tensor, *, chunk_rows: int = _KL_CHUNK_ROWS) -> Tensor:
    """Mean KL(target || MTP) over the rows of ``outputs`` ``[R, H]`` (the layer's, with their graph) against the
    target's hidden states ``[R, H]`` one position later; backpropagates into ``outputs``' graph and returns the loss
    value (detached). The logits exist one chunk of rows at a time."""
    rows = int(outputs.shape[0])
    detached = outputs.detach().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        with torch.no_grad():
            logp = torch.log_softmax(_head_logits(teacher_hidden[start:stop], head), dim=-1)
        logq = torch.log_softmax(_head_logits(detached[start:stop], head), dim=-1)
        kl = (logp.exp() * (logp - logq)).sum() / rows
        kl.backward()
        total += float(kl.detach())
    assert detached.grad is not None
    outputs.backward(detached.grad)
    return total


def _chain_outputs(
    layer: MtpForward,
    tokens: Tensor,
    hidden: Tensor,
    embed: Callable[[Tensor], Tensor],
    chain: int,
    mtp_hidden: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The layer's outputs for every trained (row, chain step) ``[R, H]`` and the target's hidden states one
    position after each (the teacher) ``[R, H]``; ``mtp_hidden``: the MTP's hidden input where it is not ``hidden``
    (Qwen4-Exp's multi-stream state)."""
    B, T, H = hidden.shape
    L = T - 1  # rows 0..T-2 draft (row T-1 has no next token)
    first = layer.step((hidden if mtp_hidden is None else mtp_hidden)[:, :-1], embed(tokens[:, 1:]))
    outputs = [first.out.reshape(-1, H)]
    teachers = [hidden[:, 1:].reshape(-1, H)]
    parts: list[Any] = []  # each chain step's own L cache rows
    shared = first.selection if layer.index_share else None  # step 1's token selection, reused by the chain
    positions = torch.arange(L, device=hidden.device)
    prev = first.next_hidden
    for j in range(2, chain + 1):
        valid = L - (j - 1)  # rows t <= T-1-j have a token x_{t+j} and a teacher h_{t+j}
        step_tokens = torch.zeros(B, L, dtype=tokens.dtype, device=tokens.device)
        step_tokens[:, :valid] = tokens[:, j : j + valid]
        mask = chain_mask(L, j, hidden.device).expand(B, 1, L, j * L)
        selection = None
        if shared is not None:  # the rows step 1 selected, none of the chain's (mtp.drafting.chain_logits)
            pad = torch.zeros(*shared.shape[:-1], (j - 1) * L, dtype=torch.bool, device=shared.device)
            selection = torch.cat((shared, pad), dim=-1)
        new = layer.step(prev, embed(step_tokens), positions + (j - 1), first.cache.cat(parts), mask, step=j - 1,
                         selection=selection)
        parts.append(new.cache.last(L))
        outputs.append(new.out[:, :valid].reshape(-1, H))
        teachers.append(hidden[:, j : j + valid].reshape(-1, H))
        prev = new.next_hidden
    return torch.cat(outputs), torch.cat(teachers)


def distill(
    layer: MtpForward,
    data: HealData,
    embed_weight: Tensor,
    head: Tensor,
    schedule: Schedule,
    *,
    device: torch.device,
    progress: bool = True,
) -> TrainLog:
    """Train ``layer``'s parameters (float32, on ``device``) to the target's distributions in ``data``."""
    module = cast(nn.Module, layer)
    params = [p for p in module.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(
        params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=schedule.weight_decay, foreach=False
    )
    dtype = next(iter(params)).dtype

    def embed(tokens: Tensor) -> Tensor:
        return F.embedding(tokens, embed_weight).to(dtype)

    generator = torch.Generator().manual_seed(schedule.seed)
    order: list[int] = []
    losses: list[float] = []
    rows = 0
    t0 = time.perf_counter()
    module.train()
    bar = tqdm(range(schedule.steps), desc="heal train", unit="step", disable=not progress)
    for step in bar:
        if len(order) < schedule.batch_size:
            order += torch.randperm(data.sequences, generator=generator).tolist()
        batch, order = order[: schedule.batch_size], order[schedule.batch_size :]
        rows_in = data.batch(batch, device)
        hidden = rows_in.hidden.to(dtype)
        mtp_hidden = None if rows_in.mtp_input is None else rows_in.mtp_input.to(dtype)
        lr = warmup_cosine(step, steps=schedule.steps, peak=schedule.lr, warmup=schedule.warmup,
                           min_ratio=schedule.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        outputs, teachers = _chain_outputs(layer, rows_in.tokens, hidden, embed, schedule.chain, mtp_hidden)
        loss = float(distill_loss(outputs, teachers, head))
        torch.nn.utils.clip_grad_norm_(params, schedule.grad_clip, foreach=False)
        opt.step()
        losses.append(loss)
        rows += int(outputs.shape[0])
        bar.set_postfix(kl=f"{loss:.4f}")
    module.eval()
    for p in params:
        p.requires_grad_(False)
    tenth = max(1, len(losses) // 10)
    result = TrainLog(
        schedule.steps,
        sum(losses[:tenth]) / tenth,
        sum(losses[-tenth:]) / tenth,
        time.perf_counter() - t0,
        rows,
    )
    log.info("heal training: KL %.4f -> %.4f over %d steps (%.1f s)", result.first_loss, result.last_loss,
             result.steps, result.seconds)
    return result


def train(
    quant: Checkpoint,
    src: Checkpoint,
    storage: MtpStorage,
    data: HealData,
    shared: tuple[Tensor, Tensor],
    schedule: Schedule,
    *,
    device: torch.device,
    progress: bool = True,
) -> tuple[dict[str, Tensor], TrainLog]:
    """The healed MTP weights (float32, on the CPU) by checkpoint name, and how training went: QUANT's MTP from its
    master weights (``precision.master_weights``) as the family's reference forward (``mtp.build.reference_mtp``;
    Qwen4-Exp's experts fused), with modelopt's fake quantization where QUANT stores it quantized (``qat``),
    distilled on ``data`` against the frozen embedding and LM head (``shared``)."""
    from mtpquant.heal.precision import master_weights

    master, _ = master_weights(quant, src, storage)
    return train_layer(quant.config, master, storage, data, shared, schedule, device=device, progress=progress)


def train_layer(
    config: Mapping[str, Any],
    master: dict[str, Tensor],
    storage: MtpStorage,
    data: HealData,
    shared: tuple[Tensor, Tensor],
    schedule: Schedule,
    *,
    device: torch.device,
    progress: bool = True,
) -> tuple[dict[str, Tensor], TrainLog]:
    """``train``'s work on the MTP weights ``master`` (float32, checkpoint names) of a model with ``config``, stored
    as ``storage`` says (each quantized Linear fake-quantized in its own format): also the precision search's heal of
    each finalist (``heal.finalists``). An appended-layer MTP (GLM / DeepSeek, the registry's ``MtpLayout.appended``)
    goes back as its whole state, buffers included, under the checkpoint's names, with the head and embedding copies
    it does not read kept from ``master``."""
    from mtpquant.families import resolve
    from mtpquant.heal.qat import quantize_for_training
    from mtpquant.mtp.build import reference_mtp
    from mtpquant.mtp.names import checkpoint_name
    from mtpquant.mtp.quantize import per_expert_weights

    appended = resolve(config).family.mtp.appended is not None  # as reference_mtp resolves it
    torch.manual_seed(schedule.seed)
    layer: Any = reference_mtp(config, master, dtype=torch.float32, device=device)
    embed, head = shared

    def calibrate(module: nn.Module) -> None:
        rows = data.batch(range(min(schedule.batch_size, data.sequences)), device)
        module(rows.mtp_hidden[:, :-1].float(), F.embedding(rows.tokens[:, 1:], embed).float())

    # every family's layer (Qwen's, the appended GLM / DeepSeek one) names QUANT's Linears through mtp.names
    quantize_for_training(cast(nn.Module, layer), storage, calibrate)
    log_ = distill(layer, data, embed, head, schedule, device=device, progress=progress)
    if appended:  # its weights under the checkpoint's names, experts per expert; the copies it does not read kept
        # the state (the router's correction bias is a buffer) without modelopt's quantizer state (amax)
        state = {checkpoint_name(layer, n): t.detach().float().cpu() for n, t in layer.state_dict().items()
                 if "_quantizer" not in n}
        trained = {n: t.contiguous() for n, t in per_expert_weights(state).items()}
        odd = sorted(set(trained) - set(master))
        if odd:
            raise RuntimeError(f"internal: the trained appended MTP has {odd[0]}, which the checkpoint has not")
        return {**master, **trained}, log_
    named = cast(nn.Module, layer).named_parameters()
    return {checkpoint_name(layer, n): p.detach().float().cpu() for n, p in named}, log_
