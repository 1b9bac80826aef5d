"""``mtpquant heal``'s options, as one frozen record (torch-free: ``--dry-run`` needs no model code).

Every field a flag sets is a flag of ``mtpquant heal`` (``--max-shard-size`` sets ``max_shard_bytes``, ``--copy``
clears ``link``); the sizes no flag sets (how long the prompts and their continuations are, the batches, the check's
sequences) are ``HealSizes``, which scripts and tests shrink through the API.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from annotated_types import Ge, Gt

from mtpquant.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from mtpquant.errors import OutputExistsError, UsageError
from mtpquant.measure import Activations
from mtpquant.records.record import FLAG, Options
from mtpquant.records.sampling import SamplingSettings, check_sampling, sampling_settings
from mtpquant.runtime.machine import ComputeDtype

__all__ = ["DATA_TEMPERATURE", "SAMPLED", "HealOptions", "HealSizes"]

# The share of the calibration prompts the target continues at a serving temperature (the rest greedily): both kinds
# of text the engines verify drafts on.
SAMPLED = 0.5
# That temperature when every --temperature checked is greedy (Qwen recommends 0.6-1.0 to serve with).
DATA_TEMPERATURE = 0.7

Positive = Annotated[int, Ge(1)]


@dataclass(frozen=True)
class HealSizes(Options):
    """The sizes of heal's work that no flag sets: the defaults suit a served model; ``scripts/bench_heal.py`` and
    the tests run heal in seconds with smaller ones."""

    prompt_len: Annotated[int, Ge(2)] = 64  # tokens of each calibration prompt
    new_tokens: Positive = 128  # tokens the target adds to each prompt
    batch_size: Positive = 8  # sequences per training step
    check_len: Annotated[int, Ge(4)] = 128  # tokens per held-out sequence (prompt at most half; the target's rest)
    batch_prompts: Positive = 32  # prompts the target continues together

    @property
    def seq_len(self) -> int:
        """Tokens of one training sequence: the prompt and its continuation."""
        return self.prompt_len + self.new_tokens


@dataclass(frozen=True)
class HealOptions(Options):
    """Everything ``mtpquant heal`` takes; the CLI builds one of these and calls ``heal``.

    The default heal is short: 64 calibration prompts of 64 tokens continued by the quantized target for 128
    tokens (half greedily, half at ``data_temperature``), 100 steps of 8 sequences at lr 1e-3 training the first two
    chained drafts, then the held-out check on 64 prompts of validate's held-out text, greedy. ``temperatures``,
    ``top_p``, ``top_k`` and ``rule`` are validate's sampling flags (``records.sampling.check_sampling``): the check
    runs at each setting (the target samples the held-out continuations with seed ``seed`` + prompt index) and the
    healed MTP is written only when it is better beyond noise at the served ``k`` (every k with ``strict``) of the
    first and worse beyond noise at no k of any (``heal.decision``).
    """

    quant: str | os.PathLike[str]
    source: str | os.PathLike[str] = field(metadata={FLAG: "--from"})  # the BF16 checkpoint QUANT was made from
    out: str | os.PathLike[str] | None = None
    in_place: bool = False
    # ---- the data: calibration prompts continued by the quantized target itself ---------------------------
    data: str = "offline"  # offline | a .txt/.jsonl file | a `datasets` name (as convert's --calib-data)
    samples: Positive = 64  # prompts
    # ---- the training -----------------------------------------------------------------------------------------
    steps: Positive = 100
    lr: Annotated[float, Gt(0)] = 1e-3
    chain: Positive = 2  # MTP steps trained per row: k > 1 feeds the layer its own outputs, as the engines draft
    seed: int = 0
    # ---- the held-out check -------------------------------------------------------------------------------
    check_prompts: Positive = 64
    k: Positive = 3  # the served k: the check measures AL for k = 1..k and decides at k (heal.decision)
    strict: bool = False  # decide at every k instead: write only when better beyond noise at each of 1..k
    # the sampling settings the check measures at (validate's --temperature, --top-p, --top-k, --rule)
    temperatures: tuple[float, ...] = field(default=(0.0,), metadata={FLAG: "--temperature"})
    top_p: tuple[float, ...] = (1.0,)  # one value for every temperature, or one per temperature
    top_k: tuple[int, ...] = (0,)  # the same
    rule: str = "vllm"  # vllm | probabilistic | strict
    force: bool = False  # write the healed MTP even when the check does not show it better (the record says so)
    # ---- where it runs ------------------------------------------------------------------------------------
    device: str = "auto"  # cpu | cuda | cuda:N | auto (runtime.machine.resolve_device)
    dtype: ComputeDtype | None = None  # compute dtype: float32 on CPU, bfloat16 on CUDA unless given
    max_memory: str | None = None  # caps for the quantized target, e.g. "cpu=3GiB" (the rest read from disk)
    activations: Activations = "emulate"  # emulate W4A4 activation quantization as the engines run it
    # ---- the write ----------------------------------------------------------------------------------------
    revision: str | None = None  # QUANT's Hub revision
    source_revision: str | None = field(default=None, metadata={FLAG: "--from-revision"})  # SRC's Hub revision
    token: str | None = field(default=None, repr=False, metadata={FLAG: None})
    max_shard_bytes: Positive = field(default=DEFAULT_MAX_SHARD_BYTES, metadata={FLAG: "--max-shard-size"})
    link: bool = field(default=True, metadata={FLAG: "--copy"})  # hard-link untouched files (False: copy them)
    dry_run: bool = False
    progress: bool = field(default=True, metadata={FLAG: None})
    command: tuple[str, ...] = field(default=(), metadata={FLAG: None})  # the command line (the CLI sets it)
    sizes: HealSizes = field(default_factory=HealSizes, metadata={FLAG: None})

    def check(self) -> None:
        """Refuse contradictory or out-of-range options and an OUT that exists (one line each): what needs no
        checkpoint, so the CLI runs it before it loads torch."""
        if (self.out is None) == (not self.in_place):
            raise UsageError("give exactly one of --out OUT or --in-place")
        if self.out is not None and os.path.lexists(self.out):
            raise OutputExistsError(
                f"{Path(self.out).absolute()}: output already exists; heal never overwrites (choose a new --out)"
            )
        self.check_fields(UsageError)
        try:
            check_sampling(self.temperatures, self.top_p, self.top_k, self.seed, self.rule)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if self.chain >= self.sizes.seq_len - 1:
            raise UsageError(f"--chain {self.chain} does not fit sequences of {self.sizes.seq_len}")

    @property
    def sampling_settings(self) -> tuple[SamplingSettings, ...]:
        """The settings the check measures at, in the order given (the first is the headline)."""
        return sampling_settings(self.temperatures, self.top_p, self.top_k, self.seed)

    @property
    def data_temperature(self) -> float:
        """The temperature the sampled half of the training data is continued at: the first sampled setting's,
        else ``DATA_TEMPERATURE``."""
        return next((s.temperature for s in self.sampling_settings if not s.greedy), DATA_TEMPERATURE)

    @property
    def out_path(self) -> Path | None:
        """OUT as a path (None with --in-place)."""
        return None if self.out is None else Path(self.out).absolute()
