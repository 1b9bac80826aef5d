"""vLLM: how it builds a checkpoint's modules (its loader's rules), what inspect says of it, and a running vLLM
OpenAI-compatible server (version, models, tokenization, completions, and its counters).

The rules mirror vLLM 0.32's (``ModelOptQuantConfigBase.is_layer_excluded`` and ``apply_vllm_mapper`` in
``quantization/modelopt.py``, ``is_layer_skipped`` in ``quantization/utils/quant_utils.py``, compressed-tensors
``should_ignore_layer``, AutoRound's format through ``quantization/inc/inc.py`` and ``inc/config_parser.py``); the
matching they share with SGLang is ``engine/loading.py``'s.

vLLM's speculative-decoding counters are server-wide Prometheus counters (``engine/counters.py``): a measurement
reads them before and after its requests and subtracts, and the request counter says whether other clients'
requests finished meanwhile (their drafts are then in the numbers). ``/version`` answering ``{"version": ...}``
is what tells a vLLM server from another one. mtpquant never imports vLLM.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mtpquant.engine.counters import CounterSnapshot, parse_metrics
from mtpquant.engine.http import METRICS_CAP, EngineClientBase, EngineHttp
from mtpquant.engine.loading import (
    LINEAR_FORMATS,
    LM_HEADS,
    MODELOPT_QUANT_ALGOS,
    MOE_METHODS,
    UNQUANTIZED_MOE,
    EngineModule,
    Expectation,
    FusedShardsError,
    ct_ignored,
    mixed_algo,
    modelopt_excluded,
    packed_base,
)
from mtpquant.engine.server import Completion, DraftCounts, EngineRun, RunRequest, ServerInfo
from mtpquant.errors import EngineAnswerError, EngineSpecDecodeError
from mtpquant.families import EngineRules, family, matches
from mtpquant.formats.quant_config import QuantMetadata
from mtpquant.records.sampling import GREEDY, SamplingSettings

if TYPE_CHECKING:
    from mtpquant.engine.sizing import EngineMemory, Machine
    from mtpquant.engine.verdicts import EngineVerdict, VerdictFacts
    from mtpquant.families import ModelSpec
    from mtpquant.records.sampling import SpecRule

__all__ = [
    "INC_DATA_TYPES",
    "VllmClient",
    "auto_round_quantized",
    "build_expectation",
    "is_vllm",
    "vllm_builds_quantized",
    "vllm_expectation",
    "vllm_format_refusal",
]

log = logging.getLogger(__name__)

_QWEN3 = family("qwen3_5").engine
# Element types vLLM 0.32's INC (AutoRound) config accepts: INCConfig.SUPPORTED_DTYPES, plus the mx_fp family.
INC_DATA_TYPES = ("int", "fp", "mx_fp")
_REGEX_CHARS = set(r"*+?^$()[]{}|\\")
_FP8_HEAD = "vLLM's Fp8Config builds the LM head unquantized (it quantizes Linear layers and experts only)"


# ---- loading rules ---------------------------------------------------------------------------------------------
def vllm_format_refusal(meta: QuantMetadata | None) -> str | None:
    """Why vLLM refuses the checkpoint's quantization format outright (before any MTP question), or None."""
    if meta is not None and meta.is_modelopt and meta.algo.upper() not in MODELOPT_QUANT_ALGOS:
        return (
            f"vLLM 0.32's ModelOpt config does not accept quant_algo {meta.algo!r} (it accepts "
            f"{', '.join(MODELOPT_QUANT_ALGOS)}): the checkpoint will not load"
        )
    if meta is None or not meta.is_auto_round:
        return None
    dt = meta.data_type or "int"
    if dt in INC_DATA_TYPES or "mx_fp" in dt:
        return None
    return (
        f"vLLM 0.32 does not support auto-round data_type {dt!r} (INC supports {', '.join(INC_DATA_TYPES)}): "
        "the checkpoint will not load"
    )


def _extra_bits(prefix: str, extra: Mapping[str, Any]) -> int | None:
    """``bits`` of the extra_config entry for ``prefix`` (exact, suffix, then regex key), as INC resolves it."""
    for key in (prefix, f"model.{prefix}"):
        cfg = extra.get(key)
        if isinstance(cfg, dict):
            return int(cfg.get("bits", 16))
    for key, cfg in extra.items():
        if isinstance(cfg, dict) and prefix.endswith(f".{key}"):
            return int(cfg.get("bits", 16))
    for key, cfg in extra.items():
        if isinstance(cfg, dict) and any(c in _REGEX_CHARS for c in key):
            try:
                if re.search(key, prefix):
                    return int(cfg.get("bits", 16))
            except re.error:
                continue
    return None


def auto_round_quantized(prefix: str, meta: QuantMetadata) -> tuple[bool, str]:
    """AutoRound: an ``extra_config`` entry decides (bits >= 16: unquantized); else ``block_name_to_quantize``."""
    packed = packed_base(prefix)
    names = [f"{packed[0]}.{s}" for s in packed[1]] if packed else [prefix]
    bits = {_extra_bits(n, meta.extra_config) for n in names}
    if len(bits) > 1:
        raise FusedShardsError(f"the shards of {prefix} have different bits in the auto-round extra_config")
    (b,) = bits
    if b is not None:
        return b < 16, f"auto-round extra_config bits {b}"
    if meta.blocks:
        inside = any(prefix.startswith(block) for block in meta.blocks)
        return inside, ("inside" if inside else "outside") + " auto-round block_name_to_quantize"
    if prefix == "lm_head" or prefix.endswith(".lm_head"):
        return False, "vLLM builds lm_head unquantized for auto-round"
    return True, "auto-round quantizes every Linear"



def _embedding_expectation(
    prefix: str, meta: QuantMetadata | None, packed: Mapping[str, tuple[str, ...]]
) -> Expectation:
    """vLLM 0.32 ``Qwen4ExpPLEEmbeddingMethod.from_quant_config`` (models/qwen4_exp/common/ngram_embedding.py
    174-227): the n-gram table is FP8 only when MIXED_PRECISION resolves it to FP8 (or the checkpoint is FP8
    serialized); a ModelOpt / compressed-tensors config that does not exclude it raises NotImplementedError."""
    if meta is None:
        return Expectation(False, "checkpoint declares no quantization", "BF16")
    if meta.is_modelopt and meta.algo.upper() == "MIXED_PRECISION":
        algo = mixed_algo(prefix, meta, packed)
        if algo == "FP8":
            return Expectation(True, "quantized_layers: FP8", "FP8", "Qwen4ExpPLEFp8EmbeddingMethod")
        label = f"quantized_layers: {algo}" if algo else "absent from quantized_layers"
        return Expectation(False, label, "BF16", "Qwen4ExpPLEUnquantizedEmbeddingMethod")
    excluded = (
        ct_ignored(prefix, meta.exclude, packed)
        if meta.is_compressed_tensors
        else modelopt_excluded(prefix, meta.exclude, packed)
        if meta.is_modelopt
        else False
    )
    if excluded:
        return Expectation(False, "excluded", "BF16", "Qwen4ExpPLEUnquantizedEmbeddingMethod")
    config = {"modelopt_fp4": "ModelOptNvFp4Config", "modelopt": "ModelOptFp8Config"}.get(
        meta.vllm_method, "CompressedTensorsConfig" if meta.is_compressed_tensors else meta.vllm_method
    )
    refusal = (
        f"{prefix} is not excluded, and vLLM's PLE n-gram table raises NotImplementedError: Qwen4Exp PLE embedding "
        f"does not support quantization config {config}"
    )
    return Expectation(False, "not excluded", refusal=refusal)


def _mixed_expectation(
    module: EngineModule, prefix: str, meta: QuantMetadata, packed: Mapping[str, tuple[str, ...]]
) -> Expectation:
    algo = mixed_algo(prefix, meta, packed)
    if module.kind == "experts":
        expects, method, params = MOE_METHODS.get(algo or "", UNQUANTIZED_MOE)
        label = f"quantized_layers: {algo}" if algo else "absent from quantized_layers"
        return Expectation(algo in MOE_METHODS, label, expects, method, params)
    if algo is None:
        return Expectation(False, "absent from quantized_layers", "BF16", "UnquantizedLinearMethod")
    if algo not in LINEAR_FORMATS:
        return Expectation(False, f"quantized_layers: {algo} (not a Linear algo)", "BF16", "UnquantizedLinearMethod")
    return Expectation(True, f"quantized_layers: {algo}", LINEAR_FORMATS[algo], f"ModelOptLinearMethod ({algo})")


def vllm_expectation(
    module: EngineModule,
    meta: QuantMetadata | None,
    rules: EngineRules = _QWEN3,
    engine_prefix: str | None = None,
) -> Expectation:
    """How vLLM 0.32 builds one engine module of a checkpoint with this metadata. Raises FusedShardsError.

    ``engine_prefix``: the module's name as the engine builds it (vLLM renames Qwen4-Exp MTP layers); ``meta``
    must then carry the engine's renamed exclusion lists too.
    """
    prefix = engine_prefix or module.prefix
    packed = rules.packed
    if module.kind == "embedding":
        return _embedding_expectation(prefix, meta, packed)
    if meta is None:
        return Expectation(False, "checkpoint declares no quantization")
    if module.kind == "unquantized":
        return Expectation(False, "vLLM builds it without a quantization config")
    forced = next(
        (r for r in rules.forced_unquantized if r.method == meta.vllm_method and matches(prefix, (r.pattern,))), None
    )
    if forced is not None:
        excluded = modelopt_excluded(prefix, meta.exclude, packed)
        if excluded and forced.workaround:
            return Expectation(False, "excluded")
        return Expectation(
            False, f"forced unquantized by {forced.source}", workaround=forced.workaround and not excluded
        )
    if meta.is_compressed_tensors:
        ignored = ct_ignored(prefix, meta.exclude, packed)
        return Expectation(
            not ignored, "in compressed-tensors ignore" if ignored else "not in compressed-tensors ignore"
        )
    if meta.is_modelopt and meta.algo.upper() == "MIXED_PRECISION":
        if modelopt_excluded(prefix, meta.exclude, packed):
            return Expectation(False, "excluded")
        return _mixed_expectation(module, prefix, meta, packed)
    if meta.is_modelopt:
        excluded = modelopt_excluded(prefix, meta.exclude, packed)
        return Expectation(not excluded, "excluded" if excluded else "not excluded")
    if meta.is_auto_round:
        q, reason = auto_round_quantized(prefix, meta)
        return Expectation(q, reason)
    if meta.vllm_method == "fp8" and matches(prefix, LM_HEADS):
        return Expectation(False, _FP8_HEAD)
    return Expectation(True, f"quant_method {meta.method!r}")


def vllm_builds_quantized(module: EngineModule, meta: QuantMetadata | None) -> tuple[bool, str]:
    """Whether vLLM builds the module quantized, and a short reason (Qwen3.5's rules). Raises FusedShardsError."""
    e = vllm_expectation(module, meta)
    return e.quantized, e.reason




def build_expectation(module: EngineModule, meta: QuantMetadata | None, rules: EngineRules) -> Expectation:
    """The engine table's hook (``loading.mtp_load_refusal``): how vLLM builds ``module``."""
    return vllm_expectation(module, meta, rules)


def unquantized_why(reason: str) -> str:
    """Why vLLM builds a module unquantized, as a verdict says it: "excluded from quantization", or that vLLM builds it
    without a quantization config (a plain ``nn.Linear`` such as DeepSeek's ``eh_proj``, a router)."""
    if reason.startswith("vLLM builds it"):
        return "vLLM builds it without a quantization config"
    return "excluded from quantization"


# ---- what inspect says ------------------------------------------------------------------------------------------
def mtp_verdict(facts: VerdictFacts) -> EngineVerdict:
    """vLLM's verdict from the MTP modules as it builds them (``facts.report["mtp_modules"]``: inspect's
    ``ModuleReport`` per module, from ``vllm_expectation``)."""
    from mtpquant.engine.verdicts import EngineVerdict

    report = facts.report
    mods = report["mtp_modules"]
    notes: list[str] = []
    # modules vLLM refuses outright (fused shards disagree) come first: that is the load error users see
    broken = sorted((m for m in mods if not m.consistent), key=lambda m: m.vllm_quantized is not None)
    if broken:
        first = broken[0]
        line = f"vLLM will fail to load: {first.module} is {first.disk} on disk but " + (
            "declared quantized" if first.vllm_quantized else unquantized_why(first.reason)
        )
        if first.vllm_quantized is None:
            line = f"vLLM will fail to load: {first.reason}"
        elif first.vllm_quantized and first.reason.startswith("excluded as "):  # one name form excluded
            line = f"vLLM will fail to load: {first.module} is {first.disk} on disk and {first.reason}"
        elif first.expects is not None and first.disk not in ("mixed", first.expects):
            line = f"vLLM will fail to load: {first.module} is {first.disk} on disk but vLLM loads it as " + (
                f"{first.expects} ({first.reason})"
            )
        return EngineVerdict(line, False)
    line = f"vLLM: MTP loads ({report['mtp_precision']})"
    for m in (m for m in mods if m.workaround):
        line += (
            f"; {m.module} is not covered by the exclusions and loads only through vLLM's hard-coded "
            f"{m.module} workaround"
        )
        notes.append(
            f"exclusions do not cover {m.module}: only vLLM's hard-coded modelopt_fp4 workaround keeps it "
            "unquantized (graft --fix-metadata repairs it: the fix line)"
        )
    return EngineVerdict(line, True, tuple(notes))


def _without_mtp(facts: VerdictFacts) -> str | None:
    """What vLLM's drafter does with a declared MTP none of whose weights it finds, for families whose drafter is
    named in the registry (the family's own check, else its model loader's: ``DefaultModelLoader.track_weights_loading``
    runs for an unquantized checkpoint only); None: the generic verdict stands."""
    from mtpquant.engine.verdicts import MISSING

    ckpt, report = facts.ckpt, facts.report
    if ckpt is None or not report["mtp_declared"] or report["mtp_present_tensors"] or report["mtp_removed"]:
        return None
    rules = ckpt.spec.family.engine
    if not rules.drafters.get("vllm"):
        return None
    if rules.missing_mtp_error:
        layer = ckpt.spec.mtp_names.first
        return f"{MISSING}; vLLM will fail to load: {rules.missing_mtp_error.format(layer=layer)}"
    if facts.meta is None:
        return f"{MISSING}; vLLM will fail to load: ValueError: Following weights were not initialized from checkpoint"
    return f"{MISSING}; vLLM loads without an error and drafts from uninitialized MTP weights"


def module_names(modules: Sequence[str], spec: ModelSpec) -> list[str]:
    """The MTP ``modules`` as vLLM's draft names them, where it renames them (``ModelSpec.engine_mtp_name``)."""
    given = set(modules)
    return [n for n in (spec.engine_mtp_name(m) for m in modules) if n not in given]


def late_verdict(facts: VerdictFacts, verdict: str) -> str | None:
    """vLLM's verdict once the family's status is known, where it replaces the MTP's (its serve command goes): the
    main model's first failure when the MTP would load but the model does not; a declared MTP with no weights."""
    replaced = None
    if facts.main_findings and verdict.startswith("vLLM: MTP loads"):
        replaced = facts.main_findings[0]  # the MTP would load, but the main model does not: that is what users see
    return _without_mtp(facts) or replaced


def format_refusal(meta: QuantMetadata | None) -> str | None:
    """Why vLLM refuses the checkpoint's quantization format outright (``vllm_format_refusal``)."""
    return vllm_format_refusal(meta)


def serve_command(ref: str, k: int) -> str:
    """``vllm serve`` with the MTP drafting ``k`` tokens per step."""
    return f'vllm serve {ref} --speculative-config \'{{"method":"mtp","num_speculative_tokens":{k}}}\''


# ---- validate's launch and options -------------------------------------------------------------------------------
CPU_SAMPLING_NOTE = (
    "vLLM 0.32.0's CPU build mis-expands each request's temperature, top-k and top-p to its drafts in the rejection "
    "sampler (vllm/utils/cpu_triton_utils.py::_expand_kernel_impl fills an int64 copy that is never read back), so "
    "an unpatched CPU server judges sampled drafts against uninitialized distributions and accepts almost none; "
    "mtpquant's test engine environment corrects it (tests/support/vllm_env.py). GPU builds run the Triton kernel."
)


def quantized_mtp_note() -> str | None:
    """What heal's plan says of a healed MTP kept quantized, for this engine.
    vLLM loads a quantized MTP (heal's output for it): no note."""
    return None


def cpu_sampling_note() -> str | None:
    """The note a sampled measurement on vLLM's CPU backend carries (``CPU_SAMPLING_NOTE``)."""
    return CPU_SAMPLING_NOTE


def rule_refusal(rule: str, spec: SpecRule) -> str | None:
    """Why a vLLM server cannot verify drafts by ``rule`` (only the rules vLLM 0.32 has a mode for)."""
    if spec.vllm_config is None:
        return f"--rule {rule}: vLLM 0.32 has no such verification mode; it is a built-in prediction only"
    return None


def speculative_args(k: int, speculative: Mapping[str, str] | None) -> list[str]:
    """vLLM's MTP chain of ``k`` drafts per step (``speculative``: further ``--speculative-config`` keys, a
    verification rule's)."""
    config = {"method": "mtp", "num_speculative_tokens": k, **(speculative or {})}
    return ["--speculative-config", json.dumps(config)]


def text_only_args(text_only: bool) -> list[str]:
    """``--limit-mm-per-prompt`` with no image or video: validation sends text only (which also saves the encoder
    cache)."""
    return ["--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0})] if text_only else []


def start_refusal(log_text: str) -> str | None:
    """vLLM words its start-up refusals for its users: the log's own line says it (``EngineProcess.failure_line``)."""
    del log_text
    return None


def memory_args(mem: EngineMemory) -> list[str]:
    """vLLM's arguments for a memory plan: the context, the sequences and the KV cache in bytes (on a GPU also the
    utilization its start-up check accepts)."""
    out: list[str] = []
    if not mem.user_length:
        out += ["--max-model-len", str(mem.max_model_len)]
    if not mem.user_sized:
        out += ["--max-num-seqs", str(mem.seqs), "--kv-cache-memory-bytes", str(mem.kv)]
        if mem.fraction is not None:
            out += ["--gpu-memory-utilization", f"{mem.fraction:.3f}"]
    return out


def memory_fraction(machine: Machine, per_device: int, kv: int) -> float | None:
    """On a GPU, the ``--gpu-memory-utilization`` the free memory meets (``vllm/v1/worker/utils.py::request_memory``
    refuses more than is free); on the CPU backend ``--kv-cache-memory-bytes`` replaces the utilization check."""
    del per_device, kv
    from mtpquant.engine.sizing import GPU_HEADROOM

    total, free = machine.total, machine.free
    if machine.device != "cpu" and total and free is not None:
        return min(0.9, GPU_HEADROOM * free / total)
    return None


# ---- the server ------------------------------------------------------------------------------------------------

SPEC_HINT = 'start it with --speculative-config \'{"method":"mtp","num_speculative_tokens":K}\''


def is_vllm(http: EngineHttp) -> str | None:
    """The version a vLLM server states at ``/version``, or None when the server is not vLLM."""
    resp = http.request("GET", "/version")
    if resp.status_code != 200:
        return None
    try:
        body = resp.json()
    except ValueError:
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return version if isinstance(version, str) else None


class VllmClient(EngineClientBase):
    """Talks to one vLLM OpenAI server at ``url``."""

    engine = "vllm"

    def info(self) -> ServerInfo:
        """``/version`` and ``/v1/models``; refuses a server that is not vLLM."""
        version = is_vllm(self.http)
        if version is None:
            raise EngineAnswerError(f'{self.url}: not a vLLM server (no /version answering {{"version": ...}})')
        data = self.listed_models("a vLLM OpenAI")
        ids = tuple(str(m.get("id")) for m in data if isinstance(m, dict))
        mml = data[0].get("max_model_len") if isinstance(data[0], dict) else None
        return ServerInfo(self.url, "vllm", version, ids, mml if isinstance(mml, int) else None)

    def counters(self, model: str) -> CounterSnapshot:
        """The speculative-decoding counters of ``model`` now."""
        resp = self.http.request("GET", "/metrics", limit=METRICS_CAP)
        if resp.status_code != 200:
            raise EngineAnswerError(f"{self.url}/metrics: HTTP {resp.status_code}")
        try:
            snap = parse_metrics(resp.text, model)
        except ValueError as exc:
            raise EngineAnswerError(f"{self.url}/metrics: not Prometheus text ({exc})") from None
        if not snap.models:
            raise EngineAnswerError(f"{self.url}/metrics: no vllm:* metrics (is this a vLLM server?)")
        return snap

    def server_args(self) -> tuple[str, ...]:
        """vLLM does not state its launch arguments over HTTP."""
        return ()

    def complete(
        self,
        model: str,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        sampling: SamplingSettings = GREEDY,
        *,
        concurrency: int = 1,
        indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Completions of token-id prompts (``ignore_eos``), one request each, ``concurrency`` in flight; the prompt
        numbered i (``indices``, default 0, 1, ...) carries ``sampling.for_prompt(i)`` (its own seed)."""

        def one(http: EngineHttp, item: tuple[int, Sequence[int], int]) -> Completion:
            i, ids, n = item
            payload = {
                "model": model,
                "prompt": [int(t) for t in ids],
                "max_tokens": int(n),
                "ignore_eos": True,
                **sampling.for_prompt(i).vllm_fields(),
                "return_token_ids": True,
            }
            body = http.json("/v1/completions", payload=payload, timeout=self.generate_timeout)
            try:
                choice = body["choices"][0]
                tokens = tuple(int(t) for t in choice["token_ids"])
            except (KeyError, IndexError, TypeError, ValueError):
                raise EngineAnswerError(
                    f"{self.url}/v1/completions: no token_ids in the answer (vLLM >= 0.10 returns them)"
                ) from None
            return Completion(tuple(int(t) for t in ids), tokens, choice.get("finish_reason"))

        numbers = indices if indices is not None else range(len(prompts))
        items = [(i, ids, n) for i, ids, n in zip(numbers, prompts, max_tokens)]
        return self.each(items, one, concurrency)

    def run(self, request: RunRequest, info: ServerInfo) -> EngineRun:
        """The completions, and the counter deltas around each group (server-wide: other traffic is counted in)."""
        del info  # vLLM states its speculative settings only through its counters
        model = request.model
        start = before = self.counters(model)
        completions: dict[int, Completion] = {}
        deltas: list[CounterSnapshot] = []
        for group in request.split():
            done = self.complete(
                model,
                [request.prompts[i] for i in group],
                [request.max_tokens[i] for i in group],
                request.sampling,
                concurrency=request.concurrency,
                indices=group,
            )
            completions.update(zip(group, done))
            after = self.counters(model)
            deltas.append(after.minus(before))
            before = after
        delta = before.minus(start)
        if delta.drafts <= 0 or delta.draft_tokens <= 0:
            what = "exports no speculative-decoding counters" if not delta.spec_decode else "did not draft"
            raise EngineSpecDecodeError(
                f"{self.url}: {model} {what} during {len(completions)} requests: speculative decoding with MTP is "
                f"not configured ({SPEC_HINT})"
            )
        other = max(0, round(delta.requests) - len(completions))
        parts = tuple(_counts(d) for d in deltas)
        return EngineRun(model, request.ordered(completions), _counts(delta), other, True, parts)


def probe(http: EngineHttp, generate_timeout: float) -> tuple[VllmClient, ServerInfo] | None:
    """The client of the server behind ``http`` and what it says, when it is vLLM (``/version``); else None."""
    if is_vllm(http) is None:
        return None
    client = VllmClient(http.url, generate_timeout=generate_timeout, http=http)
    return client, client.info()


Client = VllmClient
PROBE_MISS = 'not a vLLM server (no /version answering {"version": ...})'


def _counts(delta: CounterSnapshot) -> DraftCounts:
    return DraftCounts(
        steps=round(delta.drafts),
        drafted=round(delta.draft_tokens),
        accepted=round(delta.accepted),
        accepted_per_position=tuple(round(a) for a in delta.accepted_per_position),
    )
