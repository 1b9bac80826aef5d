"""The MTP modes, one object each: keep, quantize, extract, drop.

Each mode owns everything that depends on it: its refusal checks and notes (at plan time, from headers),
its plan line, what it writes, how its output is verified, and how the output declares the MTP. Convert
and graft dispatch through ``MODES``; graft puts an MTP back the way ``keep`` writes it, which is why
``convert --mtp extract`` followed by ``graft`` gives the same files as ``convert --mtp keep``.

- keep: every ``mtp.*`` tensor byte for byte into ``mtp-*`` shards (``shards.write_mtp_shards``); the
  MTP declared; excluded as ``mtp*`` (and ``re:^mtp\\..*`` for compressed-tensors metadata); verified
  byte for byte against the source.
- quantize: the MTP Linears to NVFP4 / FP8 (``mtpquant.mtp.quantize``) with input scales from the
  calibration pass; ``mtp.fc``, router, ``shared_expert_gate`` excluded by exact name; norms and those
  Linears copied byte for byte. Needs calibration (the MTP runs on the target's hidden states).
- extract: nothing MTP in the main output, the declaration set to 0; the MTP goes to its own directory
  (its own OutputDir): the same shards, an index, the source config, a README.
- drop: nothing MTP, the declaration set to 0.
- search (``convert --mtp auto``): a mode of the search service, ``mtpquant.search.mode.SearchMode`` (it measures
  with ``mtpquant.search``, which stands above this module); convert adds it to these (``choose_mode``'s ``extra``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from mtpquant.checkpoint.header import FLOAT_DTYPES, TensorEntry
from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir, PlannedTensor
from mtpquant.errors import IndivisibleDimensionError, MtpConfigError, MtpModeError, OutputVerificationError
from mtpquant.families import check_mtp_forward
from mtpquant.formats.kinds import NVFP4_BLOCK, WRITTEN
from mtpquant.surgery.shards import mtp_planned_tensors, write_mtp_shards, write_planned_mtp

__all__ = [
    "MODES",
    "MODE_NAMES",
    "MeasureContext",
    "ModeCheck",
    "MtpMode",
    "MtpOutcome",
    "WriteContext",
    "check_quantizable",
    "choose_mode",
    "load_mtp_layer",
    "same_bytes",
]

log = logging.getLogger(__name__)

BLOCK = NVFP4_BLOCK  # NVFP4 block size: a quantized Linear's input dimension must be a multiple of it


def _leaf_names(patterns: tuple[str, ...]) -> list[str]:
    """The registry's exclusion patterns as a reader names the modules (``mtp.layers.*.mlp.gate`` -> ``mlp.gate``)."""
    names = (re.sub(r"^(\*\.?|mtp\.layers\.\*\.)", "", p).replace("*", "") for p in patterns)
    return list(dict.fromkeys(n.strip(".") or p for n, p in zip(names, patterns, strict=True)))


class PlanView(Protocol):
    """What a mode's plan line reads of the convert plan."""

    @property
    def mtp_tensors(self) -> tuple[str, ...]: ...
    @property
    def mtp_quantized(self) -> tuple[str, ...]: ...
    @property
    def mtp_unquantized(self) -> tuple[str, ...]: ...
    @property
    def mtp_format(self) -> str: ...
    @property
    def mtp_out(self) -> Path | None: ...


@dataclass(frozen=True)
class ModeCheck:
    """What a mode's plan-time checks found: notes for the user, and (quantize) the Linears it quantizes."""

    notes: tuple[str, ...] = ()
    quantized: tuple[str, ...] = ()


@dataclass
class WriteContext:
    """What a mode needs to write its MTP: the outputs, the source, and (quantize) the calibration."""

    od: OutputDir
    ckpt: Checkpoint
    max_bytes: int
    mtp_od: OutputDir | None = None  # extract: the MTP's own directory
    out_name: str = ""  # extract: the main output's name, for the MTP directory's README
    calibrator: Any = None  # quantize: the MtpCalibrator that ran during calibration
    fmt: str = "nvfp4"  # quantize: nvfp4 | fp8
    activations: bool = True  # quantize: W4A4 (input scales) or weights only
    targets: str = "all"  # quantize: the recipe's targets (experts: the MTP's routed experts only)
    exclude: tuple[str, ...] = ()  # quantize: the recipe's quantization.exclude (the MTP Linears it matches stay BF16)
    main_algo: str = "NVFP4"  # the main model's quant_algo (an FP8 MTP beside it makes MIXED_PRECISION)
    measured: Any = None  # what the mode's ``measure`` returned (search: the SearchOutcome)


@dataclass
class MeasureContext:
    """What a mode that measures on the quantized main model (``needs_target``) needs, once it is exported."""

    ckpt: Checkpoint  # SRC
    target: Checkpoint  # the quantized main model as OUT holds it
    tokenizer: Any  # SRC's tokenizer
    calibration: Any  # the recipe's calibration section
    settings: Any  # the search's SearchSettings
    main_algo: str
    activations: bool  # W4A4: quantized Linears carry input scales
    device: str
    progress: bool = False
    healer: Any = None  # --mtp auto --heal: the search's finalists healed before the choice (search.finalists.Healer)
    exclude: tuple[str, ...] = ()  # the recipe's quantization.exclude (the MTP Linears it matches stay BF16)
    scratch: Path | None = None  # a directory to create inside OUT's partial directory for the search's scratch files
    max_memory: Mapping[int | str, int] | None = None  # the target's placement caps (accelerate's; None: all on device)


@dataclass
class MtpOutcome:
    """What a mode wrote into OUT (the exclusions it needs are planned from OUT's tensors, as graft plans them:
    ``surgery.metadata.plan_metadata``)."""

    names: list[str] = field(default_factory=list)  # mtp.* tensor names written into OUT
    shards: list[str] = field(default_factory=list)  # the mtp-* shards holding them
    quantized_layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # for MIXED_PRECISION
    search: Any = None  # search mode: the SearchOutcome (its report, the chosen configuration)


def same_bytes(out: Checkpoint, src: Checkpoint, names: list[str], where: str) -> None:
    """Copied tensors must be the source's exact bytes (dtype, shape and data)."""
    for name in names:
        a, b = out.tensors[name], src.tensors[name]
        if (a.dtype, a.shape) != (b.dtype, b.shape) or out.read_raw(a) != src.read_raw(b):
            raise OutputVerificationError(f"{where}: {name} differs from the source")


def load_mtp_layer(ckpt: Checkpoint, device: Any = None) -> Any:
    """The family's reference MTP with the source's ``mtp.*`` weights (for calibration).

    An appended layer's weights are read as the forward takes them (``_MtpTensors``): its head and embedding copies,
    which the forward never reads (the drafter uses the target's), not at all, and its per-expert bank straight into
    the fused tensors, so the layer costs its own size once (GLM-4.5-Air's: 4.7 GB, not 7.2 GB of copies and bank
    plus 4.4 GB fused), which the memory plan's two largest decoder layers cover under ``--max-memory``."""
    from mtpquant.mtp.build import reference_mtp

    entries = ckpt.mtp_tensors()
    if ckpt.spec.family.mtp.appended is not None:
        return reference_mtp(ckpt.config, _MtpTensors(ckpt, entries), device=device)
    tensors = {e.name: ckpt.read_tensor(e.name) for e in entries}
    return reference_mtp(ckpt.config, tensors, device=device)


class _MtpTensors(Mapping[str, Any]):
    """An appended MTP layer's tensors read from the checkpoint when looked up, not kept; its head and embedding
    copies as meta tensors (shape and dtype only: the forward never reads them)."""

    def __init__(self, ckpt: Checkpoint, entries: Sequence[TensorEntry]) -> None:
        self.ckpt = ckpt
        self.entries = {e.name: e for e in entries}
        self.copies = tuple("." + c for c in ckpt.spec.family.mtp.copies)

    def __getitem__(self, name: str) -> Any:
        import torch

        from mtpquant.checkpoint.dtypes import torch_dtype

        entry = self.entries[name]
        if self.copies and name.endswith(self.copies):
            return torch.empty(tuple(entry.shape), dtype=torch_dtype(entry.dtype), device="meta")
        return self.ckpt.read_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


class MtpMode:
    """One MTP mode. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    declares: ClassVar[bool]  # the output declares the MTP (engines will expect it)
    needs_mtp: ClassVar[bool] = True  # refused for a source without a (complete) MTP
    needs_calibration: ClassVar[bool] = False  # the MTP runs during calibration (quantize)
    takes_format: ClassVar[bool] = False  # --mtp-format applies (quantize)
    writes_side_output: ClassVar[bool] = False  # the MTP goes to a directory of its own (extract)
    needs_target: ClassVar[bool] = False  # measures on the exported main model before writing (search)

    # ---- plan time ---------------------------------------------------------------------------------
    def check(self, ckpt: Checkpoint, fmt: str, targets: str = "all", exclude: tuple[str, ...] = ()) -> ModeCheck:
        """Refuse (one line) a source this mode cannot work on; notes for the plan (``fmt``, ``targets``,
        ``exclude``: the MTP format, the recipe's targets and exclusions, quantize's)."""
        del fmt, targets, exclude
        if not self.needs_mtp:
            return ModeCheck(self._family_notes(ckpt))
        names = _check_mtp_complete(ckpt, f"--mtp {self.name}")
        # beyond the family's inventory (where that is the glue only, Step's: outside the declared layers)
        extra = ckpt.spec.mtp_unexpected(names, ckpt.spec.expected_mtp_shapes(names))
        notes = []
        if extra:
            notes.append(f"{len(extra)} MTP tensors beyond the expected layout are copied too (first: {extra[0]})")
        return ModeCheck((*notes, *self._family_notes(ckpt)))

    def _family_notes(self, ckpt: Checkpoint) -> tuple[str, ...]:
        family = ckpt.spec.family
        if self.declares or family.mtp_key is not None:
            return ()
        return (
            f"{family.display} declares no MTP key in config.json (engines assume {family.mtp_default_layers} layer); "
            "the output cannot un-declare it, so do not enable MTP speculative decoding on it",
        )

    def plan_line(self, plan: PlanView) -> str:
        """One line saying what the mode does (the plan's ``mode`` line)."""
        raise NotImplementedError

    # ---- the output --------------------------------------------------------------------------------
    def declared_layers(self, ckpt: Checkpoint) -> int:
        """MTP layers the output's config declares (0: un-declared, set to 0 where the family has a key)."""
        return max(1, ckpt.spec.mtp.layers) if self.declares else 0

    def measure(self, ctx: MeasureContext) -> Any:
        """What the mode measures on the quantized main model before writing (``needs_target`` modes)."""
        del ctx
        raise NotImplementedError(f"--mtp {self.name} measures nothing")

    def write(self, ctx: WriteContext) -> MtpOutcome:
        """Write the MTP (if any) and say how OUT's metadata changes."""
        raise NotImplementedError

    def verify(self, out: Checkpoint, src: Checkpoint, outcome: MtpOutcome, where: str) -> None:
        """Mode-specific checks of the finished OUT (beyond the common ones convert runs)."""
        del out, src, outcome, where

    def finish_side_output(self, od: OutputDir, src: Checkpoint, where: str) -> Path:
        """Verify the mode's own output directory and put it in place (``writes_side_output`` modes); its path."""
        raise NotImplementedError(f"--mtp {self.name} writes no output of its own")


def _check_mtp_complete(ckpt: Checkpoint, flag: str) -> set[str]:
    """The source's MTP tensor names, refusing an MTP that is absent, incomplete or shaped otherwise."""
    label = ckpt.label
    present = {e.name for e in ckpt.mtp_tensors()}
    expected = ckpt.spec.expected_mtp_shapes(present)
    if not present:
        raise MtpModeError(
            f"{label}: has no MTP tensors (mtp.*), so {flag} has nothing to work on; use --mtp drop to convert "
            "without MTP, or add one with `mtpquant graft`"
        )
    missing = [n for n in expected if n not in present]
    if missing:
        raise MtpModeError(
            f"{label}: MTP incomplete, {len(missing)} of {len(expected)} expected tensors missing (first: "
            f"{missing[0]}); use --mtp drop, or repair the source with `mtpquant graft`"
        )
    wrong = [n for n in expected if tuple(ckpt.tensors[n].shape) != tuple(expected[n])]
    if wrong:
        n = wrong[0]
        raise MtpModeError(
            f"{label}: MTP tensor {n} has shape {list(ckpt.tensors[n].shape)}, the config implies {list(expected[n])}"
        )
    return present


class KeepMode(MtpMode):
    """Every ``mtp.*`` tensor byte for byte; excluded as ``mtp*`` / ``re:^mtp\\..*``."""

    name = "keep"
    declares = True

    def plan_line(self, plan: PlanView) -> str:
        n = len(plan.mtp_tensors)
        return f"keep: {n} MTP tensors copied byte for byte into mtp-*.safetensors, excluded as mtp*"

    def write(self, ctx: WriteContext) -> MtpOutcome:
        names = sorted(e.name for e in ctx.ckpt.mtp_tensors())
        shards = write_mtp_shards(ctx.od, ctx.ckpt, names, ctx.max_bytes)
        return MtpOutcome(names, shards)

    def verify(self, out: Checkpoint, src: Checkpoint, outcome: MtpOutcome, where: str) -> None:
        same_bytes(out, src, sorted(outcome.names), where)


class QuantizeMode(MtpMode):
    """The MTP Linears quantized with calibrated input scales; the rest byte for byte."""

    name = "quantize"
    declares = True
    needs_calibration = True
    takes_format = True

    def check(self, ckpt: Checkpoint, fmt: str, targets: str = "all", exclude: tuple[str, ...] = ()) -> ModeCheck:
        from mtpquant.mtp.quantize import mtp_quantized_modules, per_expert_shapes

        check_quantizable(ckpt, "--mtp quantize")
        shapes = per_expert_shapes({e.name: e.shape for e in ckpt.mtp_tensors()})
        quantized = tuple(mtp_quantized_modules(linear_modules(shapes), ckpt.spec.family.mtp, targets, exclude))
        kind = WRITTEN[fmt]
        if kind.group_size is not None:
            for m in quantized:
                in_dim = shapes[m + ".weight"][-1]
                if in_dim % kind.group_size:
                    raise IndivisibleDimensionError(
                        f"{m}: input dimension {in_dim} is not a multiple of {kind.group_size} (the {kind.label} block "
                        "size); use --mtp-format fp8 or --mtp keep"
                    )
        if kind.layer_algo is not None:  # not the main model's NVFP4 algo: a quantized_layers entry of its own
            notes = [
                "FP8 MTP with an NVFP4 main model is written as MIXED_PRECISION (vLLM modelopt_mixed); it lists the "
                "mtp.* modules in quantized_layers, so SGLang builds this MTP quantized too"
            ]
        else:
            notes = [
                "SGLang builds the MTP of a modelopt_fp4 checkpoint in BF16 and cannot load this NVFP4 MTP for NEXTN "
                "(vLLM serves it; with --format compressed-tensors SGLang builds it NVFP4)"
            ]
        if targets == "experts":
            notes.append(
                "the recipe quantizes routed experts only: so does --mtp quantize (the MTP's attention and shared "
                "expert stay BF16, excluded by name)"
            )
        return ModeCheck(tuple(notes), quantized)

    def plan_line(self, plan: PlanView) -> str:
        return (
            f"quantize: {len(plan.mtp_quantized)} MTP Linears -> {plan.mtp_format.upper()} with calibrated input "
            f"scales; {', '.join(_leaf_names(plan.mtp_unquantized))} stay BF16 (excluded by name). SGLang loads an "
            "NVFP4 MTP only in the compressed-tensors format"
        )

    def write(self, ctx: WriteContext) -> MtpOutcome:
        from mtpquant.checkpoint.dtypes import planned as in_memory
        from mtpquant.mtp.names import checkpoint_name
        from mtpquant.mtp.quantize import quantize_mtp

        assert ctx.calibrator is not None, "quantize mode needs the calibrator that ran during calibration"
        # convert releases the calibrated layer before the export (its amax is all it keeps): read it again, the
        # same weights as calibrated (the forward never changes them)
        layer = ctx.calibrator.layer if ctx.calibrator.layer is not None else load_mtp_layer(ctx.ckpt)
        weights = {checkpoint_name(layer, n): p.detach().cpu() for n, p in layer.named_parameters()}
        del layer
        layout = ctx.ckpt.spec.family.mtp
        result = quantize_mtp(
            weights, ctx.calibrator.amax, ctx.fmt, activations=ctx.activations, layout=layout, targets=ctx.targets,
            exclude=ctx.exclude,
        )
        planned: list[PlannedTensor] = [in_memory(n, t) for n, t in result.tensors.items()]
        kept = [n for n in result.kept_tensors if n in ctx.ckpt.tensors]
        # what the forward holds as buffers or not at all (a router's e_score_correction_bias, the head / embedding
        # copies of an appended layer), byte for byte too
        done = {*weights, *kept, *result.tensors, *(m + ".weight" for m in result.quantized_modules)}
        kept += sorted(e.name for e in ctx.ckpt.mtp_tensors() if e.name not in done)
        planned += mtp_planned_tensors(ctx.ckpt, kept)
        shards = write_planned_mtp(ctx.od, planned, ctx.max_bytes)
        outcome = MtpOutcome(sorted(t.name for t in planned), shards)
        layer_algo = WRITTEN[ctx.fmt].layer_algo or ctx.main_algo
        if layer_algo != ctx.main_algo:
            outcome.quantized_layers = {m: {"quant_algo": layer_algo} for m in result.quantized_modules}
        return outcome


def check_quantizable(ckpt: Checkpoint, flag: str) -> set[str]:
    """The source's MTP tensor names, refusing an MTP the reference forward cannot calibrate (incomplete, beyond
    the exact layout, not in a float dtype, a config the forward cannot compute)."""
    label = ckpt.label
    names = _check_mtp_complete(ckpt, flag)
    try:  # the reference forward runs during calibration: refuse what it cannot compute now, not after loading
        check_mtp_forward(ckpt.config)
    except MtpConfigError as exc:
        raise MtpModeError(f"{label}: {flag} cannot calibrate this MTP: {exc}; use --mtp keep") from None
    # beyond the family's inventory (where it is the glue only, Step's: a tensor outside the declared layers; the
    # reference forward then checks the block against its own modules)
    extra = ckpt.spec.mtp_unexpected(names, ckpt.spec.expected_mtp_shapes(names))
    if extra:
        raise MtpModeError(f"{label}: unexpected MTP tensor {extra[0]}; {flag} needs the exact layout")
    bad_dtype = sorted(n for n in names if ckpt.tensors[n].dtype not in FLOAT_DTYPES)
    if bad_dtype:
        raise MtpModeError(
            f"{label}: MTP tensor {bad_dtype[0]} is {ckpt.tensors[bad_dtype[0]].dtype}; {flag} needs a BF16/F16/F32 MTP"
        )
    return names


class ExtractMode(MtpMode):
    """The MTP to a directory of its own; none in OUT, and OUT declares none."""

    name = "extract"
    declares = False
    writes_side_output = True

    def plan_line(self, plan: PlanView) -> str:
        n = len(plan.mtp_tensors)
        return f"extract: main output without MTP; {n} MTP tensors to {plan.mtp_out} (graft them back later)"

    def write(self, ctx: WriteContext) -> MtpOutcome:
        assert ctx.mtp_od is not None, "extract mode writes into its own output directory"
        ckpt = ctx.ckpt
        names = sorted(e.name for e in ckpt.mtp_tensors())
        write_mtp_shards(ctx.mtp_od, ckpt, names, ctx.max_bytes)
        ctx.mtp_od.write_index()
        ctx.mtp_od.write_json("config.json", ckpt.config)
        ctx.mtp_od.write_text("README.md", _extract_readme(ckpt, len(names), ctx.out_name, ctx.mtp_od.final.name))
        return MtpOutcome()

    def finish_side_output(self, od: OutputDir, src: Checkpoint, where: str) -> Path:
        """The MTP directory, verified (exactly the source's MTP tensors, byte for byte), put in place."""
        expected = {e.name for e in src.mtp_tensors()}
        return od.finalize(lambda path: self.verify_side_output(path, src, expected, where))

    def verify_side_output(self, path: Path, src: Checkpoint, expected: set[str], where: str) -> None:
        """The MTP directory holds exactly the source's MTP tensors, byte for byte."""
        out = Checkpoint.open(path, strict=True)
        if set(out.tensors) != expected:
            diff = sorted(set(out.tensors) ^ expected)
            raise OutputVerificationError(f"{where}: MTP tensor set differs ({diff[0]})")
        same_bytes(out, src, sorted(expected), where)


class DropMode(MtpMode):
    """No MTP in the output, and no declaration."""

    name = "drop"
    declares = False
    needs_mtp = False

    def check(self, ckpt: Checkpoint, fmt: str, targets: str = "all", exclude: tuple[str, ...] = ()) -> ModeCheck:
        base = super().check(ckpt, fmt, targets, exclude)
        if ckpt.mtp_tensors():
            note = "--mtp drop: the output has no MTP; speculative decoding with MTP will not be available"
            return ModeCheck((note, *base.notes))
        return base

    def plan_line(self, plan: PlanView) -> str:
        return "drop: no MTP in the output and no MTP declaration" + (
            " (speculative decoding with MTP is gone)" if plan.mtp_tensors else ""
        )

    def write(self, ctx: WriteContext) -> MtpOutcome:
        del ctx  # nothing MTP is written
        return MtpOutcome()


MODES: Mapping[str, MtpMode] = {
    m.name: m for m in (KeepMode(), QuantizeMode(), ExtractMode(), DropMode())
}
MODE_NAMES = tuple(MODES)


def choose_mode(
    requested: str, ckpt: Checkpoint, extra: Mapping[str, MtpMode] | None = None
) -> tuple[MtpMode, tuple[str, ...]]:
    """The mode for a recipe's ``mtp.mode`` among ``MODES`` and ``extra`` (the modes of services above this module:
    ``search``) (``auto``: keep when the source has an MTP, else drop), plus a note when ``auto`` drops an MTP the
    source declares but lacks."""
    if requested != "auto":
        return {**MODES, **(extra or {})}[requested], ()
    if ckpt.mtp_tensors():
        return MODES["keep"], ()
    if ckpt.spec.mtp.declared:
        return MODES["drop"], (
            f"the source declares an MTP ({ckpt.spec.mtp.describe()}) but has no mtp.* tensors: converting "
            "without MTP and removing the declaration; `mtpquant graft` can add one later",
        )
    return MODES["drop"], ()


def _extract_readme(ckpt: Checkpoint, count: int, out_name: str, mtp_name: str) -> str:
    """The MTP directory's README: for a person reading it locally, sealed as a generated card so ``publish``
    replaces it with the sidecar card; the source by its repo id or base name (the file may go public)."""
    from mtpquant import __version__
    from mtpquant.card_marker import MARKER, ZERO_HASH, seal
    from mtpquant.public import public_name

    decl = ckpt.spec.mtp.describe()
    source = public_name(ckpt.label, ckpt.source.ref())
    return seal(f"""{MARKER.format(digest=ZERO_HASH, version=__version__)}

# MTP layer extracted by mtpquant

This directory holds the Multi-Token-Prediction (MTP) layer of `{source}`
({ckpt.spec.family.display}): {count} `mtp.*` tensors under their original names, exactly the
bytes of the source checkpoint, in `mtp-*.safetensors` shards with an index. `config.json` is the
source's config (it declares the MTP: {decl}).

The quantized model `{out_name}` was written without the MTP, and its config declares none, so
engines do not expect one. To put it back (MTP in BF16, excluded from quantization):

```
mtpquant graft {out_name} --from {mtp_name} --out {out_name}-with-mtp
```

(or `--in-place` instead of `--out`). `convert --mtp extract` followed by `graft` gives the same
tensor files, byte for byte, as `convert --mtp keep`. Check the result with
`mtpquant inspect {out_name}-with-mtp`. `mtpquant publish` uploads this directory as an MTP sidecar
repo, with a card of its own.
""")
