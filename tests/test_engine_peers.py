"""The real vLLM CPU engine on the peers' quants: does it do what inspect predicts?

Each committed dense peer quant is served with MTP speculative decoding (k = 2). A quant inspect calls
healthy must load and draft (accepted tokens > 0); one it predicts to fail must fail to start, with the
error inspect names. AutoRound's ``llm_compressor``-format quant, repaired by ``graft --fix-metadata``,
must then draft. (AutoRound's native-format quant, which inspect predicts vLLM refuses, is started in
tests/test_engine_validate.py::test_engine_that_fails_to_start_names_its_log.) The MoE peer quants are NVFP4
MoE, which vLLM 0.32's CPU backend cannot run at all (its NVFP4 MoE emulation needs Triton, which has no CPU
backend): they are engine-tested only on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.api import GraftOptions, graft, inspect_checkpoint
from tests.support.engine import EnginePool, assert_drafts

pytestmark = pytest.mark.engine

Factory = Callable[[str], Path]
K = 2


@pytest.mark.nightly(
    reason="two peers' healthy quants served by vLLM (a server each): the full lane serves mtpquant's own outputs in "
    "both layouts (modelopt's and compressed-tensors', tests/test_engine_validate.py), checks inspect's verdict on "
    "every peer quant without an engine (tests/test_peers.py) and serves the repaired AutoRound quant below"
)
@pytest.mark.parametrize("name", ["llmcompressor-nvfp4-dense", "modelopt-hfptq-dense"])
def test_healthy_peer_quant_loads_and_drafts(vllm: EnginePool, peer_quant: Factory, name: str) -> None:
    path = peer_quant(name)
    assert inspect_checkpoint(path).verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    assert_drafts(vllm, path, K, 4)


def test_autoround_quant_fails_as_predicted_and_drafts_once_repaired(
    vllm: EnginePool, peer_quant: Factory, tmp_path: Path
) -> None:
    path = peer_quant("autoround-nvfp4-llmc-dense")
    assert inspect_checkpoint(path).verdicts["vllm"] == (
        "vLLM will fail to load: mtp.fc is BF16 on disk but declared quantized"
    )
    err = vllm.start_failure(path, K)
    # vLLM built mtp.fc quantized (weight_packed, ...) and found a plain BF16 weight
    assert "There is no module or parameter named 'fc.weight' in Qwen3_5MultiTokenPredictor" in str(err)
    fixed = tmp_path / "fixed"
    graft(GraftOptions(quant=path, out=fixed, fix_metadata=True))
    assert inspect_checkpoint(fixed).verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    assert_drafts(vllm, fixed, K, 4)

