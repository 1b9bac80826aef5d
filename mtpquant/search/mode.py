"""``convert --mtp auto``'s MTP mode: the MTP's precision chosen per precision group by the search (the smallest MTP
whose predicted AL stays within the budget of the BF16 MTP's on the quantized target OUT holds), measured after the
main model is exported (``measure``) and written as it chose: the BF16 MTP as keep writes it, else the quantized
groups from the search's calibrated input scales with SRC's other bytes, declared plain or MIXED_PRECISION as the
chosen engines load it; its report goes into OUT's ``mtp_search/``. The other modes are ``surgery.modes``'.
"""

from __future__ import annotations

from typing import Any

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import MtpModeError
from mtpquant.surgery.modes import (
    MeasureContext,
    ModeCheck,
    MtpMode,
    MtpOutcome,
    PlanView,
    WriteContext,
    check_quantizable,
    same_bytes,
)
from mtpquant.surgery.shards import write_planned_mtp

__all__ = ["SearchMode"]


class SearchMode(MtpMode):
    """The MTP's precision chosen per group by the precision search (``convert --mtp auto``)."""

    name = "search"
    declares = True
    needs_target = True

    def check(self, ckpt: Checkpoint, fmt: str, targets: str = "all", exclude: tuple[str, ...] = ()) -> ModeCheck:
        del fmt, targets, exclude
        check_quantizable(ckpt, "--mtp auto")
        groups = ckpt.spec.family.mtp.groups
        if not groups:
            raise MtpModeError(
                f"{ckpt.label}: {ckpt.spec.family.display} has no MTP precision groups in the registry; --mtp auto "
                "cannot choose its precision (use --mtp keep or quantize)"
            )
        note = (
            "--mtp auto: the main model is converted first; then its quantized target drafts with the BF16 MTP and "
            f"with each of {', '.join(g.key for g in groups)} quantized (held-out prompts, once per group and "
            "precision), the smallest candidates are confirmed on other held-out prompts, and the smallest MTP "
            "confirmed within the AL budget is written (budget 0: the BF16 MTP; report in mtp_search/)"
        )
        return ModeCheck((note,))

    def plan_line(self, plan: PlanView) -> str:
        return (
            f"auto: the precision of each MTP group chosen by measurement ({len(plan.mtp_tensors)} MTP tensors; BF16, "
            "FP8 or NVFP4 per group, the smallest MTP whose predicted AL is confirmed within the budget of the BF16 "
            "MTP's)"
        )

    def measure(self, ctx: MeasureContext) -> Any:
        import torch

        from mtpquant.measure.weights import CheckpointWeights
        from mtpquant.public import public_checkpoint
        from mtpquant.runtime.machine import compute_dtype, resolve_device
        from mtpquant.search.measure import calibration_rows
        from mtpquant.search.run import search_mtp

        cal = ctx.calibration
        rows = calibration_rows(ctx.tokenizer, cal.data, cal.samples, cal.seq_len, chat_template=cal.chat_template)
        device = torch.device(resolve_device(ctx.device))
        dtype = getattr(torch, compute_dtype(device.type, None))
        return search_mtp(
            CheckpointWeights(ctx.target), ctx.ckpt, ctx.ckpt.source, rows, ctx.settings,
            main_algo=ctx.main_algo, activations=ctx.activations, target_name=public_checkpoint(ctx.ckpt.label),
            device=device, dtype=dtype, progress=ctx.progress, healer=ctx.healer, exclude=ctx.exclude,
            scratch=ctx.scratch, max_memory=ctx.max_memory,
        )  # fmt: skip

    def write(self, ctx: WriteContext) -> MtpOutcome:
        from mtpquant.search.write import chosen_mtp

        found = ctx.measured
        assert found is not None, "search mode writes what its measurement chose"
        chosen = chosen_mtp(ctx.ckpt, found.space, found.result.choice.assignment, found.amax, found.weights)
        shards = write_planned_mtp(ctx.od, chosen.tensors, ctx.max_bytes)
        return MtpOutcome(sorted(t.name for t in chosen.tensors), shards, chosen.quantized_layers, search=found)

    def verify(self, out: Checkpoint, src: Checkpoint, outcome: MtpOutcome, where: str) -> None:
        """The tensors SRC's bytes were kept for are SRC's bytes (a healed MTP: none were)."""
        if outcome.search is not None and outcome.search.weights is not None:
            return
        kept = sorted(n for n in outcome.names if n in src.tensors and out.tensors[n].dtype == src.tensors[n].dtype
                      and out.tensors[n].shape == src.tensors[n].shape)
        same_bytes(out, src, kept, where)
