"""The trained tiny model converted (keep: BF16 MTP; quantize: NVFP4 MTP) and healed, once per session: the heal
tests, the publish test and the engine test share them.

``small(mode)`` is a heal with a schedule that runs in seconds, written with ``force`` (the mechanics: what is
written, how, and the record); ``healed(mode)`` is the default heal (the proof that heal improves acceptance: a
couple of CPU-minutes each: the nightly lane's proofs, ``MTPQUANT_NIGHTLY=1``; ``scripts/bench_heal.py`` runs the
same heal and records its numbers in docs/BENCHMARKS.md). The full lane runs one default heal, of ``quant("keep")``'s
convert: the demo's (tests/support/demo.py), which tests/test_engine_heal.py measures through vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mtpquant.cli import demo_cmd
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.heal.options import HealOptions, HealSizes
from mtpquant.heal.run import HealResult, heal
from mtpquant.synth.train import TINY_MTP_ASSET

__all__ = ["CALIB", "SMALL", "HealedTiny", "proof"]

# The demo's calibration: quant("keep") is then the demo's convert before its heal (tests/test_engine_heal.py serves
# the demo's healed quant against it).
CALIB = {"calib_samples": demo_cmd.CALIB_SAMPLES, "calib_seq_len": demo_cmd.CALIB_SEQ_LEN}

# A schedule that runs in seconds: for the mechanics, not for gains.
SMALL: dict[str, Any] = {
    "samples": 8,
    "steps": 3,
    "check_prompts": 6,
    "sizes": HealSizes(prompt_len=16, new_tokens=16, batch_size=4, check_len=32),
    "device": "cpu",
    "progress": False,
}

# The default heal's other proofs: minutes of CPU per mode, beyond the full lane's budget: the nightly lane's
# (tests/support/lanes.py).
proof = pytest.mark.nightly(
    reason="a default heal's proof takes CPU-minutes; the full lane measures one, the Qwen3.5 keep heal (the demo's) "
    "through vLLM (tests/test_engine_heal.py)"
)


@dataclass
class HealedTiny:
    """Lazily built: ``quant(mode)`` (convert of the trained tiny model ``source``: Qwen3.5 by default, or the
    trained tiny Qwen4-Exp), ``small(mode)`` (a seconds-long forced heal of it), ``healed(mode)`` (its default
    heal)."""

    root: Path
    source: Path = TINY_MTP_ASSET
    _quants: dict[str, Path] = field(default_factory=dict)
    _healed: dict[tuple[str, str], tuple[Path, HealResult]] = field(default_factory=dict)

    def quant(self, mode: str) -> Path:
        """``convert --mtp MODE`` of the trained tiny model (NVFP4 main model)."""
        if mode not in self._quants:
            out = self.root / f"quant-{mode}"
            convert(ConvertOptions(src=str(self.source), out=out, mtp=mode, device="cpu", progress=False,
                                   calib_samples=CALIB["calib_samples"], calib_seq_len=CALIB["calib_seq_len"]))
            self._quants[mode] = out
        return self._quants[mode]

    def _heal(self, mode: str, kind: str, **options: Any) -> tuple[Path, HealResult]:
        if (mode, kind) not in self._healed:
            out = self.root / f"{kind}-{mode}"
            result = heal(HealOptions(quant=self.quant(mode), source=self.source, out=out, **options))
            self._healed[mode, kind] = (out, result)
        return self._healed[mode, kind]

    def small(self, mode: str) -> tuple[Path, HealResult]:
        """A heal of ``quant(mode)`` with the ``SMALL`` schedule, written with ``force``, and its result."""
        return self._heal(mode, "small", force=True, **SMALL)

    def healed(self, mode: str) -> tuple[Path, HealResult]:
        """The default heal of ``quant(mode)`` into a new directory, and its result."""
        return self._heal(mode, "healed", device="cpu", progress=False)
