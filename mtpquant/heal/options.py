"""``mtpquant heal``'s options, as one frozen object (torch-free: ``--dry-run`` needs no model code)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from mtpquant.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from mtpquant.errors import OutputExistsError, UsageError

__all__ = ["HealOptions"]


@dataclass(frozen=True)
class HealOptions:
    """Everything ``mtpquant heal`` takes; the CLI builds one of these and calls ``heal``.

    The default schedule is short: 64 calibration prompts of 64 tokens continued by the quantized target for 128
    tokens (half greedily, half at ``temperature``), 100 steps of 8 sequences at lr 1e-3 training the first two
    chained drafts, then the held-out check on 64 prompts of validate's held-out text.
    """

    quant: str | os.PathLike[str]
    source: str | os.PathLike[str]  # SRC: the BF16 checkpoint QUANT was made from (lineage; master weights)
    out: str | os.PathLike[str] | None = None
    in_place: bool = False
    # ---- the data: calibration prompts continued by the quantized target itself ---------------------------
    data: str = "offline"  # offline | a .txt/.jsonl file | a `datasets` name (as convert's --calib-data)
    samples: int = 64  # prompts
    prompt_len: int = 64  # tokens of each prompt
    new_tokens: int = 128  # tokens the target adds to each prompt
    temperature: float = 0.7  # the serving temperature of the sampled continuations
    sampled: float = 0.5  # share of the prompts continued at ``temperature`` (the rest greedily)
    # ---- the schedule ---------------------------------------------------------------------------------------
    steps: int = 100
    lr: float = 1e-3
    batch_size: int = 8  # sequences per step
    chain: int = 2  # MTP steps trained per row: k > 1 feeds the layer its own outputs, as the engines draft
    seed: int = 0
    # ---- the held-out check -------------------------------------------------------------------------------
    check_prompts: int = 64
    check_len: int = 128  # tokens per held-out sequence (prompt at most half, the target's greedy rest)
    k: int = 3  # the check measures AL for k = 1..k
    force: bool = False  # write the healed MTP even when the check does not show it better (the record says so)
    # ---- where it runs ------------------------------------------------------------------------------------
    device: str = "auto"  # cpu | cuda | cuda:N | auto (machine.resolve_device)
    dtype: str | None = None  # compute dtype: float32 on CPU, bfloat16 on CUDA unless given
    max_memory: str | None = None  # caps for the quantized target, e.g. "cpu=3GiB" (the rest read from disk)
    activations: str = "emulate"  # emulate W4A4 activation quantization as the engines run it | off
    batch_prompts: int = 32  # prompts generated together
    # ---- the write ----------------------------------------------------------------------------------------
    revision: str | None = None  # QUANT's Hub revision
    source_revision: str | None = None  # SRC's Hub revision
    token: str | None = field(default=None, repr=False)
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    link: bool = True  # hard-link untouched files (False: copy them)
    dry_run: bool = False
    progress: bool = True
    command: tuple[str, ...] = ()  # the command line, recorded in the provenance file (the CLI sets it)

    def check(self) -> None:
        """Refuse contradictory or out-of-range options and an OUT that exists (one line each): what needs no
        checkpoint, so the CLI runs it before it loads torch."""
        if (self.out is None) == (not self.in_place):
            raise UsageError("give exactly one of --out OUT or --in-place")
        if self.out is not None and os.path.lexists(self.out):
            raise OutputExistsError(
                f"{Path(self.out).absolute()}: output already exists; heal never overwrites (choose a new --out)"
            )
        positive = {
            "--samples": self.samples,
            "--prompt-len": self.prompt_len,
            "--new-tokens": self.new_tokens,
            "--steps": self.steps,
            "--batch-size": self.batch_size,
            "--chain": self.chain,
            "--check-prompts": self.check_prompts,
            "--k": self.k,
            "--batch-prompts": self.batch_prompts,
            "--max-shard-size": self.max_shard_bytes,
        }
        for flag, value in positive.items():
            if value < 1:
                raise UsageError(f"{flag} must be >= 1, got {value}")
        if self.prompt_len < 2:
            raise UsageError(f"--prompt-len must be >= 2, got {self.prompt_len}")
        if self.check_len < 4:
            raise UsageError(f"--check-len must be >= 4, got {self.check_len}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if not self.temperature > 0:
            raise UsageError(f"--temperature must be positive, got {self.temperature}")
        if not 0.0 <= self.sampled <= 1.0:
            raise UsageError(f"--sampled must be a share between 0 and 1, got {self.sampled}")
        if self.chain >= self.prompt_len + self.new_tokens - 1:
            raise UsageError(f"--chain {self.chain} does not fit sequences of {self.prompt_len + self.new_tokens}")
        if self.activations not in ("emulate", "off"):
            raise UsageError(f"--activations must be emulate or off, got {self.activations!r}")

    @property
    def out_path(self) -> Path | None:
        """OUT as a path (None with --in-place)."""
        return None if self.out is None else Path(self.out)
