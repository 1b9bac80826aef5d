"""validate through trtllm-serve, against a STAND-IN (``tests/support/trtllm_standin.py``): a local HTTP server that
answers as TensorRT-LLM's source says its OpenAI server does; no TensorRT-LLM runs here (it needs a GPU:
``scripts/gpu_check.sh`` measures a real one).

The stand-in's MTP drafts k = 2 per step and accepts 2, 1, 0 drafts in turn, emitting 1 + accepted tokens a step:
32 new tokens take 16 steps with 16 accepted drafts (5 cycles of 6 tokens, 15 steps, 15 accepted, then one step
emitting the last 2 tokens with 1 accepted), so 4 requests: 64 steps, 128 drafted, 64 accepted, AL 1 + 64/64 = 2.0,
acceptance 50 %. TensorRT-LLM counts nothing per draft position: the report has none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpquant.cli import main as cli
from mtpquant.engine.connect import connect
from mtpquant.engine.trtllm import TrtllmClient, parse_metrics
from mtpquant.errors import ExitCode
from mtpquant.synth.train import TINY_MTP_ASSET
from tests.support.trtllm_standin import MODEL, VERSION, TrtllmStandIn, steps_for

pytestmark = pytest.mark.dev

TINY = str(TINY_MTP_ASSET)
ARGS = ("--num-prompts", "4", "--max-len", "64")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli(["-q", "validate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_the_standin_pattern() -> None:
    assert steps_for(32, (2, 1, 0)) == (16, 16)  # the docstring's arithmetic
    assert steps_for(3, (2,)) == (1, 2)


def test_recognises_trtllm_first() -> None:
    with TrtllmStandIn() as server:
        client, info = connect(server.url)
        assert isinstance(client, TrtllmClient)
        assert (info.engine, info.version, info.models) == ("trtllm", VERSION, (MODEL,))
        assert info.display == f"TensorRT-LLM {VERSION}"
        assert info.speculative is not None and info.speculative.k == 2
        # its own route first: its /version answers as vLLM's does
        assert server.requests[0][1] == "/prometheus/metrics"


def test_validate_through_trtllm(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with TrtllmStandIn() as server:
        code, out, err = _cli(capsys, TINY, "--server", server.url, *ARGS, "--report-dir", str(tmp_path / "r"))
        posted = [body for method, path, body in server.requests if method == "POST"]
    assert code == 0, err
    assert len(posted) == 4 and all(b["max_tokens"] == 32 and b["ignore_eos"] is True for b in posted)
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 32 for b in posted)  # token ids
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    (engine,) = data["engine"]
    assert (engine["name"], engine["version"], engine["k"], engine["other_requests"]) == ("trtllm", VERSION, 2, 0)
    (row,) = data["reference"]["acceptance"]["by_k"]
    assert (row["num_steps"], row["num_drafted"], row["num_accepted"]) == (64, 128, 64)
    assert row["mean_acceptance_length"] == 2.0 and row["acceptance_rate"] == 0.5
    assert row["accepted_per_position"] == [] and row["acceptance_per_position"] == []  # none counted
    assert any("counts no acceptance per draft position" in n for n in data["notes"])
    assert out.splitlines()[1].split()[:3] == ["checkpoint", "2", "2.000"]


def test_other_traffic_is_counted_in_and_reported(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with TrtllmStandIn(others=3) as server:
        code, _, err = _cli(capsys, TINY, "--server", server.url, *ARGS, "--report-dir", str(tmp_path))
    assert code == 0, err
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["engine"][0]["other_requests"] == 3


def test_a_server_without_mtp_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with TrtllmStandIn(spec=False) as server:
        code, _, err = _cli(capsys, TINY, "--server", server.url, *ARGS, "--report-dir", str(tmp_path))
    assert code == int(ExitCode.ENGINE_SPEC_DECODE), err
    assert "states no MTP draft length" in err and "decoding_type: MTP" in err


def test_metrics_parse() -> None:
    text = TrtllmStandIn().metrics()
    assert parse_metrics(text, MODEL).k == 2 and parse_metrics(text, "other").drafted == 0
