"""heal's training data: calibration prompts continued by the quantized target itself, with its hidden states.

The prompts are rows of the calibration text (``convert.calibration``: the model's own tokenizer and chat template;
the offline corpus without the documents validate holds out, so the held-out check never sees training text), cut
from spread-out places of the token stream. The quantized target continues each prompt, greedily or at the serving
temperature, and one more causal pass gives its post-final-norm hidden states. Each batch of sequences is written at
once as a shard (``data-NNNNN.safetensors``: ``tokens`` int64 ``[b, T]``, ``hidden`` ``[b, T, H]``), so memory
holds one batch; training reads the sequences it needs from the shards (``HealData.batch``).

What training needs from a sequence is all in the shard: row t's input is ``(h_t, embed(x_{t+1}))``, and the
target's own distribution for ``x_{t+2}`` is ``softmax(lm_head(h_{t+1}))``.
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

__all__ = ["DATA_FORMAT", "HealData", "collect", "continue_prompts", "training_data", "training_prompts"]

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

    def batch(self, indices: Sequence[int], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """Tokens ``[b, T]`` and hidden states ``[b, T, H]`` of the sequences ``indices`` (read from the shards)."""
        from safetensors import safe_open

        where: dict[str, list[tuple[int, int]]] = {}
        for pos, index in enumerate(indices):
            shard, row = self.locate(index)
            where.setdefault(shard, []).append((pos, row))
        tokens: list[Tensor | None] = [None] * len(indices)
        hidden: list[Tensor | None] = [None] * len(indices)
        for shard, picks in where.items():
            with safe_open(str(self.directory / shard), framework="pt") as fh:
                tok, hid = fh.get_slice("tokens"), fh.get_slice("hidden")
                for pos, row in picks:
                    tokens[pos] = tok[row : row + 1]
                    hidden[pos] = hid[row : row + 1]
        return (
            torch.cat([t for t in tokens if t is not None]).to(device),
            torch.cat([h for h in hidden if h is not None]).to(device),
        )


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
    with tqdm(total=n, desc="heal data", unit="seq", disable=not progress) as bar:
        for kind, lo, hi in (("greedy", 0, n_greedy), ("sampled", n_greedy, n)):
            for start in range(lo, hi, batch_size):
                batch = prompts[start : min(start + batch_size, hi)]
                temp = None if kind == "greedy" else temperature
                tokens = continue_prompts(target, batch, new_tokens, temp, generator).cpu()
                hidden = target.hidden(tokens).cpu()
                hidden_size = int(hidden.shape[-1])
                name = f"data-{len(shards) + 1:05d}.safetensors"
                meta = {"format": DATA_FORMAT, "kind": kind, "prompt_len": str(int(prompts.shape[1]))}
                atomic_write_safetensors(
                    directory / name,
                    [planned("tokens", tokens.contiguous()), planned("hidden", hidden.contiguous())],
                    meta,
                )
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
