"""``convert --mtp auto`` measured by the real vLLM CPU engine: the chosen MTP loads, and the AL vLLM measures with it
is within the budget + 0.05 of the AL it measures with the BF16 MTP, on the same prompts and the same quantized target.

The trained tiny Qwen3.5 converted with ``--mtp auto`` (budget 0.05 AL, vLLM's loading rules, 24 prompts) and with
``--keep-mtp`` (``tests/support/heal.py``'s convert, the same calibration, so the same main-model bytes), each served
by vLLM with MTP speculative decoding at k = 3 on 44 held-out prompts (``tests/support/engine.engine_acceptance``):
one server per checkpoint. vLLM accepts draft i with the same probability whatever k >= i, so the k = 3 server's
first j positions measure what a j-server accepts (AL for k = j: 1 + their sum; tests/test_engine_validate.py):
k = 1, 2 and 3 are compared. Position 1's rate is counted over the k = 3 server's steps, AL(3) / AL(1) ~ 2.1 / 1.59
fewer per generated token than a k = 1 server's: 44 prompts give it at least as many steps as 32 gave a k = 1 server
(~64 new tokens each: 2,048 tokens at AL 1.59, ~1,290 steps; 42 prompts gave 1,269 at k = 3).
The search is asked for BF16 and NVFP4 only (``--mtp-precisions nvfp4``): vLLM's CPU build has no FP8 kernel (its
``_C::static_scaled_fp8_quant`` takes no arguments there, so a checkpoint with an FP8 Linear fails to start; measured
with the default search's choice, input FP8 / attention NVFP4 / MLP FP8), while its NVFP4 emulation kernel runs
(``tests/support/vllm_env.py``). The trained tiny Qwen3.5-MoE is served the same way with its routed experts BF16 in
the main model and the MTP (``--set quantization.exclude=["*mlp.experts*"]``, which the search honours: the CPU backend
runs no NVFP4 MoE); its all-NVFP4 choice is served by ``scripts/gpu_check.sh`` step 5a. (The trained tiny
Qwen3.8-Flash-Next is not served: its MTP's experts are fused with the trunk's recipe.)

The full lane serves the dense search's choice and checks that vLLM accepts its drafts; both measurements within the
budget (the dense and the MoE's, a server more each and ~90 s of measuring) run in the nightly lane.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mtpquant.api import ConvertOptions, ConvertResult, SearchSettings, convert
from mtpquant.synth.train import TINY_MTP_ASSET, TINY_MTP_ASSETS
from tests.support.engine import EnginePool, assert_drafts, engine_acceptance
from tests.support.heal import CALIB, HealedTiny
from tests.test_graft import tensor_digests

pytestmark = pytest.mark.engine

K = 3  # one server per checkpoint (each is a server start, ~1 min on CPU); k = 1 and 2 from its first positions
PROMPTS = 44
MOE_PROMPTS = 50  # the MoE's MTP accepts more (AL 2.5 at k = 3): 44 prompts gave it 1,161 steps
MIN_STEPS = 1290  # what 32 prompts gave a k = 1 server (see above)
CPU_MOE = 'quantization.exclude=["*mlp.experts*"]'  # the routed experts BF16: the CPU build has no NVFP4 MoE kernel
TOLERANCE = 0.05  # the engine against the prediction: the prompts' sampling noise, the engine's own numerics


@pytest.fixture(scope="module")
def auto(tmp_path_factory: pytest.TempPathFactory) -> tuple[ConvertResult, SearchSettings]:
    """``convert --mtp auto`` of the trained tiny Qwen3.5 for vLLM's CPU build, and its search settings."""
    # what vLLM's CPU build runs (see above), selected and confirmed on tests/test_search.py's prompts (24 each, of 96
    # tokens): the same choice as the default 64 prompts' on this model, in a fifth of the time
    settings = SearchSettings(precisions=("nvfp4",), num_prompts=24, confirm_prompts=24, max_len=96)
    out = tmp_path_factory.mktemp("engine-search") / "auto"
    result = convert(ConvertOptions(src=str(TINY_MTP_ASSET), out=out, mtp="auto", search=settings, device="cpu",
                                    progress=False, **CALIB))  # fmt: skip
    return result, settings


def test_vllm_serves_the_chosen_mixed_mtp_and_drafts(
    auto: tuple[ConvertResult, SearchSettings], vllm: EnginePool
) -> None:
    """The search's choice (some MTP groups NVFP4, the rest BF16, declared as vLLM loads them) starts in vLLM and its
    drafts are accepted (the full lane's check; its AL against the BF16 MTP's at scale is the nightly test below)."""
    result, _ = auto
    search = result.search
    assert search is not None and result.output is not None
    assignment = search.choice.assignment
    assert not assignment.all_bf16 and search.choice.nbytes < search.bf16_bytes  # a mixed MTP: what this serves
    assert_drafts(vllm, result.output, K, 8)


@pytest.mark.nightly(
    reason="the search's choice measured by vLLM against the BF16 MTP at 44 prompts (a second server and ~90 s of "
    "measurement): the full lane serves the choice and checks its drafts are accepted "
    "(test_vllm_serves_the_chosen_mixed_mtp_and_drafts), measures the prediction against vLLM per position "
    "(tests/test_engine_validate.py) and checks the search's confirmed choice against a simulated truth "
    "(tests/test_search_decide.py)"
)
def test_vllm_loads_the_chosen_mtp_and_measures_its_al_within_the_budget(
    auto: tuple[ConvertResult, SearchSettings], healed_tiny: HealedTiny, vllm: EnginePool, tmp_path: Path
) -> None:
    result, settings = auto
    _engine_within_the_budget(result, healed_tiny.quant("keep"), settings, vllm, tmp_path)


@pytest.mark.nightly(
    reason="the MoE's search served by vLLM (a second search, two more servers): the full lane serves the dense "
    "search's choice (test_vllm_loads_the_chosen_mtp_and_measures_its_al_within_the_budget) and checks the MoE "
    "search's choices without an engine (tests/test_search.py)"
)
def test_the_moe_search_with_its_experts_bf16_measures_within_the_budget(vllm: EnginePool, tmp_path: Path) -> None:
    """The trained tiny Qwen3.5-MoE, its routed experts excluded by the recipe: the search quantizes only what the
    recipe lets it (the experts stay BF16 in every configuration) and vLLM's CPU build serves its choice."""
    settings = SearchSettings(precisions=("nvfp4",))
    common: dict[str, Any] = {"src": str(TINY_MTP_ASSETS["qwen3_5_moe"]), "device": "cpu", "progress": False,
                              "overrides": (CPU_MOE,), **CALIB}  # fmt: skip
    auto = convert(ConvertOptions(out=tmp_path / "auto", mtp="auto", search=settings, **common))
    keep = tmp_path / "keep"
    convert(ConvertOptions(out=keep, mtp="keep", **common))
    assert auto.search is not None
    assert {row.assignment["experts"] for row in auto.search.evaluated} == {"bf16"}
    _engine_within_the_budget(auto, keep, settings, vllm, tmp_path, prompts=MOE_PROMPTS)


def _engine_within_the_budget(
    auto: ConvertResult, keep: Path, settings: SearchSettings, vllm: EnginePool, tmp_path: Path, prompts: int = PROMPTS
) -> None:
    """The chosen MTP is smaller than the BF16 one, over the same quantized target, and vLLM measures its AL at
    k = 1..3 within the budget + the tolerance of the BF16 MTP's."""
    search = auto.search
    assert search is not None and auto.output is not None
    chosen = search.choice
    assert chosen.verdict == "within" and chosen.nbytes < search.bf16_bytes  # some group fits: smaller than BF16
    assert tensor_digests(auto.output, mtp=False) == tensor_digests(keep, mtp=False)  # the same quantized target
    bf16 = engine_acceptance(keep, vllm, tmp_path / "bf16", ks=(K,), prompts=prompts)[K]
    measured = engine_acceptance(auto.output, vllm, tmp_path / "auto-validate", ks=(K,), prompts=prompts)[K]
    numbers = {"chosen": chosen.assignment.label, "bytes": [chosen.nbytes, search.bf16_bytes], "bf16": bf16,
               "auto": measured}  # fmt: skip
    (tmp_path / "search-engine.json").write_text(json.dumps(numbers))
    print("\n" + json.dumps(numbers))  # for BENCHMARKS.md
    assert min(bf16["engine_steps"], measured["engine_steps"]) >= MIN_STEPS, numbers
    for k in range(1, K + 1):  # AL at k: 1 + the first k positions' rates (at K, the engine's AL itself)
        al = {name: 1 + sum(m["engine_per_position"][:k]) for name, m in (("bf16", bf16), ("auto", measured))}
        assert al["auto"] >= al["bf16"] - (settings.budget + TOLERANCE), (k, al, numbers)
    assert abs(1 + sum(measured["engine_per_position"]) - measured["engine"]) < 1e-9
