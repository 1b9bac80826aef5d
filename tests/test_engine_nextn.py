"""The real vLLM 0.32 CPU engine drafts with the trained tiny GLM-4.5-layout model (``mtpquant/assets/
tiny-glm4_moe-mtp``, head_dim 32) as ``Glm4MoeMTPModel``: its source and its ``convert --keep-mtp`` and ``--mtp
quantize`` outputs, greedy and at T = 0.8 (the full lane: the quantize output, greedy), measured by the engine's own
counters at k = 2 (its first position is what k = 1 accepts, as tests/test_engine_validate.py explains) against
validate's built-in prediction through the family's MTP forward (``mtp/nextn.py``) on the same prompts, lengths and
seeds: AL within 0.1 at k = 1 and 2. And heal of the keep output raises the engine-measured AL on the held-out
prompts (the keep output's greedy measurement is the one its comparison made: one server per checkpoint).

The CPU build has no NVFP4 MoE kernel ("No NvFp4 MoE backend supports the deployment configuration"): both outputs
served here are converted with the routed experts left BF16 (``--set quantization.exclude=["*mlp.experts*"]``;
attention, dense and shared-expert MLPs NVFP4 W4A4), the quantize output's MTP too (its attention and shared expert
NVFP4 W4A4 with activation scales calibrated through the MTP forward, its expert bank BF16 and excluded as
``model.layers.2.mlp.experts``, the name vLLM's FusedMoE matches: tests/test_convert_nextn.py). The all-NVFP4
``--mtp quantize`` output (its MTP's routed experts NVFP4 too) is served by ``scripts/gpu_check.sh``'s GPU engine.

Sized as the Qwen engine tests: 48 prompts of at most 80 tokens continued to 160 give the engine >= 1,000 steps per
setting, so its sampling noise in AL is a few hundredths. DeepSeek's MLA does not run on the CPU build: its serve
check is ``scripts/nextn_serve_check.py`` in ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.api import ConvertOptions, HealOptions, ValidateOptions, convert, heal, validate
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.records.validation import Report
from mtpquant.synth.train import TINY_MTP_ASSETS
from tests.support.engine import CONCURRENCY, CPU_ENV, EnginePool
from tests.support.heal import proof

pytestmark = pytest.mark.engine

SOURCE = TINY_MTP_ASSETS["glm4_moe"]
PROMPTS = 48
MAX_LEN = 160
AL_TOLERANCE = 0.1
MIN_STEPS = 1000
CPU_MOE = 'quantization.exclude=["*mlp.experts*"]'  # the routed experts BF16: the CPU build has no NVFP4 MoE kernel


class Checkpoints:
    """The source, and its keep and quantize outputs, each converted on first use (the keep output only in the
    nightly lane)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Path] = {"source": SOURCE}

    def __getitem__(self, which: str) -> Path:
        if which not in self.made:
            out = self.root / which
            convert(ConvertOptions(src=str(SOURCE), out=out, mtp=which, calib_samples=8, calib_seq_len=128,
                                   device="cpu", progress=False, overrides=(CPU_MOE,)))  # fmt: skip
            self.made[which] = out
        return self.made[which]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("engine-nextn"))


# The sampling settings a comparison measures on one server: greedy and T = 0.8, or greedy alone (the full lane's
# quantize output: its sampled setting runs in the nightly lane).
SETTINGS = {"both": (0.0, 0.8), "greedy": (0.0,)}
LABELS = {"both": ["T=0", "T=0.8"], "greedy": ["T=0"]}


@pytest.fixture(scope="module")
def compared(
    checkpoints: Checkpoints, vllm: EnginePool, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], tuple[Report, Path]]:
    """``validate --engine vllm --compare-reference`` of a checkpoint at k = 2 with the settings ``SETTINGS[settings]``
    (its report and report directory), run once per module: the heal test below takes the keep output's greedy
    measurement."""
    done: dict[tuple[str, str], tuple[Report, Path]] = {}

    def get(which: str, settings: str = "both") -> tuple[Report, Path]:
        if (which, settings) not in done:
            report_dir = tmp_path_factory.mktemp(f"compare-{which}-{settings}") / "report"
            report = validate(
                ValidateOptions(
                    checkpoints[which],
                    num_prompts=PROMPTS,
                    max_len=MAX_LEN,
                    ks=(2,),
                    device="cpu",
                    activations="off" if which == "source" else "emulate",  # the engine quantizes W4A4 inputs too
                    engine="vllm",
                    vllm_python=vllm.python,
                    env=CPU_ENV,
                    concurrency=CONCURRENCY,
                    compare_reference=True,
                    temperatures=SETTINGS[settings],
                    report_dir=report_dir,
                    progress=False,
                )
            ).report
            done[which, settings] = (report, report_dir)
        return done[which, settings]

    return get


NIGHTLY_SIDE = pytest.mark.nightly(
    reason="the GLM source and keep outputs through vLLM (two more servers, 96 prompt runs each): the full lane serves "
    "the quantize output, the one whose MTP vLLM reads quantized"
)
NIGHTLY_SAMPLED = pytest.mark.nightly(
    reason="the GLM quantize output greedy and at T = 0.8 on one server: the full lane measures its greedy setting "
    "(the same server settings, prompts and tolerances); the sampled setting's agreement on Qwen is "
    "tests/test_engine_validate.py's (nightly too, at 48 prompts)"
)


@pytest.mark.parametrize(("which", "settings"), [
    pytest.param("source", "both", marks=NIGHTLY_SIDE),
    pytest.param("keep", "both", marks=NIGHTLY_SIDE),
    ("quantize", "greedy"),
    pytest.param("quantize", "both", marks=NIGHTLY_SAMPLED),
])  # fmt: skip
def test_engine_measures_what_validate_predicts(
    which: str, settings: str, checkpoints: Checkpoints, compared: Callable[[str, str], tuple[Report, Path]]
) -> None:
    if which == "quantize":  # the MTP's attention W4A4 with its calibrated input scale, its expert bank BF16
        mtp = Checkpoint.open(checkpoints[which]).tensors
        assert mtp["model.layers.2.self_attn.q_proj.weight"].dtype == "U8"
        assert "model.layers.2.self_attn.q_proj.input_scale" in mtp
        assert mtp["model.layers.2.mlp.experts.0.gate_proj.weight"].dtype == "BF16"
    report, report_dir = compared(which, settings)
    assert report.reference.family == "glm4_moe" and [e.k for e in report.engine] == [2]
    assert "Glm4MoeMTPModel" in (report_dir / "logs" / "vllm-reference-k2.log").read_text()
    assert report.predicted is not None
    rows = report.predicted.to_json()["reference"]
    assert [(r["label"], r["k"]) for r in rows] == [(label, 2) for label in LABELS[settings]]
    for r in rows:
        where = f"{which}: {r}"
        assert r["engine_steps"] >= MIN_STEPS, where
        assert abs(r["difference"]) <= AL_TOLERANCE, where  # k = 2
        k1 = r["engine_per_position"][0] - r["predicted_per_position"][0]  # k = 1: AL is 1 + position 1's rate
        assert abs(k1) <= AL_TOLERANCE, where
    assert rows[0]["predicted_al"] > 1.5  # the trained MTP drafts
    if len(rows) == 2:
        assert rows[1]["predicted_al"] < rows[0]["predicted_al"]  # sampling costs acceptance


@proof
def test_heal_raises_the_engine_measured_al(
    checkpoints: Checkpoints,
    compared: Callable[[str, str], tuple[Report, Path]],
    vllm: EnginePool,
    tmp_path: Path,
) -> None:
    """The keep output healed (its BF16 MTP trained against its own NVFP4 target through mtp/nextn.py) drafts better
    as the engine measures it on the held-out prompts (greedy, k = 2), by about what heal's own check said."""
    healed = tmp_path / "healed"
    result = heal(HealOptions(quant=str(checkpoints["keep"]), source=str(SOURCE), out=healed, samples=32,
                              check_prompts=24, force=True, device="cpu", progress=False))  # fmt: skip
    assert result.check is not None and result.check.by_k[0].change > 0
    keep, _ = compared("keep")  # greedy first: the same prompts, lengths and server settings as the healed run's
    healed_report = validate(ValidateOptions(healed, num_prompts=PROMPTS, max_len=MAX_LEN, ks=(2,), device="cpu",
                                             engine="vllm", vllm_python=vllm.python, env=CPU_ENV,
                                             concurrency=CONCURRENCY, progress=False)).report  # fmt: skip
    al = {}
    for which, report in (("keep", keep), ("healed", healed_report)):
        acceptance = report.reference.acceptance
        assert acceptance is not None and report.engine and acceptance.sampling.label == "T=0"
        row = acceptance.by_k[0]
        assert row.k == 2 and row.num_steps >= MIN_STEPS
        al[which] = (row.acceptance_per_position[0], row.mean_acceptance_length)
    assert al["healed"][0] > al["keep"][0] + 0.02, al  # k = 1: position 1
    assert al["healed"][1] > al["keep"][1] + 0.03, al  # k = 2
