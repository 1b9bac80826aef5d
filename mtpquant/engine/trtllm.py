"""TensorRT-LLM: how its PyTorch backend builds a ModelOpt checkpoint's MTP (its loader's rules), what inspect says of
it, and a running ``trtllm-serve`` (its OpenAI-compatible API, measured by its cumulative Prometheus counters).

The rules, from NVIDIA/TensorRT-LLM's source (never imported):

- **Exclusions match TensorRT-LLM's own module names, by ancestor.**
  ``QuantConfig.is_module_excluded_from_quantization`` (``tensorrt_llm/models/modeling_utils.py``) walks the
  module's name and every ancestor (split on ``.``) and tests each against every ``exclude_modules`` entry:
  ``fnmatch.fnmatchcase``, a ``re:`` entry by ``re.fullmatch``, and a trailing ``.*`` also matching the parent
  itself (so ``model.layers.61``, ``model.layers.61*`` and ``model.layers.61.*`` all exclude the whole layer).
  Before PR #13844 the name alone was tested with ``fnmatchcase`` (``ancestors=False`` below).
- **The MTP's modules are named as TensorRT-LLM builds them.** Qwen3.5 / Qwen3-Next (``Qwen3NextMTP``,
  ``_torch/models/modeling_qwen3_next.py``): ``Qwen3NextHfWeightMapper.preprocess_weights``
  (``_torch/models/checkpoints/hf/qwen3_next_weight_mapper.py``) renames ``mtp.layers.<i>.X`` to
  ``model.layers.<num_hidden_layers + i>.X`` and ``mtp.fc`` to ``model.layers.<num_hidden_layers>.fc``, so an
  exclusion written only as ``mtp.*`` covers nothing there. DeepSeek-V3/R1 (``DeepseekV3MTP``,
  ``modeling_deepseekv3.py``) and GLM-4.5 (``Glm4MTP``, ``modeling_glm.py``) keep the checkpoint's
  ``model.layers.<n>`` names.
- **DeepSeek-V3 and GLM decide the MTP layer as a whole first.** ``_get_decoder_layer_quant_config(layer_idx)``
  (``DeepseekV3DecoderLayer``, ``Glm4DecoderLayer``): when ``model.layers.<n>`` is excluded the whole layer, its
  routed experts included, is built without quantization ("The MTP layer in the nvfp4 checkpoint is unquantized");
  otherwise each module by its own exclusion.
- **Qwen3.5's MTP experts.** PR #16936 (``modeling_qwen3_next.py``, ``_mtp_pattern_covers_experts``) built the MTP's
  routed experts unquantized (the CUTLASS MoE fallback: TensorRT-LLM's own MoE backend has no BF16 path) only for
  an exclusion written ``model.layers.<mtp>*`` or ``model.layers.<mtp>.mlp.experts*``; PR #17051 decides it with the
  ancestor matcher above, so a parent such as ``model.layers.<mtp>.mlp*`` counts too. The verdict follows the fixed
  rule and says when only it keeps the experts loading.
- A Linear TensorRT-LLM builds quantized expects the checkpoint's one ``quant_algo`` on disk (NVFP4's packed
  ``weight`` and scales, or FP8's); one built unquantized expects BF16. MIXED_PRECISION, compressed-tensors and the
  other formats are not reproduced here: the verdict says so rather than guess.

A family TensorRT-LLM drafts is one whose ``EngineRules.drafters`` names its class under ``trtllm``.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from mtpquant.checkpoint.precision import is_quantized
from mtpquant.engine.http import EngineClientBase as _ClientBase
from mtpquant.engine.loading import LM_HEADS, EngineModule, Expectation
from mtpquant.errors import EngineAnswerError, EngineSpecDecodeError
from mtpquant.families import QWEN_MTP_NAMES, EngineRules, matches
from mtpquant.formats.quant_config import QuantMetadata

if TYPE_CHECKING:
    from mtpquant.engine.http import EngineHttp
    from mtpquant.engine.server import Completion, DraftCounts, EngineRun, RunRequest, ServerInfo
    from mtpquant.engine.sizing import EngineMemory, Machine
    from mtpquant.engine.verdicts import EngineVerdict, ModuleReport, VerdictFacts
    from mtpquant.families import ModelSpec
    from mtpquant.records.sampling import SamplingSettings, SpecRule

__all__ = [
    "MTP_GLUE",
    "TrtllmClient",
    "TrtllmCounters",
    "excluded",
    "experts_excluded",
    "module_name",
    "parse_metrics",
]

log = logging.getLogger(__name__)

NAME = "TensorRT-LLM"
# The quant_algo values of a ModelOpt checkpoint whose MTP rules are reproduced here, and the on-disk precision each
# Linear TensorRT-LLM builds quantized expects (checkpoint.precision's names).
_ALGO_DISK = {"NVFP4": "NVFP4", "FP8": "FP8"}
# Qwen3NextHfWeightMapper.preprocess_weights: the MTP's own glue, renamed into the MTP decoder layer.
MTP_GLUE = {"fc": "fc", "norm": "shared_head.norm", "pre_fc_norm_embedding": "pre_fc_norm_embedding",
            "pre_fc_norm_hidden": "pre_fc_norm_hidden"}
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^(model\.layers\.\d+)(?:\.|$)")


# ---- loading rules ---------------------------------------------------------------------------------------------
def excluded(name: str, patterns: Sequence[str], *, ancestors: bool = True) -> bool:
    """Whether TensorRT-LLM builds ``name`` (its own module name) without quantization: ``QuantConfig.
    is_module_excluded_from_quantization`` (``ancestors=False``: the matcher before PR #13844, the name alone)."""
    candidate = name
    while True:
        for p in patterns:
            if p.startswith("re:"):
                hit = re.fullmatch(p[3:], candidate) is not None
            else:  # fnmatchcase, and a trailing ".*" matching the parent itself too
                hit = fnmatch.fnmatchcase(candidate, p) or (
                    ancestors and p.endswith(".*") and fnmatch.fnmatchcase(candidate, p[:-2])
                )
            if hit:
                return True
        if not ancestors or "." not in candidate:
            return False
        candidate = candidate.rsplit(".", 1)[0]


def experts_excluded(layer: str, patterns: Sequence[str], *, fixed: bool = True) -> bool:
    """Whether a Qwen3.5 MTP layer's routed experts (``<layer>.mlp.experts``, ``layer``: ``model.layers.<mtp>``) are
    built unquantized: by the ancestor matcher (PR #17051), or (``fixed=False``) only for the two forms PR #16936's
    ``_mtp_pattern_covers_experts`` accepted."""
    if fixed:
        return excluded(f"{layer}.mlp.experts", patterns)
    return any(p in (f"{layer}*", f"{layer}.mlp.experts*") for p in patterns)


def module_names(modules: Sequence[str], spec: ModelSpec) -> list[str]:
    """The MTP ``modules`` as TensorRT-LLM names them, where that differs (``module_name``)."""
    qwen = [m for m in modules if QWEN_MTP_NAMES.is_mtp(m)]
    n = spec.dim("num_hidden_layers") if qwen else 0
    return [module_name(m, n) for m in qwen]


def module_name(name: str, num_hidden_layers: int) -> str:
    """A checkpoint module as TensorRT-LLM names it (``Qwen3NextHfWeightMapper.preprocess_weights``: ``mtp.layers.<i>``
    becomes ``model.layers.<num_hidden_layers + i>``, the MTP's glue that layer's; other names unchanged)."""
    found = _MTP_LAYER.match(name)
    if found is not None:
        return f"model.layers.{num_hidden_layers + int(found.group(1))}.{found.group(2)}"
    if QWEN_MTP_NAMES.is_mtp(name):
        leaf = name[len(QWEN_MTP_NAMES.namespace) :]
        head, dot, rest = leaf.partition(".")
        return f"model.layers.{num_hidden_layers}.{MTP_GLUE.get(head, head)}{dot}{rest}"
    return name


def _exclusions(meta: QuantMetadata) -> tuple[str, ...]:
    """The list TensorRT-LLM reads: ``hf_quant_config.json``'s ``exclude_modules`` where the checkpoint has one (its
    ModelOpt loader reads that file first), else the config's."""
    return tuple(meta.exclude_by_file.get("hf_quant_config.json", meta.exclude))


def _layer_of(name: str) -> str | None:
    found = _LAYER.match(name)
    return found.group(1) if found else None


def _whole_layer(rules: EngineRules) -> bool:
    """DeepSeek-V3 / GLM: the MTP decoder layer's exclusion decides it whole (``_get_decoder_layer_quant_config``)."""
    return rules.drafters.get("trtllm") in _WHOLE_LAYER_DRAFTERS


_WHOLE_LAYER_DRAFTERS = ("DeepseekV3MTP", "Glm4MTP")


def build(
    module: EngineModule, engine_name: str, meta: QuantMetadata | None, rules: EngineRules, *, fixed: bool = True
) -> tuple[bool, str, bool]:
    """How TensorRT-LLM builds one MTP module named ``engine_name``: (quantized, why, only since PR #17051)."""
    if meta is None:
        return False, "the checkpoint declares no quantization", False
    patterns = _exclusions(meta)
    layer = _layer_of(engine_name)
    if module.kind == "unquantized" or matches(engine_name, LM_HEADS):
        return False, "built without a quantization config", False
    if layer is not None and _whole_layer(rules) and excluded(layer, patterns):
        return False, f"{layer} is excluded: the whole MTP layer is built unquantized", False
    if module.kind == "experts" and layer is not None and not _whole_layer(rules):
        now = experts_excluded(layer, patterns, fixed=fixed)
        before = experts_excluded(layer, patterns, fixed=False)
        why = f"{engine_name} is excluded" if now else f"no exclusion matches {engine_name}"
        return not now, why, now and not before
    if excluded(engine_name, patterns):
        return False, f"{engine_name} is excluded", False
    return True, f"no exclusion matches {engine_name}", False


def build_expectation(module: EngineModule, meta: QuantMetadata | None, rules: EngineRules) -> Expectation:
    """The engine table's hook: TensorRT-LLM's build of ``module`` under its checkpoint name (the precision search
    does not apply TensorRT-LLM's rules: its row says ``search=False``)."""
    q, reason, _ = build(module, module.prefix, meta, rules)
    return Expectation(q, reason)


# ---- what inspect says ------------------------------------------------------------------------------------------
def _module_kind(m: ModuleReport, rules: EngineRules) -> str:
    from mtpquant.engine.loading import engine_modules

    return next((e.kind for e in engine_modules(m.members, rules) if e.prefix == m.module), "linear")


def _not_checked(why: str) -> EngineVerdict:
    from mtpquant.engine.verdicts import EngineVerdict

    return EngineVerdict(f"{NAME}: not checked: {why}", False)


def mtp_verdict(facts: VerdictFacts) -> EngineVerdict:
    """TensorRT-LLM's verdict: each MTP module as it builds it (above), against what is on disk."""
    from mtpquant.engine.verdicts import EngineVerdict

    ckpt, meta = facts.ckpt, facts.meta
    if ckpt is None:
        return _not_checked("no checkpoint")
    family = ckpt.spec.family
    drafter = family.engine.drafters.get("trtllm")
    if drafter is None:
        return _not_checked(f"mtpquant does not reproduce {NAME}'s rules for {family.display}'s MTP")
    if not drafter:
        return EngineVerdict(f"{NAME}: has no MTP drafter for {family.display}", False)
    if meta is not None and not (meta.is_modelopt and meta.algo.upper() in _ALGO_DISK):
        return _not_checked(
            f"mtpquant reproduces {NAME}'s MTP rules for ModelOpt {' and '.join(_ALGO_DISK)} checkpoints, not "
            f"{meta.method} {meta.algo}"
        )
    n = ckpt.spec.dim("num_hidden_layers")
    rules = family.engine
    expects = _ALGO_DISK[meta.algo.upper()] if meta is not None else None
    precision = facts.report["mtp_precision"]
    older: list[str] = []
    for m in facts.report["mtp_modules"]:
        name = module_name(m.module, n)
        q, why, since_fix = build(EngineModule(m.module, tuple(m.members), _module_kind(m, rules)), name, meta, rules)
        disk = m.disk
        if disk == "missing":
            continue
        if disk == "mixed":
            return EngineVerdict(f"{NAME} will fail to load: {m.module} mixes precisions across its tensors", False)
        if q and not is_quantized(disk):
            layer = _layer_of(name) or name
            return EngineVerdict(
                f"{NAME} will fail to load: {m.module} is {disk} on disk but {NAME} builds it quantized as {name} "
                f"({why}; its exclusions match its own names, {layer}.*): add {layer}* to the exclusions "
                f"(mtpquant graft CHECKPOINT --fix-metadata)",
                False,
            )
        if not q and is_quantized(disk):
            return EngineVerdict(f"{NAME} will fail to load: {m.module} is {disk} on disk but {why}", False)
        if q and expects is not None and disk != expects:
            return EngineVerdict(
                f"{NAME} will fail to load: {m.module} is {disk} on disk but {NAME} loads it as {expects} "
                f"(quant_algo {meta.algo if meta else ''})",
                False,
            )
        if since_fix:
            older.append(name)
    line = f"{NAME}: MTP loads ({precision})"
    if older:
        line += (
            f"; {older[0]} stays unquantized only by the ancestor matcher of {NAME} PR #17051 (earlier releases "
            f"take only {_layer_of(older[0])}* or {_layer_of(older[0])}.mlp.experts* and build it quantized)"
        )
    return EngineVerdict(line, True)


def late_verdict(facts: VerdictFacts, verdict: str) -> str | None:
    """Where the MTP would load but the main model's metadata disagrees with its tensors (inspect's main-model
    findings), TensorRT-LLM does not load the checkpoint either: the first finding replaces the verdict."""
    if not facts.main_findings or not verdict.startswith(f"{NAME}: MTP loads"):
        return None
    first = facts.main_findings[0].split("will fail to load: ", 1)[-1]
    return f"{NAME} will fail to load: the main model's metadata disagrees with its tensors ({first})"


def format_refusal(meta: QuantMetadata | None) -> str | None:
    """Formats TensorRT-LLM refuses outright are not reproduced (its MTP verdict says what is not checked)."""
    del meta
    return None


def mtp_options_yaml(k: int) -> str:
    """The ``--extra_llm_api_options`` YAML of an MTP drafting ``k`` tokens per step (``MTPDecodingConfig``:
    ``decoding_type: MTP``, ``num_nextn_predict_layers``), in flow style so that it fits one shell line."""
    return f"speculative_config: {{decoding_type: MTP, num_nextn_predict_layers: {k}}}"


def serve_command(ref: str, k: int) -> str:
    """``trtllm-serve`` with the MTP drafting ``k`` tokens per step (the options YAML written first)."""
    return f"echo '{mtp_options_yaml(k)}' > mtp.yaml && trtllm-serve {ref} --extra_llm_api_options mtp.yaml"


# ---- validate ---------------------------------------------------------------------------------------------------
def quantized_mtp_note() -> str | None:
    """What heal's plan says of a healed MTP kept quantized, for this engine.
    TensorRT-LLM builds an MTP its exclusions do not cover quantized: no note."""
    return None


def cpu_sampling_note() -> str | None:
    """TensorRT-LLM runs on GPUs only."""
    return None


def rule_refusal(rule: str, spec: SpecRule) -> str | None:
    """TensorRT-LLM's MTP verifies greedily against the target (its ``MTPSampler``): ``--rule vllm`` only."""
    if spec.sampled_draft:  # argmax-draft (records.sampling.ARGMAX_DRAFT) is the one TensorRT-LLM's MTP follows
        return f"--rule {rule}: {NAME}'s MTP verification is not reproduced by the built-in rules other than vllm"
    return None


def speculative_args(k: int, speculative: Mapping[str, str] | None) -> list[str]:
    """mtpquant does not start trtllm-serve (``launch_module`` None); a caller that asks gets the options file."""
    del speculative
    return ["--extra_llm_api_options", mtp_options_yaml(k)]


def text_only_args(text_only: bool) -> list[str]:
    """Nothing to switch off."""
    del text_only
    return []


def start_refusal(log_text: str) -> str | None:
    """mtpquant does not start trtllm-serve."""
    del log_text
    return None


def memory_args(mem: EngineMemory) -> list[str]:
    """mtpquant does not start trtllm-serve: no memory arguments."""
    del mem
    return []


def memory_fraction(machine: Machine, per_device: int, kv: int) -> float | None:
    """mtpquant does not start trtllm-serve."""
    del machine, per_device, kv
    return None


# ---- the server -------------------------------------------------------------------------------------------------
# trtllm-serve (tensorrt_llm/serve/openai_server.py, its metrics from tensorrt_llm/metrics/collector.py
# MetricsCollector, every name prefixed trtllm_ and labelled with the server's labels, model_name among them):
# /prometheus/metrics carries iteration-level cumulative counters of drafted and accepted tokens and the finished
# requests; nothing per request and nothing per draft position (#19311 asks for more). So a measurement reads them
# before and after its requests (a dedicated run: other traffic meanwhile is counted in, and reported), and reports
# AL = 1 + accepted / steps with steps = drafted / k (an MTP step drafts its k tokens), acceptance = accepted /
# drafted; no acceptance per position.
METRICS = "/prometheus/metrics"
_DRAFTED = "trtllm_spec_decode_num_draft_tokens_total"
_ACCEPTED = "trtllm_spec_decode_num_accepted_tokens_total"
_FINISHED = "trtllm_request_success_total"
_SPEC_INFO = "trtllm_speculative_config_info"
# labels of the speculative info metric that state the draft length (MTPDecodingConfig / DecodingBaseConfig names)
_K_LABELS = ("num_nextn_predict_layers", "max_draft_len")
_SETTLE_S = 10.0  # how long the iteration-level counters may lag the last answer (they are logged per iteration)
PROBE_MISS = "not a TensorRT-LLM server (no /prometheus/metrics with trtllm_ metrics)"
SPEC_HINT = "start it with --extra_llm_api_options holding " + mtp_options_yaml(3).replace("3}", "K}")


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from mtpquant.engine.counters import samples

    return samples(text)


class TrtllmCounters(NamedTuple):
    """The cumulative counters of one model at one moment."""

    drafted: float
    accepted: float
    finished: float
    k: int | None  # the draft length the speculative info metric states (None: not stated)
    spec: bool  # the server exports speculative-decoding counters at all


def parse_metrics(text: str, model: str | None) -> TrtllmCounters:
    """The counters in a ``/prometheus/metrics`` body, for ``model`` (samples without a model label count too: a
    server started without one). ValueError when it is not Prometheus text."""
    every = _samples(text)
    mine = [(n, labels, v) for n, labels, v in every if model is None or labels.get("model_name", model) == model]

    def total(name: str) -> float:
        return sum(v for n, _, v in mine if n == name)

    k = None
    for n, labels, _ in mine:
        if n == _SPEC_INFO:
            k = next((int(labels[x]) for x in _K_LABELS if labels.get(x, "").isdigit()), None)
    spec = any(n in (_DRAFTED, _ACCEPTED, _SPEC_INFO) for n, _, _ in mine)
    return TrtllmCounters(total(_DRAFTED), total(_ACCEPTED), total(_FINISHED), k, spec)


def is_trtllm(http: EngineHttp) -> str | None:
    """The metrics text of a TensorRT-LLM server (its ``/prometheus/metrics`` has ``trtllm_`` metrics), or None."""
    from mtpquant.engine.http import METRICS_CAP

    resp = http.request("GET", METRICS, limit=METRICS_CAP)
    if resp.status_code != 200 or "trtllm_" not in resp.text:
        return None
    return resp.text


class TrtllmClient(_ClientBase):
    """Talks to one ``trtllm-serve`` at ``url``: its OpenAI routes for the requests, its Prometheus counters for AL."""

    engine = "trtllm"

    def info(self) -> ServerInfo:
        """``/version``, ``/v1/models`` and the draft length its speculative info metric states."""
        from mtpquant.engine.server import ServerInfo, SpecConfig

        text = is_trtllm(self.http)
        if text is None:
            raise EngineAnswerError(f"{self.url}: {PROBE_MISS}")
        version = self.http.json("/version", what="a TensorRT-LLM")
        data = self.listed_models("a TensorRT-LLM OpenAI")
        ids = tuple(str(m.get("id")) for m in data if isinstance(m, dict))
        k = parse_metrics(text, ids[0]).k
        spec = SpecConfig("MTP", k) if k is not None else None
        stated = version.get("version") if isinstance(version, dict) else None
        return ServerInfo(self.url, "trtllm", str(stated or "unknown"), ids, None, spec)

    def server_args(self) -> tuple[str, ...]:
        """trtllm-serve does not state its launch arguments over HTTP."""
        return ()

    def counters(self, model: str) -> TrtllmCounters:
        """The cumulative counters now."""
        from mtpquant.engine.http import METRICS_CAP

        resp = self.http.request("GET", METRICS, limit=METRICS_CAP)
        if resp.status_code != 200:
            raise EngineAnswerError(f"{self.url}{METRICS}: HTTP {resp.status_code}")
        try:
            return parse_metrics(resp.text, model)
        except ValueError as exc:
            raise EngineAnswerError(f"{self.url}{METRICS}: not Prometheus text ({exc})") from None

    def _settled(self, model: str, before: TrtllmCounters, finished: int) -> TrtllmCounters:
        """The counters once they count ``finished`` more finished requests than ``before`` (they are logged per
        iteration, after the answers), or as they are after ``_SETTLE_S`` seconds."""
        import time

        deadline = time.monotonic() + _SETTLE_S
        while True:
            now = self.counters(model)
            if now.finished - before.finished >= finished or time.monotonic() > deadline:
                return now
            time.sleep(0.05)

    def complete(
        self, model: str, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], sampling: SamplingSettings,
        *, concurrency: int = 1, indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """``/v1/completions`` of token-id prompts (``ignore_eos``), one request each, ``concurrency`` in flight."""
        from mtpquant.engine.server import Completion

        def one(http: EngineHttp, item: tuple[int, Sequence[int], int]) -> Completion:
            i, ids, n = item
            payload = {
                "model": model,
                "prompt": [int(t) for t in ids],
                "max_tokens": int(n),
                "ignore_eos": True,
                **sampling.for_prompt(i).vllm_fields(),  # temperature, top_p, top_k, seed: the OpenAI fields
            }
            body = http.json("/v1/completions", payload=payload, timeout=self.generate_timeout, what="a TensorRT-LLM")
            try:
                choice = body["choices"][0]
                usage = int(body["usage"]["completion_tokens"])
            except (KeyError, IndexError, TypeError, ValueError):
                raise EngineAnswerError(f"{self.url}/v1/completions: no choice and usage in the answer") from None
            ids_out = choice.get("token_ids") if isinstance(choice, dict) else None
            tokens = tuple(int(t) for t in ids_out) if isinstance(ids_out, list) else ()
            return Completion(tuple(int(t) for t in ids), tokens, choice.get("finish_reason"), usage)

        numbers = indices if indices is not None else range(len(prompts))
        return self.each([(i, ids, n) for i, ids, n in zip(numbers, prompts, max_tokens)], one, concurrency)

    def run(self, request: RunRequest, info: ServerInfo) -> EngineRun:
        """The completions, and the counter deltas around each group: AL only (no acceptance per position)."""
        from mtpquant.engine.server import DraftCounts, EngineRun

        k = info.speculative.k if info.speculative is not None else None
        if k is None or k < 1:
            raise EngineSpecDecodeError(
                f"{self.url}: {info.display} states no MTP draft length ({_SPEC_INFO} with "
                f"{' or '.join(_K_LABELS)}): {SPEC_HINT}"
            )
        model = request.model
        start = before = self.counters(model)
        completions: dict[int, Completion] = {}
        parts: list[DraftCounts] = []

        def counts(after: TrtllmCounters, prior: TrtllmCounters) -> DraftCounts:
            drafted = round(after.drafted - prior.drafted)
            return DraftCounts(drafted // k, drafted, round(after.accepted - prior.accepted), (), positions=k)

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
            after = self._settled(model, before, len(group))
            parts.append(counts(after, before))
            before = after
        total = counts(before, start)
        if total.steps <= 0:
            what = "exports no speculative-decoding counters" if not before.spec else "did not draft"
            raise EngineSpecDecodeError(
                f"{self.url}: {model} {what} during {len(completions)} requests: MTP speculative decoding is not "
                f"configured ({SPEC_HINT})"
            )
        other = max(0, round(before.finished - start.finished) - len(completions))
        return EngineRun(model, request.ordered(completions), total, other, True, tuple(parts))


def probe(http: EngineHttp, generate_timeout: float) -> tuple[TrtllmClient, ServerInfo] | None:
    """The client of the server behind ``http`` and what it says, when it is TensorRT-LLM; else None."""
    if is_trtllm(http) is None:
        return None
    client = TrtllmClient(http.url, generate_timeout=generate_timeout, http=http)
    return client, client.info()


Client = TrtllmClient
