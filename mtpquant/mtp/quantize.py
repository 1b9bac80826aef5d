"""The MTP layer's Linear weights and activation scales, quantized to NVFP4 or FP8 (ModelOpt layout).

Mirrors what nvidia-modelopt 0.47 does to a Linear it calibrates with ``max`` and exports, in pure
torch (``mtpquant.formats``), so the result is byte-identical to modelopt's own export of the same
module calibrated on the same activations (``tests/test_convert_mtp_quantize.py`` proves it):

- weight amax = max|W|; NVFP4 ``weight_scale_2 = amax / (6 * 448)``, shared by the Linears fed by one
  input (q/k/v; gate/up of the dense MLP, of the shared expert and of each routed expert), as
  ``preprocess_linear_fusion`` does at export; FP8 keeps one ``weight_scale`` per Linear (modelopt
  does not fuse FP8 scales).
- input amax = the largest |x| a Linear saw during calibration; routed experts share one amax per
  projection kind (``sync_moe_expert_amax``), fused groups share the max; ``input_scale = amax /
  (6 * 448)`` (FP8: ``amax / 448``).
- the family's unquantized MTP Linears (Qwen3.5: ``mtp.fc``, the router ``mlp.gate`` and
  ``mlp.shared_expert_gate``; ``MtpLayout.unquantized``) and the norms stay in the source precision and are
  excluded from quantization by exact name.

Calibration (``MtpCalibrator``) runs the reference MTP forward (``mtpquant.mtp.module``) on the
target's post-final-norm hidden states and the next tokens' embeddings, exactly the inputs engines
feed it, and records each Linear's input amax with forward pre-hooks.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtpquant.checkpoint.modules import linear_modules
from mtpquant.families import FUSED_EXPERT_PIECES, MtpLayout, family, matches
from mtpquant.formats.kinds import UNQUANTIZED, WRITTEN, StorageKind, precision_kind
from mtpquant.formats.nvfp4 import shared_global_scale
from mtpquant.mtp.module import MtpLayoutError
from mtpquant.mtp.names import checkpoint_name
from mtpquant.recipes.recipe import recipe_excludes

__all__ = [
    "MTP_FORMATS",
    "MtpCalibrator",
    "MtpQuantResult",
    "expert_linear",
    "fuse_mtp_experts",
    "is_fused_experts",
    "mtp_excluded_modules",
    "mtp_expert_input_groups",
    "mtp_fused_groups",
    "mtp_quantized_modules",
    "per_expert_shapes",
    "per_expert_weights",
    "quantize_mtp",
]

MTP_FORMATS = tuple(WRITTEN)  # the precision choices that quantize an MTP Linear (``formats.kinds``)

# Which MTP Linears stay unquantized and which share an input is family data (``MtpLayout.unquantized`` /
# ``fused_groups``); the Qwen3.5 / Qwen3-Next layout (one and the same) is the default.
_QWEN3_MTP = family("qwen3_5").mtp
# routed experts under mlp. (Qwen, DeepSeek, GLM) or mixer. (Nemotron-H)
_EXPERT = re.compile(r"^(?P<moe>.*\.(?:mlp|mixer)\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")


# one Linear of a per-expert bank (``mtp.layers.0.mlp.experts.3.gate_proj``): the bank, the expert, the projection
_EXPERT_LINEAR = re.compile(
    r"^(?P<stem>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>"
    + "|".join(sorted({p for pieces in FUSED_EXPERT_PIECES.values() for p in pieces}))
    + r")$"
)


def expert_linear(module: str) -> re.Match[str] | None:
    """``module`` as one Linear of a per-expert bank: ``stem`` (the bank, a fused experts module's name), ``e``,
    ``proj`` (``gate_proj``, ``up_proj``, ``down_proj``); None otherwise."""
    return _EXPERT_LINEAR.match(module)


_FUSED_EXPERTS = re.compile(r"^(?P<stem>.*\.mlp\.experts)\.(?P<fused>" + "|".join(FUSED_EXPERT_PIECES) + r")$")


def per_expert_shapes(shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """``shapes`` with fused 3-D experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) as the
    per-expert Linears they hold (``experts.{e}.gate_proj.weight`` [I, H], ...): the form quantized experts are
    written in (modelopt exports fused experts per expert, and vLLM loads that form)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None or len(shape) != 3:
            out[name] = tuple(shape)
            continue
        pieces = FUSED_EXPERT_PIECES[m["fused"]]
        rows = shape[1] // len(pieces)
        for e in range(shape[0]):
            for p in pieces:
                out[f"{m['stem']}.{e}.{p}.weight"] = (rows, shape[2])
    return out


def fuse_mtp_experts(tensors: Mapping[str, Tensor], experts: int, skip: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """A per-expert MTP expert bank (``...mlp.experts.{e}.{gate,up,down}_proj.weight``) as transformers' fused 3-D
    ``experts.gate_up_proj`` / ``experts.down_proj`` (gate rows then up rows, experts stacked); other tensors as
    they are, less the names ending in ``skip``. Both forms load in vLLM; the reference forward computes with the
    fused one. Each expert tensor is looked up once and copied into its place in the fused tensor, so a mapping that
    reads on lookup (``surgery.modes.load_mtp_layer``) holds the bank once, fused, not twice."""
    out: dict[str, Tensor] = {}
    stems: set[str] = set()
    for name in tensors:
        stem, sep, rest = name.partition(".mlp.experts.")
        if sep and rest.split(".", 1)[0].isdigit():
            stems.add(stem + ".mlp.experts")
        elif not name.endswith(skip):
            out[name] = tensors[name]
    for stem in sorted(stems):
        for fused, pieces in FUSED_EXPERT_PIECES.items():
            bank: Tensor | None = None
            try:
                for e in range(experts):
                    row = 0
                    for p in pieces:
                        t = tensors[f"{stem}.{e}.{p}.weight"]
                        if bank is None:  # torch.stack(torch.cat(...)) without the copies in between
                            shape = (experts, len(pieces) * t.shape[0], *t.shape[1:])
                            bank = torch.empty(shape, dtype=t.dtype, device=t.device)
                        bank[e, row : row + t.shape[0]].copy_(t)
                        row += t.shape[0]
            except KeyError as exc:
                raise MtpLayoutError(f"MTP expert bank {stem} lacks {exc.args[0]}") from None
            assert bank is not None
            out[f"{stem}.{fused}"] = bank
    return out


def per_expert_weights(weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``weights`` with fused 3-D experts split into per-expert Linear weights (``per_expert_shapes``; views)."""
    out: dict[str, Tensor] = {}
    for name, t in weights.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None or t.dim() != 3:
            out[name] = t
            continue
        pieces = FUSED_EXPERT_PIECES[m["fused"]]
        for e in range(t.shape[0]):
            for p, part in zip(pieces, t[e].chunk(len(pieces), dim=0)):
                out[f"{m['stem']}.{e}.{p}.weight"] = part
    return out


def mtp_excluded_modules(
    modules: Sequence[str], layout: MtpLayout = _QWEN3_MTP, targets: str = "all", exclude: Sequence[str] = ()
) -> list[str]:
    """The MTP Linears kept in BF16, as exact names to exclude: the family's (Qwen3.5: ``mtp.fc``, router,
    shared_expert_gate), the recipe's ``exclude`` matches, and with ``targets="experts"`` every Linear the engine
    builds that is not a routed expert."""
    quantized = set(mtp_quantized_modules(modules, layout, targets, exclude))
    built = {m for m in modules if _engine_linear(m, layout)}
    return sorted(m for m in modules if layout.is_unquantized(m) or (m in built and m not in quantized))


def mtp_quantized_modules(
    modules: Sequence[str], layout: MtpLayout = _QWEN3_MTP, targets: str = "all", exclude: Sequence[str] = ()
) -> list[str]:
    """The MTP Linears quantize mode quantizes: those the engine builds as quantizable Linears
    (``MtpLayout.engine_linears``; Qwen3.5: attention, MLP, shared and routed experts) less the ones kept BF16 (the
    family's, and those the recipe's ``quantization.exclude`` patterns match, as they do in the main model); with
    ``targets="experts"`` (a recipe that quantizes the main model's routed experts only) the routed experts."""
    return sorted(
        m
        for m in modules
        if _engine_linear(m, layout)
        and not layout.is_unquantized(m)
        and (targets == "all" or _EXPERT.match(m) is not None)
        and not recipe_excludes(exclude, m)
    )


def _engine_linear(module: str, layout: MtpLayout) -> bool:
    """Whether the engine builds ``module`` with the draft's quantization config: a listed Linear, or one expert
    Linear of a listed MoE ``experts`` module (``...mlp.experts.{e}.gate_proj`` of ``...mlp.experts``)."""
    if matches(module, layout.engine_linears):
        return True
    expert = _EXPERT.match(module)
    return expert is not None and matches(expert["moe"], layout.engine_linears)


def mtp_fused_groups(modules: Sequence[str], layout: MtpLayout = _QWEN3_MTP, targets: str = "all") -> list[list[str]]:
    """Groups of quantized Linears fed by one input: q/k/v, gate/up (dense, shared, each expert)."""
    return _fused_among(set(mtp_quantized_modules(modules, layout, targets)), layout)


def _fused_among(present: set[str], layout: MtpLayout) -> list[list[str]]:
    """``present`` in groups fed by one input (the family's fused leaves under one parent), the rest alone."""
    groups: list[list[str]] = []
    seen: set[str] = set()
    for m in sorted(present):
        parent, _, leaf = m.rpartition(".")
        for suffixes in layout.fused_groups:
            if leaf in suffixes:
                group = [f"{parent}.{s}" for s in suffixes if f"{parent}.{s}" in present]
                if m not in seen:
                    groups.append(group)
                    seen.update(group)
    for m in sorted(present - seen):
        groups.append([m])
    return sorted(groups)


def mtp_expert_input_groups(modules: Sequence[str], layout: MtpLayout = _QWEN3_MTP) -> list[list[str]]:
    """Routed-expert Linears that share one input amax: per MoE block, each projection kind over all experts."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for m in mtp_quantized_modules(modules, layout):
        match = _EXPERT.match(m)
        if match:
            groups[(match["moe"], match["proj"])].append(m)
    return [sorted(v, key=_natural) for _, v in sorted(groups.items())]


def _natural(name: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts (3-D ``gate_up_proj`` / ``down_proj`` parameters, e.g. ``Qwen4ExpTextExperts``)."""
    params = dict(module.named_parameters(recurse=False))
    return all(k in params and params[k].dim() == 3 for k in FUSED_EXPERT_PIECES)


class MtpCalibrator:
    """Records the input amax of every MTP Linear while the layer runs on real activations.

    Linears are observed by forward pre-hooks; fused 3-D experts (transformers' ``Qwen4ExpTextExperts``) by a
    forward hook that recomputes, per expert, the inputs its eager forward feeds each projection (the routed rows
    for gate/up, ``act(gate) * up`` of those rows for down), recorded under the per-expert Linear names the
    quantized experts are written with.
    """

    def __init__(self, layer: nn.Module) -> None:
        self.layer: nn.Module | None = layer
        self.linears: dict[str, nn.Linear] = {
            checkpoint_name(layer, name): mod for name, mod in layer.named_modules() if isinstance(mod, nn.Linear)
        }
        self.experts: dict[str, nn.Module] = {
            checkpoint_name(layer, name): mod for name, mod in layer.named_modules() if is_fused_experts(mod)
        }
        self.amax: dict[str, Tensor] = {}
        self.rows = 0

    def release(self) -> None:
        """Drop the layer and its modules once calibration is done, keeping the recorded amax: an appended MTP is a
        whole decoder layer (GLM-4.5-Air's: 4.7 GB), which would otherwise stay in memory through the export;
        quantize mode reads its weights again from the source when it writes them (``QuantizeMode.write``)."""
        self.layer = None
        self.linears.clear()
        self.experts.clear()

    def _record(self, name: str, x: Tensor) -> None:
        if x.numel() == 0:
            return
        # Same reduction as modelopt's MaxCalibrator (`reduce_amax`), in the input's dtype.
        local = x.detach().abs().amax().float().cpu()
        prev = self.amax.get(name)
        self.amax[name] = local if prev is None else torch.maximum(prev, local)

    def _experts_hook(self, name: str) -> object:
        def record(module: nn.Module, args: tuple[Tensor, ...], _output: Tensor) -> None:
            hidden, top_k_index = args[0], args[1]
            gate_up: Tensor = getattr(module, "gate_up_proj")  # noqa: B009 (a parameter, typed as a Tensor here)
            act: Any = getattr(module, "act_fn")  # noqa: B009
            for e in torch.unique(top_k_index).tolist():
                if not 0 <= e < gate_up.shape[0]:
                    continue
                token, _slot = torch.where(top_k_index == e)
                x = hidden[token]
                gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)  # Qwen4ExpTextExperts.forward, eager
                for proj in FUSED_EXPERT_PIECES["gate_up_proj"]:
                    self._record(f"{name}.{e}.{proj}", x)
                self._record(f"{name}.{e}.down_proj", act(gate) * up)

        return record

    def _hook(self, name: str) -> object:
        def record(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
            self._record(name, args[0])

        return record

    @contextmanager
    def recording(self) -> Iterator[MtpCalibrator]:
        """Hooks attached for the duration of the block."""
        handles = [mod.register_forward_pre_hook(self._hook(name)) for name, mod in self.linears.items()]  # type: ignore[arg-type]
        handles += [mod.register_forward_hook(self._experts_hook(name)) for name, mod in self.experts.items()]  # type: ignore[arg-type]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def observe(self, hidden: Tensor, next_token_embeds: Tensor, positions: Tensor | None = None) -> None:
        """Run the MTP on the target's hidden input (Qwen3.5: post-final-norm ``h_t``; Qwen4-Exp: the multi-stream
        state) and ``embed(x_{t+1})``, ``[B, T, *]`` each."""
        if self.layer is None:
            raise RuntimeError("the MTP calibrator was released: it observes no more activations")
        device = next(self.layer.parameters()).device
        with self.recording():
            self.layer(hidden.to(device), next_token_embeds.to(device), positions)
        self.rows += int(hidden.shape[0] * hidden.shape[1])


@dataclass(frozen=True)
class MtpQuantResult:
    """Quantized MTP tensors (ModelOpt layout) plus the names that stay as in the source."""

    tensors: dict[str, Tensor]  # new tensors: <module>.weight, .weight_scale, [.weight_scale_2], [.input_scale]
    quantized_modules: list[str]
    excluded_modules: list[str]  # exact names to list in exclude_modules / ignore
    kept_tensors: list[str]  # source tensor names copied unchanged (fc, norms, router, ...)
    fmt: str  # nvfp4 | fp8, or "mixed" (a precision per module: ``precision``)
    precision: dict[str, str] = field(default_factory=dict)  # every quantized module -> nvfp4 | fp8


def _input_amax(
    modules: Sequence[str], observed: Mapping[str, Tensor], layout: MtpLayout, targets: str
) -> dict[str, Tensor]:
    """Observed input amax of the quantized ``modules`` with modelopt's sharing: experts per kind, then fused
    groups."""
    amax = {m: observed[m].float() for m in modules if m in observed}
    for group in mtp_expert_input_groups(modules, layout):
        seen = [amax[m] for m in group if m in amax]
        if seen:
            shared = torch.stack(seen).amax()
            for m in group:
                amax[m] = shared
    for group in mtp_fused_groups(modules, layout, targets):
        seen = [amax[m] for m in group if m in amax]
        if seen:
            shared = torch.stack(seen).amax()
            for m in group:
                amax[m] = shared
    missing = [m for m in modules if m not in amax]
    if missing:
        raise ValueError(f"MTP calibration recorded no activations for {missing[0]} ({len(missing)} Linears in all)")
    return amax


_CHOICES = (UNQUANTIZED, *WRITTEN)  # the MTP precision choices: kept, or one of the kinds mtpquant writes


def _stored(module: str, kind: StorageKind, weight: Tensor, global_scale: Tensor | None) -> dict[str, Tensor]:
    """``module``'s weight quantized in ``kind``, under its full tensor names."""
    return {f"{module}.{suffix}": t for suffix, t in kind.quantize(weight, global_scale).items()}


def quantize_mtp(
    weights: Mapping[str, Tensor],
    input_amax: Mapping[str, Tensor] | None,
    fmt: str = "nvfp4",
    *,
    activations: bool = True,
    layout: MtpLayout = _QWEN3_MTP,
    targets: str = "all",
    exclude: Sequence[str] = (),
    precision: Mapping[str, str] | None = None,
) -> MtpQuantResult:
    """Quantize the MTP Linears of ``weights`` (the source ``mtp.*`` tensors, BF16).

    ``input_amax`` maps module names (``mtp.layers.0.self_attn.q_proj``) to the calibrated input
    amax; required when ``activations`` (W4A4 / FP8 W8A8), ignored otherwise. ``targets``: the recipe's
    (``experts``: the routed experts only, as in the main model); ``exclude``: the recipe's ``quantization.exclude``
    patterns (the Linears they match stay BF16, excluded by name, as in the main model). ``precision``: a precision
    per MTP Linear (``nvfp4`` | ``fp8`` | ``bf16``; a module absent keeps the source's) instead of ``fmt`` for the
    modules quantize mode quantizes (``convert --mtp auto``: one per precision group); every module's scales are
    those the uniform format gives it (scales are shared only within one precision group), so one precision for every
    group quantize mode quantizes writes the same bytes as ``fmt``.
    """
    weights = per_expert_weights(weights)
    modules = linear_modules(weights)
    if precision is None:
        if fmt not in MTP_FORMATS:
            raise ValueError(f"MTP format {fmt!r} is not one of {', '.join(MTP_FORMATS)}")
        kinds = dict.fromkeys(mtp_quantized_modules(modules, layout, targets, exclude), WRITTEN[fmt])
        excluded = mtp_excluded_modules(modules, layout, targets, exclude)
    else:
        unknown = sorted(set(precision) - set(modules))
        if unknown:
            raise ValueError(f"MTP precision given for {unknown[0]}, which is not an MTP Linear of the weights")
        wrong = sorted(p for p in precision.values() if p not in _CHOICES)
        if wrong:
            raise ValueError(f"MTP precision {wrong[0]!r} is not one of {', '.join(_CHOICES)}")
        kinds = {m: k for m, p in sorted(precision.items()) if (k := precision_kind(p)) is not None}
        built = {m for m in modules if _engine_linear(m, layout)}
        excluded = sorted(m for m in modules if m not in kinds and (m in built or layout.is_unquantized(m)))
        names = {k.name for k in kinds.values()}
        fmt = names.pop() if len(names) == 1 else "mixed"
    quantized = sorted(kinds)
    amax = _input_amax(quantized, input_amax or {}, layout, targets) if activations else {}
    out: dict[str, Tensor] = {}
    # kinds whose fused groups share a global scale first (modelopt's export: one weight_scale_2 per group)
    for group in _fused_among({m for m, k in kinds.items() if k.shared_scale}, layout):
        g = shared_global_scale([weights[m + ".weight"] for m in group])
        for m in group:
            out |= _stored(m, kinds[m], weights[m + ".weight"], g)
    for m in (m for m in quantized if not kinds[m].shared_scale):
        out |= _stored(m, kinds[m], weights[m + ".weight"], None)
    for m in quantized if activations else ():
        out[m + ".input_scale"] = kinds[m].input_scale_from_amax(amax[m])
    chosen = {m: k.name for m, k in kinds.items()}
    quantized_weights = {m + ".weight" for m in quantized}
    kept = sorted(n for n in weights if n not in quantized_weights)
    return MtpQuantResult(out, quantized, excluded, kept, fmt, chosen)
