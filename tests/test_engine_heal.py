"""heal measured by the real vLLM CPU engine: the healed quant accepts more drafts than the unhealed one.

The trained tiny model's ``--keep-mtp`` (BF16 MTP) and ``--mtp quantize`` (NVFP4 MTP) converts and their default
heals are served by vLLM with MTP speculative decoding; the engine's own counters give the AL of each on the same
prompts, and validate's built-in replay predicts it (``tests/support/engine.engine_acceptance``). The improvement the
engine measures (healed minus unhealed) is positive and agrees with the predicted improvement within 0.1 at each k.

The keep heal runs in the full lane (CI): the demo's (``mtpquant demo``: convert --keep-mtp with the calibration of
``tests/support/heal.py``, then heal's defaults in place; the session's run, tests/support/demo.py, which
tests/test_demo.py checks), served against ``HealedTiny.quant("keep")``, the same convert before the heal (the same
main-model bytes: checked). One server per checkpoint at k = 3 (k = 1 and 2 from its first positions), the unhealed
one shared with tests/test_engine_search.py (the same checkpoint at the same k, served and predicted once:
tests/support/engine.py ``engine_acceptance``), on 44 held-out prompts. heal writes only a heal that its own held-out
check finds better beyond noise, so the engine measures a real gain, not a forced one. The quantize heal, the same
proof on the NVFP4 MTP, takes another default heal and two more servers: it runs in the nightly lane
(``MTPQUANT_NIGHTLY=1``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpquant.records.provenance import read_provenance
from tests.support.demo import DemoRun
from tests.support.engine import EnginePool, engine_acceptance
from tests.support.heal import HealedTiny, proof
from tests.test_graft import tensor_digests

pytestmark = pytest.mark.engine

PROMPTS = 44  # as tests/test_engine_search.py: >= 1,290 verification steps per server there
MAX_LEN = 128
K = 3
KS = (1, 2, 3)
TOLERANCE = 0.1  # engine gain against predicted gain (measured at k = 1, 2: differences up to 0.052)


def _gains(
    unhealed_path: Path, healed_path: Path, vllm: EnginePool, tmp_path: Path, mode: str
) -> dict[int, dict[str, float]]:
    """The engine's and the prediction's AL gain at each k, healed over unhealed (the same quantized target)."""
    record = read_provenance(healed_path).heal
    assert record is not None and record.better and not record.forced, record  # heal's own rule wrote it
    assert tensor_digests(healed_path, mtp=False) == tensor_digests(unhealed_path, mtp=False)  # only the MTP differs
    unhealed = engine_acceptance(unhealed_path, vllm, tmp_path / "unhealed", ks=KS, prompts=PROMPTS, max_len=MAX_LEN)
    healed = engine_acceptance(healed_path, vllm, tmp_path / "healed", ks=KS, prompts=PROMPTS, max_len=MAX_LEN)
    gains = {
        k: {
            "engine": healed[k]["engine"] - unhealed[k]["engine"],
            "predicted": healed[k]["predicted"] - unhealed[k]["predicted"],
        }
        for k in KS
    }
    numbers = {"unhealed": unhealed, "healed": healed, "gains": gains}
    (tmp_path / "gains.json").write_text(json.dumps(numbers))
    print(f"\n{mode}: " + json.dumps(numbers))  # for BENCHMARKS.md
    return gains


def _assert_gains(gains: dict[int, dict[str, float]]) -> None:
    for k, g in gains.items():
        assert g["engine"] > 0, (k, gains)
        assert abs(g["engine"] - g["predicted"]) <= TOLERANCE, (k, gains)


def test_engine_measures_the_keep_heals_improvement(
    demo_run: DemoRun, healed_tiny: HealedTiny, vllm: EnginePool, tmp_path: Path
) -> None:
    assert demo_run.code == 0, demo_run.out
    _assert_gains(_gains(healed_tiny.quant("keep"), demo_run.quant, vllm, tmp_path, "keep"))


@proof
def test_engine_measures_the_quantize_heals_improvement(
    healed_tiny: HealedTiny, vllm: EnginePool, tmp_path: Path
) -> None:
    _assert_gains(_gains(healed_tiny.quant("quantize"), healed_tiny.healed("quantize")[0], vllm, tmp_path, "quantize"))
