"""A running SGLang server (``python -m sglang.launch_server``), measured by its per-request speculative counters.

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
from collections.abc import Mapping, Sequence
from typing import Any

from mtpquant.engine.http import EngineClientBase, EngineHttp
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
from mtpquant.records.sampling import SamplingSettings

__all__ = ["CHAIN_ALGORITHMS", "SglangClient", "nextn_args", "sglang_settings", "start_refusal"]

log = logging.getLogger(__name__)

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
