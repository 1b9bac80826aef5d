"""The trained tiny model converted (keep: BF16 MTP; quantize: NVFP4 MTP) and healed with heal's defaults, once per
session: the heal tests and the engine test share them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.heal.options import HealOptions
from mtpquant.heal.run import HealResult, heal
from mtpquant.synth.train import TINY_MTP_ASSET

__all__ = ["CALIB", "HealedTiny"]

CALIB = {"calib_samples": 16, "calib_seq_len": 128}


@dataclass
class HealedTiny:
    """Lazily built: ``quant(mode)`` (convert of the trained tiny model), ``healed(mode)`` (its default heal)."""

    root: Path
    _quants: dict[str, Path] = field(default_factory=dict)
    _healed: dict[str, tuple[Path, HealResult]] = field(default_factory=dict)

    def quant(self, mode: str) -> Path:
        """``convert --mtp MODE`` of the trained tiny model (NVFP4 main model)."""
        if mode not in self._quants:
            out = self.root / f"quant-{mode}"
            convert(ConvertOptions(src=str(TINY_MTP_ASSET), out=out, mtp=mode, device="cpu", progress=False,
                                   calib_samples=CALIB["calib_samples"], calib_seq_len=CALIB["calib_seq_len"]))
            self._quants[mode] = out
        return self._quants[mode]

    def healed(self, mode: str) -> tuple[Path, HealResult]:
        """The default heal of ``quant(mode)`` into a new directory, and its result."""
        if mode not in self._healed:
            out = self.root / f"healed-{mode}"
            result = heal(HealOptions(quant=self.quant(mode), source=TINY_MTP_ASSET, out=out, device="cpu",
                                      progress=False))
            self._healed[mode] = (out, result)
        return self._healed[mode]
