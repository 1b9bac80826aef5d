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

from tests.support.engine import EnginePool, engine_acceptance
from tests.support.heal import HealedTiny, proof

pytestmark = pytest.mark.engine

PROMPTS = 32
MAX_LEN = 128
KS = (1, 2)


@proof
@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_engine_measures_the_heals_improvement(
    healed_tiny: HealedTiny, vllm: EnginePool, tmp_path: Path, mode: str
) -> None:
    unhealed = engine_acceptance(healed_tiny.quant(mode), vllm, tmp_path / "unhealed", ks=KS, prompts=PROMPTS,
                                 max_len=MAX_LEN)
    healed_path, _ = healed_tiny.healed(mode)
    healed = engine_acceptance(healed_path, vllm, tmp_path / "healed", ks=KS, prompts=PROMPTS, max_len=MAX_LEN)
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
