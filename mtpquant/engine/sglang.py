"""SGLang: how it builds a checkpoint's MTP (its loader's rules), what inspect says of it, and a running SGLang server
(``python -m sglang.launch_server``), measured by its per-request speculative counters.

SGLang (0.5.23, as recorded from a real server in ``tests/fixtures/sglang-cpu/README.md``; the source:
sgl-project/sglang ``python/sglang/srt/models/qwen3_5_mtp.py::_mtp_quant_config`` and
``qwen3_next_mtp.py::Qwen3NextForCausalLMMTP.__init__``) decides the MTP's quantization for the whole layer
before any per-module rule:

- ``modelopt_fp4`` (every exported checkpoint is serialized): the MTP is built unquantized, in BF16, whatever is
  on disk ("Serialized Qwen3.5 ModelOpt checkpoints keep embedded MTP weights in BF16"; Qwen3-Next's MTP drops a
  ``modelopt_fp4`` config outright);
- ``modelopt_mixed``: quantized only when ``quantized_layers`` lists ``mtp.*`` modules, then module by module as
  listed; otherwise BF16;
- any other format (compressed-tensors, ...): the checkpoint's quantization config, with its own per-module rules;
- ``mtp.fc`` is a plain ``nn.Linear`` in both models: never quantized.

What a mismatch does there: SGLang's Linear weight loaders assert the checkpoint tensor's shape
(``layers/linear.py``: ``assert param_data.shape == loaded_weight.shape``) and copy it into the module's dtype;
scales a BF16 module has no parameter for are skipped (``ignore_suffixes`` in ``load_weights``, or "not found in
params_dict, skip loading"). So a packed NVFP4 weight in a module SGLang built in BF16 stops the server at load,
and an FP8 weight of the same shape loads as its raw values, without its scales: a wrong MTP that drafts badly.

What SGLang 0.5.23 answers (recorded in ``tests/fixtures/sglang-cpu``, from a real server):

- no ``/version`` route; ``GET /get_server_info`` (also ``/server_info``) returns every server argument, the
  ``version``, and the speculative settings. ``--speculative-algorithm NEXTN`` is rewritten to ``EAGLE``;
  ``speculative_num_steps`` (k), ``speculative_eagle_topk`` and ``speculative_num_draft_tokens``: with topk 1 and
  k + 1 draft tokens SGLang drafts the same k-step MTP chain as vLLM's ``num_speculative_tokens = k``; any other
  setting is a tree, which validate refuses (exit 43) rather than report as a chain.
- ``POST /generate`` takes token ids (``input_ids``) and ``sampling_params``, and returns per request, in
  ``meta_info``: ``spec_verify_ct`` (verify steps), ``spec_num_proposed_drafts`` (k per step),
  ``spec_num_correct_drafts`` and ``spec_correct_drafts_histogram`` (how many steps accepted 0, 1, .. k drafts).
  A chain accepts a prefix, so the drafts at position i were accepted in every step that accepted at least i:
  accepted_i = sum(histogram[i:]). The counts cover exactly the request they come with, whatever else the
  server runs. (``spec_accept_length`` is completion_tokens / verify steps, which counts the prefill token
  and the cut last step; AL here is 1 + accepted / steps, as for vLLM and the built-in path.)
- ``/metrics`` (with ``--enable-metrics``) has gauges for the last logging window only (0 until one closes):
  nothing here is taken from them. Its finished-request count (``sglang:e2e_request_latency_seconds_count``)
  is read before and after, only to report how many other requests the server finished meanwhile.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.precision import is_quantized, module_precision
from mtpquant.engine.http import EngineClientBase, EngineHttp
from mtpquant.engine.loading import (
    LM_HEADS,
    EngineModule,
    Expectation,
    FusedShardsError,
    ct_ignored,
    engine_modules,
    mixed_algo,
    modelopt_excluded,
)
from mtpquant.engine.server import (
    Completion,
    DraftCounts,
    EngineRun,
    RunRequest,
    ServerInfo,
    SpecConfig,
    server_args_of,
    sum_counts,
)
from mtpquant.errors import EngineAnswerError, EngineSpecDecodeError
from mtpquant.families import QWEN_MTP_NAMES, EngineRules, family, matches
from mtpquant.formats.kinds import by_label
from mtpquant.formats.quant_config import QuantMetadata
from mtpquant.records.sampling import SamplingSettings

if TYPE_CHECKING:
    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.engine.sizing import EngineMemory, Machine
    from mtpquant.engine.verdicts import EngineVerdict, ModuleReport, VerdictFacts
    from mtpquant.families import ModelSpec
    from mtpquant.records.sampling import SpecRule

__all__ = [
    "CHAIN_ALGORITHMS",
    "SglangClient",
    "nextn_args",
    "sglang_builds_quantized",
    "sglang_keeps_quantized_mtp",
    "sglang_mismatch",
    "sglang_mtp_build",
    "sglang_settings",
    "start_refusal",
]

log = logging.getLogger(__name__)

_QWEN3 = family("qwen3_5").engine

# SGLang's algorithms that draft with the checkpoint's own MTP layer: NEXTN is an alias of EAGLE.
CHAIN_ALGORITHMS = ("EAGLE", "NEXTN")
NEXTN_HINT = (
    "--speculative-algorithm NEXTN --speculative-num-steps K --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens K+1"
)
_FINISHED = "sglang:e2e_request_latency_seconds_count"  # a histogram's count: requests finished
# The server arguments a report records (what decides acceptance and memory), as SGLang names them.
REPORTED_ARGS = (
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
    "dtype",
    "quantization",
    "device",
    "tp_size",
    "context_length",
    "mem_fraction_static",
    "max_total_tokens",
    "max_running_requests",
)


# SGLang's refusals at start-up whose own words do not say what the server needs.
# - sglang/srt/speculative/draft_utils.py, DraftBackendFactory: NEXTN (EAGLE) drafts only with the attention backends
#   it lists (flashinfer, fa3, triton, ... on a GPU; intel_amx on a CPU with AMX); on a CPU without AMX SGLang chooses
#   torch_native, which it does not list: "EAGLE is not supported in [decode ]attention backend torch_native".
# - transformers' AutoProcessor, which SGLang calls for a vision-language architecture (Qwen3.5 is one) even to serve
#   text: "Can't load image processor for 'PATH'. ... containing a preprocessor_config.json file".
_NO_DRAFT_BACKEND = re.compile(r"EAGLE is not supported in (?:decode )?attention backend (\w+)")
_NO_PREPROCESSOR = re.compile(r"Can't load image processor for '([^']*)'.*preprocessor_config\.json")


# ---- loading rules ---------------------------------------------------------------------------------------------
def sglang_mtp_build(
    meta: QuantMetadata | None, is_mtp: Callable[[str], bool] = QWEN_MTP_NAMES.is_mtp
) -> tuple[bool, str]:
    """Whether SGLang builds the MTP with the checkpoint's quantization at all, and why (see the module docstring);
    ``is_mtp``: the family's MTP name test (``ModelSpec.is_mtp``; the ``mtp.`` namespace by default)."""
    if meta is None:
        return False, "the checkpoint declares no quantization"
    method = meta.vllm_method  # SGLang names the ModelOpt and compressed-tensors formats as vLLM does
    if method == "modelopt_fp4":
        return False, "SGLang builds the MTP of a serialized modelopt_fp4 checkpoint in BF16"
    if method == "modelopt_mixed":
        if any(is_mtp(name) for name in meta.quantized_layers):
            return True, "quantized_layers lists the MTP"
        return False, "SGLang builds the MTP in BF16: modelopt_mixed lists no MTP module in quantized_layers"
    return True, f"SGLang builds the MTP with the checkpoint's {method} quantization"


def sglang_builds_quantized(
    module: EngineModule,
    meta: QuantMetadata | None,
    rules: EngineRules = _QWEN3,
    is_mtp: Callable[[str], bool] = QWEN_MTP_NAMES.is_mtp,
) -> tuple[bool, str]:
    """Whether SGLang builds this MTP module quantized, and a short reason (``rules``, ``is_mtp``: the family's; the
    Qwen3.5 ones by default). Raises FusedShardsError."""
    if matches(module.prefix, rules.sglang_plain):
        return False, f"SGLang builds {module.prefix} as a plain Linear"
    if module.kind == "unquantized":
        return False, "SGLang builds it without a quantization config"
    whole, why = sglang_mtp_build(meta, is_mtp)
    if not whole or meta is None:
        return False, why
    if meta.is_compressed_tensors:
        ignored = ct_ignored(module.prefix, meta.exclude)
        return not ignored, "in compressed-tensors ignore" if ignored else "not in compressed-tensors ignore"
    if meta.is_modelopt and meta.algo.upper() == "MIXED_PRECISION":
        algo = mixed_algo(module.prefix, meta)
        return algo is not None, f"quantized_layers: {algo}" if algo else "absent from quantized_layers"
    if meta.is_modelopt:
        excluded = modelopt_excluded(module.prefix, meta.exclude)
        return not excluded, "excluded" if excluded else "not excluded"
    if meta.vllm_method == "fp8" and matches(module.prefix, LM_HEADS):
        return False, "SGLang builds the MTP head unquantized (its Fp8Config quantizes Linear layers and experts only)"
    return True, why




def build_expectation(module: EngineModule, meta: QuantMetadata | None, rules: EngineRules) -> Expectation:
    """The engine table's hook (``loading.mtp_load_refusal``): how SGLang builds ``module`` (the MTP decided as a
    whole first; the Qwen3.5 rules, as the precision search has always applied them)."""
    del rules
    q, reason = sglang_builds_quantized(module, meta)
    return Expectation(q, reason)


def sglang_keeps_quantized_mtp(ckpt: Checkpoint, meta: QuantMetadata | None) -> bool:
    """SGLang 0.5.23 ``_mtp_quant_config`` (models/qwen3_5_mtp.py 50-69, used by qwen4_exp_mtp.py 47): a
    MIXED_PRECISION config whose quantized_layers list ``mtp.*`` entries builds the MTP quantized; every other
    ModelOpt NVFP4 checkpoint gets an unquantized MTP. Applied where the registry says so (``sglang_mixed_mtp``)."""
    return (
        ckpt.spec.family.sglang_mixed_mtp
        and meta is not None
        and meta.vllm_method == "modelopt_mixed"
        and any(ckpt.is_mtp(k) for k in meta.quantized_layers)
    )


def sglang_mismatch(ckpt: Checkpoint, meta: QuantMetadata) -> str | None:
    """Where SGLang builds the MTP with the MIXED_PRECISION config, the first MTP module whose disk format its
    resolved quant_algo does not load. SGLang's MTP is one decoder layer under its own index (``mtp.layers.0``,
    qwen4_exp_mtp.py 42-65), so the checkpoint's names are looked up unchanged."""
    from mtpquant.engine.vllm import vllm_expectation  # SGLang resolves MIXED_PRECISION as vLLM does

    rules = ckpt.spec.family.engine
    present = {e.name: e for e in ckpt.mtp_tensors()}
    names = linear_modules(present)
    precision = {m: module_precision(ckpt.tensors, m) for m in names}
    for mod in engine_modules(names, rules):
        precs = {precision[m] for m in mod.members}
        disk = precs.pop() if len(precs) == 1 else "mixed"
        try:
            e = vllm_expectation(mod, meta, rules)
        except FusedShardsError as exc:
            return str(exc)
        if disk in ("mixed", "missing") or (not e.quantized and not is_quantized(disk)):
            continue
        if not e.quantized or (e.expects is not None and disk != e.expects):
            return f"{mod.prefix} is {disk} on disk but SGLang resolves {e.reason}"
    return None


# ---- what inspect says ------------------------------------------------------------------------------------------
def _module_kind(m: ModuleReport, rules: EngineRules) -> str:
    return next((e.kind for e in engine_modules(m.members, rules) if e.prefix == m.module), "linear")


def _build(
    m: ModuleReport, meta: QuantMetadata | None, rules: EngineRules, is_mtp: Callable[[str], bool]
) -> tuple[bool | None, str]:
    module = EngineModule(m.module, tuple(m.members), _module_kind(m, rules))
    try:
        return sglang_builds_quantized(module, meta, rules, is_mtp)
    except FusedShardsError as exc:
        return None, str(exc)


def _verdict(
    mods: Sequence[ModuleReport],
    meta: QuantMetadata | None,
    precision: str,
    rules: EngineRules,
    is_mtp: Callable[[str], bool],
) -> tuple[str, bool]:
    """What SGLang does with this MTP (its loader's rules, above), and whether it serves it with NEXTN."""
    built = {m.module: _build(m, meta, rules, is_mtp) for m in mods}
    for m in mods:
        q, reason = built[m.module]
        disk_q = m.disk != "mixed" and is_quantized(m.disk)
        if m.disk == "missing" or (q == disk_q and m.disk != "mixed"):
            continue
        if q is None:
            return f"SGLang will fail to load the MTP (NEXTN): {reason}", False
        if m.disk == "mixed":
            return f"SGLang will fail to load the MTP (NEXTN): {m.module} mixes precisions across its tensors", False
        if q:
            return (
                f"SGLang will fail to load the MTP (NEXTN): it builds {m.module} quantized ({reason}), but it is "
                f"{m.disk} on disk",
                False,
            )
        # a packed weight (not the BF16 shape): SGLang cannot load it into a module it built in BF16
        if (stored := by_label(m.disk)) is not None and stored.packed:
            return (
                f"SGLang will fail to load the MTP (NEXTN): {reason}, and the packed {m.disk} weight of {m.module} "
                "does not fit a BF16 module; serve without speculative decoding, or with vLLM",
                False,
            )
        return (
            f"SGLang will draft with a wrong MTP (NEXTN): {reason}, and loads the {m.disk} values of {m.module} "
            "without their scales",
            False,
        )
    if any(is_quantized(m.disk) for m in mods):
        _, why = sglang_mtp_build(meta, is_mtp)
        return f"SGLang: MTP loads ({precision}; {why})", True
    return f"SGLang: MTP loads ({precision})", True


def mtp_verdict(facts: VerdictFacts) -> EngineVerdict:
    """SGLang's verdict: the family's own MIXED_PRECISION resolution where it keeps the MTP quantized (qwen4_exp:
    ``sglang_mismatch`` checks it), else SGLang's decision for the whole MTP, module by module."""
    from mtpquant.engine.verdicts import EngineVerdict

    precision = facts.report["mtp_precision"]
    ckpt, meta = facts.ckpt, facts.meta
    if ckpt is not None and sglang_keeps_quantized_mtp(ckpt, meta):
        problem = sglang_mismatch(ckpt, meta) if meta is not None else None
        if problem is not None:
            return EngineVerdict(f"SGLang will fail to load: {problem}", False)
        return EngineVerdict(f"SGLang: MTP loads ({precision}; quantized_layers lists the MTP)", True)
    line, serves = _verdict(facts.report["mtp_modules"], meta, precision, facts.rules or _QWEN3, facts.is_mtp)
    return EngineVerdict(line, serves)


def module_names(modules: Sequence[str], spec: ModelSpec) -> list[str]:
    """SGLang's MTP keeps the checkpoint's names (one decoder layer under its own index)."""
    del modules, spec
    return []


def late_verdict(facts: VerdictFacts, verdict: str) -> str | None:
    """A family SGLang has no MTP drafter for (``drafters["sglang"] == ""``) says so, whatever its MTP holds."""
    del verdict
    from mtpquant.families import NEVER_SHIPPED

    if facts.ckpt is None:
        return None
    family_ = facts.ckpt.spec.family
    if family_.engine.drafters.get("sglang") == "" and family_.status != NEVER_SHIPPED:
        return f"SGLang: has no MTP drafter for {family_.display} (SGLang 0.5.23)"
    return None


def format_refusal(meta: QuantMetadata | None) -> str | None:
    """SGLang refuses no quantization format inspect reads before its MTP question."""
    del meta
    return None


def serve_command(ref: str, k: int) -> str:
    """``sglang.launch_server`` with the NEXTN chain of ``k`` drafts."""
    return (
        f"python -m sglang.launch_server --model-path {ref} --speculative-algorithm NEXTN "
        f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
    )


def plain_serve_command(ref: str) -> str:
    """SGLang serving ``ref`` without speculative decoding."""
    return f"python -m sglang.launch_server --model-path {ref}"


def card_without_mtp(precision: str, verdict: str, plain: str) -> list[str]:
    """The card's SGLang paragraph for a quantized MTP it does not load: why, and how to serve it without MTP."""
    return [
        f"> **SGLang and this {precision} MTP**: {verdict}. SGLang decides the MTP's "
        "quantization for the whole layer (a serialized `modelopt_fp4` checkpoint gets a BF16 MTP, "
        "`modelopt_mixed` a quantized one only when `quantized_layers` lists `mtp.*` modules). Use vLLM for MTP "
        "speculative decoding, or serve it in SGLang without it:",
        "",
        "```bash",
        plain,
        "```",
        "",
    ]


# ---- validate's launch and options -------------------------------------------------------------------------------
def quantized_mtp_note() -> str | None:
    """What heal's plan says of a healed MTP kept quantized, for this engine.
    SGLang builds a ModelOpt NVFP4 checkpoint's MTP BF16 whatever is on disk (``_mtp_quant_config``)."""
    return "SGLang serves only a BF16 MTP; the healed quantized MTP is for vLLM, as before"


def cpu_sampling_note() -> str | None:
    """SGLang's CPU server needs no note for sampled requests."""
    return None


def rule_refusal(rule: str, spec: SpecRule) -> str | None:
    """An SGLang NEXTN chain verifies with the target's probability of the argmax draft: ``--rule vllm`` only."""
    if spec.sampled_draft:  # argmax-draft (records.sampling.ARGMAX_DRAFT) is the one a NEXTN chain follows
        return (
            f"--rule {rule}: an SGLang NEXTN chain verifies with the target's probability of the argmax "
            "draft (--rule vllm); the other rules are built-in predictions only"
        )
    return None


def speculative_args(k: int, speculative: Mapping[str, str] | None) -> list[str]:
    """SGLang's NEXTN chain of ``k`` drafts (it takes no further speculative keys)."""
    del speculative
    return nextn_args(k)


def text_only_args(text_only: bool) -> list[str]:
    """SGLang serves text as it is: nothing to switch off."""
    del text_only
    return []


def memory_args(mem: EngineMemory) -> list[str]:
    """SGLang's arguments for a memory plan: the context, the requests, the KV pool in tokens and the static
    fraction that covers the weights and that pool."""
    out: list[str] = []
    if not mem.user_length:
        out += ["--context-length", str(mem.max_model_len)]
    if not mem.user_sized:
        out += ["--max-running-requests", str(mem.seqs), "--max-total-tokens", str(mem.seqs * mem.max_model_len)]
        if mem.fraction is not None:
            out += ["--mem-fraction-static", f"{mem.fraction:.3f}"]
    return out


def memory_fraction(machine: Machine, per_device: int, kv: int) -> float | None:
    """``--mem-fraction-static``: the weights, the KV pool and the engine's own buffers, of the device's memory (at
    least the recorded CPU server's 0.05, at most what is free)."""
    from mtpquant.engine.sizing import GPU_HEADROOM, MIN_FRACTION, OVERHEAD

    total, free = machine.total, machine.free
    if not total:
        return None
    fraction = max(MIN_FRACTION, min((per_device + kv + OVERHEAD) / total, 0.9))
    if free is not None:
        fraction = min(fraction, max(MIN_FRACTION, GPU_HEADROOM * free / total))
    return fraction


def start_refusal(log_text: str) -> str | None:
    """What an SGLang server that failed to start needs, in one line, when its log holds a refusal SGLang words for
    its own developers (see above); None otherwise."""
    found = _NO_DRAFT_BACKEND.search(log_text)
    if found is not None:
        backend = found.group(1)
        chosen = " (what it chooses on a CPU without AMX)" if backend == "torch_native" else ""
        return (
            f"SGLang cannot draft NEXTN on the {backend} attention backend{chosen}: its MTP speculative decoding "
            "needs a GPU (flashinfer, fa3 or triton attention) or an Intel CPU with AMX (intel_amx); here, measure "
            "with --engine vllm or the built-in path"
        )
    found = _NO_PREPROCESSOR.search(log_text)
    if found is not None:
        return (
            f"{found.group(1)}: no preprocessor_config.json, which SGLang reads to serve this vision-language "
            "architecture, text too (the Qwen3.5 checkpoints ship it and video_preprocessor_config.json: copy both "
            "from the base model)"
        )
    return None


def nextn_args(k: int) -> list[str]:
    """SGLang's MTP chain of ``k`` drafts per step (Qwen's recommended form, with k = 3)."""
    return [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        str(k),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(k + 1),
    ]


def sglang_settings(http: EngineHttp) -> dict[str, Any] | None:
    """The server arguments an SGLang server states at ``/get_server_info`` (or ``/server_info``), or None when
    the server at ``http`` is not SGLang."""
    for path in ("/get_server_info", "/server_info"):
        resp = http.request("GET", path)
        if resp.status_code != 200:
            continue
        try:
            body = resp.json()
        except ValueError:
            return None
        if isinstance(body, dict) and isinstance(body.get("version"), str) and "model_path" in body:
            return body
        return None
    return None


def _int(settings: Mapping[str, Any], name: str) -> int | None:
    value = settings.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(settings: Mapping[str, Any], name: str) -> str | None:
    value = settings.get(name)
    return value if isinstance(value, str) and value else None


class SglangClient(EngineClientBase):
    """Talks to one SGLang server at ``url`` through its native routes."""

    engine = "sglang"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.settings: dict[str, Any] = {}  # what /get_server_info said (info_from)

    # ---- what the server is -----------------------------------------------------------------------------
    def info(self) -> ServerInfo:
        """``/get_server_info``: version, served model, context length and speculative settings."""
        settings = sglang_settings(self.http)
        if settings is None:
            raise EngineAnswerError(
                f"{self.url}: not an SGLang server (no /get_server_info answering "
                '{"version": ..., "model_path": ...})'
            )
        return self.info_from(settings)

    def info_from(self, settings: Mapping[str, Any]) -> ServerInfo:
        """The ``ServerInfo`` of the settings ``/get_server_info`` returned."""
        self.settings = dict(settings)
        model_path = _str(settings, "model_path")
        served = _str(settings, "served_model_name") or model_path
        if served is None:
            raise EngineAnswerError(f"{self.url}/get_server_info: no model_path or served_model_name")
        spec = SpecConfig(
            algorithm=_str(settings, "speculative_algorithm"),
            k=_int(settings, "speculative_num_steps"),
            topk=_int(settings, "speculative_eagle_topk"),
            draft_tokens=_int(settings, "speculative_num_draft_tokens"),
            draft_model=_str(settings, "speculative_draft_model_path"),
            adaptive=settings.get("speculative_adaptive") is True,
        )
        return ServerInfo(
            self.url,
            "sglang",
            str(settings["version"]),
            (served,),
            _int(settings, "context_length"),
            spec,
            model_path,
        )

    def server_args(self) -> tuple[str, ...]:
        """The launch arguments that decide what is measured, as the server states them."""
        return server_args_of(self.settings, REPORTED_ARGS)

    def check_chain(self, info: ServerInfo) -> int:
        """k when the server drafts the checkpoint's MTP as a k-step chain; otherwise exit 43, saying why."""
        spec = info.speculative or SpecConfig(None)
        model = info.models[0]
        k = spec.k
        fix = NEXTN_HINT
        if spec.algorithm is None:
            raise EngineSpecDecodeError(
                f"{self.url}: {info.display} serves {model} without speculative decoding "
                f"(speculative_algorithm null): start it with {fix}"
            )
        if spec.algorithm.upper() not in CHAIN_ALGORITHMS:
            raise EngineSpecDecodeError(
                f"{self.url}: {info.display} drafts with {spec.algorithm}, not with the checkpoint's MTP: "
                f"start it with {fix}"
            )
        if k is None or k < 1:
            raise EngineAnswerError(f"{self.url}/get_server_info: speculative_num_steps is {k!r}")
        if spec.adaptive:
            raise EngineSpecDecodeError(
                f"{self.url}: {info.display} changes its number of draft steps as it runs (speculative_adaptive): "
                "per-position acceptance needs a fixed k; start it without --speculative-adaptive"
            )
        topk = spec.topk if spec.topk is not None else 1
        if topk != 1 or (spec.draft_tokens is not None and spec.draft_tokens != k + 1):
            raise EngineSpecDecodeError(
                f"{self.url}: {info.display} drafts a tree (speculative_eagle_topk {topk}, "
                f"speculative_num_draft_tokens {spec.draft_tokens} for {k} steps), not the {k}-step MTP chain "
                f"validate measures: start it with --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
            )
        return k

    # ---- requests -----------------------------------------------------------------------------------------
    def generate(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingSettings,
        k: int,
        http: EngineHttp | None = None,
    ) -> tuple[Completion, DraftCounts]:
        """One ``/generate`` request of token ids, and the speculative counts SGLang gives for it."""
        payload = {"input_ids": [int(i) for i in ids], "sampling_params": sampling.sglang_fields(max_new_tokens)}
        body = (http or self.http).json("/generate", payload=payload, timeout=self.generate_timeout, what="an SGLang")
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            raise EngineAnswerError(f"{self.url}/generate: no meta_info in the answer")
        meta = body["meta_info"]
        tokens = body.get("output_ids")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineAnswerError(f"{self.url}/generate: no output_ids in the answer")
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else finish
        if reason not in ("length", None):
            detail = finish.get("message") if isinstance(finish, dict) else None
            raise EngineAnswerError(
                f"{self.url}/generate: the request finished with {reason!r}"
                f"{': ' + str(detail).splitlines()[0][:200] if detail else ''} after {len(tokens)} of "
                f"{max_new_tokens} tokens"
            )
        completion = Completion(tuple(int(i) for i in ids), tuple(int(t) for t in tokens), reason)
        return completion, self._counts(meta, k)

    def _counts(self, meta: Mapping[str, Any], k: int) -> DraftCounts:
        where = f"{self.url}/generate: meta_info"
        names = ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts")
        values = [meta.get(n) for n in names]
        hist = meta.get("spec_correct_drafts_histogram")
        if not all(isinstance(v, int) for v in values) or not isinstance(hist, list):
            missing = [n for n, v in zip(names, values) if not isinstance(v, int)]
            if not isinstance(hist, list):
                missing.append("spec_correct_drafts_histogram")
            raise EngineAnswerError(f"{where} has no {', '.join(missing)} (SGLang reports them per request)")
        steps, correct, proposed = (int(v) for v in values)  # type: ignore[arg-type]
        if len(hist) != k + 1 or not all(isinstance(h, int) and h >= 0 for h in hist):
            raise EngineAnswerError(
                f"{where}: spec_correct_drafts_histogram {hist} is not a count of 0..{k} accepted drafts"
            )
        if sum(hist) != steps or sum(j * h for j, h in enumerate(hist)) != correct or proposed != steps * k:
            raise EngineAnswerError(
                f"{where}: the counters disagree (spec_verify_ct {steps}, spec_num_correct_drafts {correct}, "
                f"spec_num_proposed_drafts {proposed}, histogram {hist}): not a {k}-step chain"
            )
        per_position = tuple(sum(hist[i + 1 :]) for i in range(k))
        return DraftCounts(steps, proposed, correct, per_position)

    def finished_requests(self, model: str) -> float | None:
        """Requests the server has finished for ``model`` (its ``/metrics``), or None without metrics."""
        from mtpquant.engine.counters import metric_total

        text = self.http.text("/metrics")
        if text is None:
            return None
        try:
            return metric_total(text, _FINISHED, model)
        except ValueError as exc:
            raise EngineAnswerError(f"{self.url}/metrics: not Prometheus text ({exc})") from None

    def run(self, request: RunRequest, info: ServerInfo) -> EngineRun:
        """One request per prompt (prompt i with ``sampling.for_prompt(i)``; a group's requests ``concurrency`` in
        flight at once); the counts are the sum of the requests' own, per group too."""
        k = self.check_chain(info)
        model, sampling = request.model, request.sampling
        before = self.finished_requests(model)
        completions: dict[int, Completion] = {}
        parts: list[DraftCounts] = []

        def one(http: EngineHttp, item: tuple[int, Sequence[int], int]) -> tuple[Completion, DraftCounts]:
            i, ids, n = item
            return self.generate(ids, n, sampling.for_prompt(i), k, http)

        for group in request.split():
            items = [(i, request.prompts[i], request.max_tokens[i]) for i in group]
            done = self.each(items, one, request.concurrency)
            completions.update((i, completion) for i, (completion, _) in zip(group, done))
            parts.append(sum_counts([counts for _, counts in done]))
        counts = sum_counts(parts)
        if counts.steps == 0:
            raise EngineSpecDecodeError(
                f"{self.url}: {model} ran no speculative verify step during {len(completions)} requests"
            )
        after = self.finished_requests(model) if before is not None else None
        other = max(0, round(after - before) - len(completions)) if after is not None and before is not None else 0
        return EngineRun(model, request.ordered(completions), counts, other, False, tuple(parts))


def probe(http: EngineHttp, generate_timeout: float) -> tuple[SglangClient, ServerInfo] | None:
    """The client of the server behind ``http`` and what it says, when it is SGLang (``/get_server_info``); else
    None."""
    settings = sglang_settings(http)
    if settings is None:
        return None
    client = SglangClient(http.url, generate_timeout=generate_timeout, http=http)
    return client, client.info_from(settings)


Client = SglangClient
PROBE_MISS = 'not an SGLang server (no /get_server_info answering {"version": ..., "model_path": ...})'
