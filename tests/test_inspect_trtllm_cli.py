"""``mtpquant inspect``, run as users run it (a fresh ``python -m mtpquant`` process), on real converts: the trained
tiny Qwen3.5's ``--mtp keep`` and ``--mtp quantize`` outputs and the trained tiny GLM-4.5-layout model's ``--mtp
keep`` output each print a ``TensorRT-LLM:`` verdict and a ``trtllm-serve`` line, and ``--json`` carries the same.

The oracles are written by hand from TensorRT-LLM's documented rules (docs/engines.md, "TensorRT-LLM"), not computed
by the code under test: Qwen3.5's MTP is TensorRT-LLM's ``model.layers.<num_hidden_layers>`` (``Qwen3NextMTP``), GLM's
appended layer keeps its name (``Glm4MTP``, decided whole); an exclusion in those names keeps a BF16 module BF16, so
each convert loads; its serve line is ``trtllm-serve`` with an MTP ``speculative_config`` at inspect's draft length
(3, as the vLLM and SGLang lines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpquant.synth.train import TINY_MTP_ASSETS
from tests.support.heal import HealedTiny

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def glm_keep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``convert --mtp keep`` of the trained tiny GLM-4.5-layout model (the session's convert helper)."""
    return HealedTiny(tmp_path_factory.mktemp("glm-keep"), TINY_MTP_ASSETS["glm4_moe"]).quant("keep")


def _inspect(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mtpquant", "inspect", str(path), *args],
        capture_output=True, text=True, env=env, cwd=path.parent, timeout=300, check=False,
    )  # fmt: skip


def _exclusions(path: Path) -> list[str]:
    return list(json.loads((path / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"])


def _check(path: Path, verdict: str, trtllm_exclusion: str) -> None:
    assert trtllm_exclusion in _exclusions(path)  # convert wrote TensorRT-LLM's form of the name
    serve = (
        "echo 'speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 3}' > mtp.yaml && "
        f"trtllm-serve {path} --extra_llm_api_options mtp.yaml"
    )
    text = _inspect(path)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert [ln for ln in lines if ln.startswith("TensorRT-LLM")] == [verdict]
    assert f"serve (TensorRT-LLM): {serve}" in lines
    as_json = _inspect(path, "--json")
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["verdicts"]["trtllm"] == verdict
    assert report["serve_commands"]["trtllm"] == serve


def _layers(path: Path) -> int:
    config = json.loads((path / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


@pytest.mark.parametrize(
    ("mode", "verdict", "exclusion"),
    [
        # the whole BF16 MTP excluded as TensorRT-LLM names its layer
        ("keep", "TensorRT-LLM: MTP loads (BF16)", "model.layers.{n}*"),
        # the quantized MTP's BF16 glue (mtp.fc) excluded by TensorRT-LLM's name of it too
        ("quantize", "TensorRT-LLM: MTP loads (mixed: BF16, NVFP4)", "model.layers.{n}.fc"),
    ],
)
def test_qwen3_5_converts(healed_tiny: HealedTiny, mode: str, verdict: str, exclusion: str) -> None:
    out = healed_tiny.quant(mode)
    _check(out, verdict, exclusion.format(n=_layers(out)))


def test_glm4_moe_keep(glm_keep: Path) -> None:
    # GLM's MTP is the appended layer model.layers.<num_hidden_layers>, the same name in the checkpoint and the engine
    _check(glm_keep, "TensorRT-LLM: MTP loads (BF16)", f"model.layers.{_layers(glm_keep)}*")
