"""heal's training data: calibration prompts continued by the quantized target itself, with its hidden states.

The prompts are rows of the calibration text (``convert.calibration``: the model's own tokenizer and chat template;
the offline corpus without the documents validate holds out, so the held-out check never sees training text), cut
from spread-out places of the token stream. The quantized target continues each prompt, greedily or at the serving
temperature, and one more causal pass gives its post-final-norm hidden states (and, where the family's MTP reads
another tensor, that one: Qwen4-Exp's multi-stream state before the final hyper-connection mixer, as vLLM feeds its
drafter). Each batch of sequences is written at once as a shard (``data-NNNNN.safetensors``: ``tokens`` int64
``[b, T]``, ``hidden`` ``[b, T, H]``, Qwen4-Exp also ``mtp_input`` ``[b, T, hc_count * H]``), so memory holds one
batch; training reads the sequences it needs from the shards (``HealData.batch``).

What training needs from a sequence is all in the shard: row t's input is ``(m_t, embed(x_{t+1}))`` with ``m_t``
the MTP's hidden input (``h_t``, or the multi-stream state), and the target's own distribution for ``x_{t+2}`` is
``softmax(lm_head(h_{t+1}))``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mtpquant.checkpoint.dtypes import planned
from mtpquant.checkpoint.writer import atomic_write_safetensors
from mtpquant.errors import CalibrationDataError
from mtpquant.heal.options import SAMPLED, HealSizes

if TYPE_CHECKING:
    from mtpquant.checkpoint.source import CheckpointSource

__all__ = ["DATA_FORMAT", "HealBatch", "HealData", "collect", "continue_prompts", "training_data", "training_prompts"]

log = logging.getLogger(__name__)

DATA_FORMAT = "mtpquant.heal-data/1"
# Prompts are every SPREAD-th row of the calibration stream, so they come from many documents, not the first few.
SPREAD = 4


def training_prompts(tokenizer: Any, data: str, samples: int, prompt_len: int, vocab: int) -> tuple[Tensor, str]:
    """``[samples, prompt_len]`` prompt tokens from the calibration text ``data`` and its description."""
    from mtpquant.text.calibration import build_calibration_data
    from mtpquant.text.prompts import held_out_documents

    held_out = frozenset(name for name, _ in held_out_documents())
    cal = build_calibration_data(tokenizer, data, samples * SPREAD, prompt_len, exclude=held_out)
    rows = cal.input_ids[::SPREAD] if cal.samples >= samples * SPREAD else cal.input_ids
    rows = rows[:samples].contiguous()
    if int(rows.max()) >= vocab:
        raise CalibrationDataError(f"the tokenizer produced id {int(rows.max())}; the vocabulary has {vocab} entries")
    if rows.shape[0] < samples:
        log.warning("heal data: %d prompts of %d tokens instead of %d", rows.shape[0], prompt_len, samples)
    return rows, cal.source


def continue_prompts(target: Any, prompts: Tensor, new_tokens: int, temperature: float | None,
                     generator: torch.Generator) -> Tensor:
    """``prompts`` ``[B, P]`` followed by ``new_tokens`` of the target's: greedy (``temperature`` None) or sampled
    at ``temperature`` with ``generator`` (on the CPU, so a seed gives the same tokens on any device)."""
    if temperature is None:
        tokens: Tensor = target.greedy(prompts, new_tokens)
        return tokens
    model = target.model
    ids = prompts.to(target.input_device)
    out_tokens = [ids.cpu()]

    def draw(logits: Tensor) -> Tensor:
        probs = torch.softmax(logits[:, -1].float().cpu() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)

    with torch.no_grad():
        out: Any = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        nxt = draw(out.logits)
        for _ in range(new_tokens - 1):
            out_tokens.append(nxt)
            out = model(input_ids=nxt.to(target.input_device), past_key_values=out.past_key_values, use_cache=True,
                        logits_to_keep=1)
            nxt = draw(out.logits)
        out_tokens.append(nxt)
    return torch.cat(out_tokens, dim=1)


@dataclass(frozen=True)
class HealBatch:
    """Sequences read from the shards: ``tokens`` ``[b, T]``, the LM head's input ``hidden`` ``[b, T, H]``, and the
    MTP's hidden input where it is another tensor (``mtp_input``, Qwen4-Exp ``[b, T, hc_count * H]``; else None)."""

    tokens: Tensor
    hidden: Tensor
    mtp_input: Tensor | None = None

    @property
    def mtp_hidden(self) -> Tensor:
        """The MTP's hidden input at every position."""
        return self.hidden if self.mtp_input is None else self.mtp_input


@dataclass(frozen=True)
class HealData:
    """The sequences the target produced and its hidden states over them, in shards under ``directory``."""

    directory: Path
    shards: tuple[str, ...]
    rows: tuple[int, ...]  # sequences per shard
    seq_len: int
    prompt_len: int
    hidden_size: int
    greedy: int  # sequences continued greedily
    sampled: int  # sequences continued at the temperature
    temperature: float
    source: str  # where the prompts came from
    mtp_input: bool = False  # the shards hold the MTP's own hidden input (``mtp_input``) beside ``hidden``

    @property
    def sequences(self) -> int:
        """Number of sequences."""
        return sum(self.rows)

    @property
    def tokens(self) -> int:
        """Number of tokens over all sequences."""
        return self.sequences * self.seq_len

    @property
    def nbytes(self) -> int:
        """Bytes of the shards on disk."""
        return sum((self.directory / s).stat().st_size for s in self.shards)

    def locate(self, index: int) -> tuple[str, int]:
        """(shard, row) of sequence ``index``."""
        for shard, n in zip(self.shards, self.rows):
            if index < n:
                return shard, index
            index -= n
        raise IndexError(index)

    def batch(self, indices: Sequence[int], device: torch.device | str = "cpu") -> HealBatch:
        """The sequences ``indices``, read from the shards."""
        from safetensors import safe_open

        where: dict[str, list[tuple[int, int]]] = {}
        for pos, index in enumerate(indices):
            shard, row = self.locate(index)
            where.setdefault(shard, []).append((pos, row))
        keys = ("tokens", "hidden", "mtp_input") if self.mtp_input else ("tokens", "hidden")
        rows: dict[str, list[Tensor | None]] = {key: [None] * len(indices) for key in keys}
        for shard, picks in where.items():
            with safe_open(str(self.directory / shard), framework="pt") as fh:
                slices = {key: fh.get_slice(key) for key in keys}
                for pos, row in picks:
                    for key in keys:
                        rows[key][pos] = slices[key][row : row + 1]
        tensors = {key: torch.cat([t for t in got if t is not None]).to(device) for key, got in rows.items()}
        return HealBatch(**tensors)


def collect(
    target: Any,
    prompts: Tensor,
    *,
    new_tokens: int,
    temperature: float,
    sampled: float,
    seed: int,
    batch_size: int,
    directory: Path,
    source: str,
    progress: bool = True,
) -> HealData:
    """Continue every prompt with the target (the first ``1 - sampled`` of them greedily, the rest at
    ``temperature``), take its hidden states over the sequences and write them in shards to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    n = int(prompts.shape[0])
    n_sampled = round(n * sampled)
    n_greedy = n - n_sampled
    generator = torch.Generator().manual_seed(seed)
    shards: list[str] = []
    rows: list[int] = []
    hidden_size = 0
    with_mtp_input = False
    with tqdm(total=n, desc="heal data", unit="seq", disable=not progress) as bar:
        for kind, lo, hi in (("greedy", 0, n_greedy), ("sampled", n_greedy, n)):
            for start in range(lo, hi, batch_size):
                batch = prompts[start : min(start + batch_size, hi)]
                temp = None if kind == "greedy" else temperature
                tokens = continue_prompts(target, batch, new_tokens, temp, generator).cpu()
                head, mtp_input = target.hidden_states(tokens)
                hidden = head.cpu()
                hidden_size = int(hidden.shape[-1])
                name = f"data-{len(shards) + 1:05d}.safetensors"
                meta = {"format": DATA_FORMAT, "kind": kind, "prompt_len": str(int(prompts.shape[1]))}
                tensors = [planned("tokens", tokens.contiguous()), planned("hidden", hidden.contiguous())]
                if mtp_input is not None:
                    tensors.append(planned("mtp_input", mtp_input.cpu().contiguous()))
                    with_mtp_input = True
                atomic_write_safetensors(directory / name, tensors, meta)
                shards.append(name)
                rows.append(int(tokens.shape[0]))
                bar.update(int(tokens.shape[0]))
    data = HealData(
        directory,
        tuple(shards),
        tuple(rows),
        int(prompts.shape[1]) + new_tokens,
        int(prompts.shape[1]),
        hidden_size,
        n_greedy,
        n_sampled,
        temperature,
        source,
        mtp_input=with_mtp_input,
    )
    log.info("heal data: %s", json.dumps({"sequences": data.sequences, "tokens": data.tokens, "shards": len(shards)}))
    return data


def training_data(
    target: Any,
    source: CheckpointSource,
    vocab: int,
    data: str,
    samples: int,
    sizes: HealSizes,
    *,
    temperature: float,
    seed: int,
    directory: Path,
    progress: bool = True,
) -> HealData:
    """The training data: ``samples`` prompts of the calibration text ``data`` (tokenized with ``source``'s tokenizer,
    of ``vocab`` entries) continued by the target (``SAMPLED`` of them at ``temperature``), in shards under
    ``directory``."""
    from mtpquant.text.calibration import load_tokenizer

    tokenizer = load_tokenizer(source.local_dir(["*.safetensors", "*.bin", "*.pt", "*.pth"]))
    prompts, described = training_prompts(tokenizer, data, samples, sizes.prompt_len, vocab)
    return collect(
        target, prompts, new_tokens=sizes.new_tokens, temperature=temperature, sampled=SAMPLED, seed=seed,
        batch_size=sizes.batch_prompts, directory=directory, source=described, progress=progress,
    )
