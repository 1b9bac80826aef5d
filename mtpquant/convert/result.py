"""What ``convert`` did, as the ``ConvertResult`` it returns (``--json``), and the output's tensor counts (the
process's own measures, step timings, peak RSS and bytes written, are ``mtpquant.runtime.meter``'s).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.convert.plan import ConvertPlan
from mtpquant.families import TensorClass

__all__ = ["ConvertResult", "count_output"]


@dataclass
class ConvertResult:
    """What convert did: paths, sizes, tensor counts per class, timings, peak memory."""

    plan: ConvertPlan
    dry_run: bool = False
    output: Path | None = None
    mtp_output: Path | None = None
    output_bytes: int = 0
    mtp_output_bytes: int = 0
    tensor_counts: dict[str, int] = field(default_factory=dict)
    quantized_linears: int = 0
    unquantized_linears: int = 0
    mtp_tensors: int = 0
    mtp_precision: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    peak_gpu_bytes: int = 0
    calibration_rows: int = 0
    calibration_tokens: int = 0
    layerwise: bool = False
    resumed_from_layer: int | None = None  # 0-based first layer calibrated by this run, when it resumed
    placement: dict[str, int] = field(default_factory=dict)  # accelerate's modules per device
    bytes_written: int = 0  # by this process, all files (/proc/self/io wchar); 0 where unknown
    resume_bytes: int = 0  # of those, into the layer-wise resume state (removed on success)
    offload_bytes: int = 0  # of those, weights transformers re-saved for disk offload (none for the 3 families)
    shards_moved: int = 0  # exported shards renamed into place
    shards_rewritten: int = 0  # exported shards written again because a tensor had to change
    verdicts: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    search: Any = None  # --mtp auto: the SearchResult (what was measured, what was chosen and why)

    @property
    def mode(self) -> str:
        """The MTP mode that ran."""
        return self.plan.mode

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        data = {k: v for k, v in asdict(self).items() if k not in ("plan", "search")}
        data["plan"] = self.plan.to_json()
        data["search"] = self.search.to_json() if self.search is not None else None
        data["output"] = str(self.output) if self.output else None
        data["mtp_output"] = str(self.mtp_output) if self.mtp_output else None
        data["mode"] = self.mode
        return data


def count_output(path: Path) -> tuple[dict[str, int], int, int, int]:
    """The written output's facts: tensors per class, quantized and unquantized main-model Linears, bytes."""
    from mtpquant.convert.assemble import quantized_modules_of

    ckpt = Checkpoint.open(path, strict=True)
    counts: dict[str, int] = {}
    for name in ckpt.tensors:
        cls = ckpt.classify(name)
        counts[cls] = counts.get(cls, 0) + 1
    quantized = {m for m in quantized_modules_of(ckpt.tensors) if not ckpt.is_mtp(m)}
    linears = {
        n[: -len(".weight")]
        for n, e in ckpt.tensors.items()
        if n.endswith(".weight")
        and len(e.shape) == 2
        and not ckpt.is_mtp(n)
        and ckpt.classify(n) != TensorClass.VISION
        and ckpt.classify(n) != TensorClass.EMBED
    }
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return counts, len(quantized), len(linears - quantized), size
