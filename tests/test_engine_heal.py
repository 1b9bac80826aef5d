"""heal measured by the real vLLM CPU engine: the healed quant accepts more drafts than the unhealed one.

The trained tiny model's ``--keep-mtp`` (BF16 MTP) and ``--mtp quantize`` (NVFP4 MTP) converts and their default
heals (``tests/support/heal.py``, shared with tests/test_heal.py) are served by vLLM with MTP speculative decoding
at k = 1 and 2; the engine's own counters give the AL of each on the same prompts, and validate's built-in replay
predicts it. The improvement the engine measures (healed minus unhealed) is positive and agrees with the predicted
improvement within 0.1 at each k. The default heals take CPU-minutes: the test runs with ``MTPQUANT_HEAL_PROOF=1``
(under the engine lock, like every engine test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpquant.api import ValidateOptions, validate
from tests.support.engine import CPU_ENV, EnginePool
from tests.support.heal import HealedTiny, proof

pytestmark = pytest.mark.engine

PROMPTS = 32
MAX_LEN = 128
KS = (1, 2)


def _measure(path: Path, vllm: EnginePool, report_dir: Path) -> dict[int, dict[str, float]]:
    report = validate(
        ValidateOptions(
            path,
            num_prompts=PROMPTS,
            max_len=MAX_LEN,
            ks=KS,
            device="cpu",
            activations="emulate",  # the engine runs the W4A4 activations too
            engine="vllm",
            vllm_python=vllm.python,
            env=CPU_ENV,
            compare_reference=True,
            report_dir=report_dir,
            progress=False,
        )
    ).report
    rows = report.predicted.reference or () if report.predicted else ()
    assert [r.k for r in rows] == list(KS)
    assert all(e.other_requests == 0 for e in report.engine)
    return {r.k: {"engine": r.engine_al, "predicted": r.predicted_al} for r in rows}


@proof
@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_engine_measures_the_heals_improvement(
    healed_tiny: HealedTiny, vllm: EnginePool, tmp_path: Path, mode: str
) -> None:
    unhealed = _measure(healed_tiny.quant(mode), vllm, tmp_path / "unhealed")
    healed_path, _ = healed_tiny.healed(mode)
    healed = _measure(healed_path, vllm, tmp_path / "healed")
    gains = {
        k: {
            "engine": healed[k]["engine"] - unhealed[k]["engine"],
            "predicted": healed[k]["predicted"] - unhealed[k]["predicted"],
        }
        for k in KS
    }
    (tmp_path / "gains.json").write_text(json.dumps({"unhealed": unhealed, "healed": healed, "gains": gains}))
    print(f"\n{mode}: " + json.dumps({"unhealed": unhealed, "healed": healed, "gains": gains}))  # for BENCHMARKS.md
    for k, g in gains.items():
        assert g["engine"] > 0, (k, gains)
        assert abs(g["engine"] - g["predicted"]) <= 0.1, (k, gains)
