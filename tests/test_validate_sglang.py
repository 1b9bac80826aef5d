"""validate through SGLang servers, against the recorded answers of a real SGLang 0.5.23 server.

SGLang's CPU build needs kernel sources the package registries do not carry, so no SGLang server can start
here: the client is tested on what a real one answered (``tests/support/sglang_replay.py`` replays
``tests/fixtures/sglang-cpu`` on 127.0.0.1, status codes and ``/metrics`` text included). The recorded greedy
``/generate`` answer counts 13 verify steps with the histogram [2, 3, 8] (k = 2): 19 accepted drafts of 26,
AL 1 + 19/13, position 1 accepted in 11 of 13 steps, position 2 in 8. ``test_real_sglang_server`` runs against
a real server when ``MTPQUANT_SGLANG_URL`` names one (skipped otherwise).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mtpquant.cli import main as cli
from mtpquant.engine.connect import connect
from mtpquant.engine.launch import free_port
from mtpquant.engine.server import DraftCounts
from mtpquant.engine.sglang import SglangClient
from mtpquant.errors import EngineAnswerError, ExitCode
from mtpquant.records.sampling import GREEDY, SamplingSettings
from mtpquant.synth.train import TINY_MTP_ASSET
from mtpquant.validate.measure import engine_stats
from tests.support.sglang_replay import RECORDED, SglangReplay
from tests.support.sglang_start import fake_sglang, scheduler_refusal

pytestmark = pytest.mark.dev

TINY = str(TINY_MTP_ASSET)
MODEL = "tiny-qwen3_5-mtp"  # the recorded server's model (its path, as recorded)
# what validate asks for: prompts of 32 tokens (at most half of --max-len) and 32 new ones, as the recorded request
ARGS = ("--num-prompts", "4", "--max-len", "64")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli(["-q", "validate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def _recorded(name: str) -> object:
    return json.loads((RECORDED / name).read_text())


def test_recognises_sglang_and_its_chain() -> None:
    with SglangReplay() as server:
        client, info = connect(server.url)
        assert isinstance(client, SglangClient)
        assert (info.engine, info.version, info.models, info.max_model_len) == ("sglang", "0.5.23", (MODEL,), 512)
        assert info.display == "SGLang 0.5.23" and info.model_path == MODEL
        spec = info.speculative
        assert spec is not None and spec.to_json() == {"algorithm": "EAGLE", "k": 2, "topk": 1, "draft_tokens": 3}
        assert client.check_chain(info) == 2
        # TensorRT-LLM's route, then vLLM's (SGLang answers both 404, as recorded), then SGLang's own
        assert [p for _, p, _ in server.requests] == ["/prometheus/metrics", "/version", "/get_server_info"]


def test_counts_of_the_recorded_answers() -> None:
    client = SglangClient("http://127.0.0.1:1")  # parsing only: nothing is sent
    greedy = _recorded("POST_generate_greedy.json")
    assert isinstance(greedy, dict)
    assert client._counts(greedy["meta_info"], 2) == DraftCounts(13, 26, 19, (11, 8))
    batch = _recorded("POST_generate_batch_t0.8.json")
    assert isinstance(batch, list)
    assert [client._counts(r["meta_info"], 2) for r in batch] == [
        DraftCounts(18, 36, 15, (11, 4)),  # histogram [7, 7, 4]
        DraftCounts(17, 34, 15, (14, 1)),  # histogram [3, 13, 1]
    ]
    stats = engine_stats(DraftCounts(13, 26, 19, (11, 8)))
    assert stats.mean_acceptance_length == 1 + 19 / 13 and stats.acceptance_rate == 19 / 26
    assert stats.acceptance_per_position == (11 / 13, 8 / 13)
    # SGLang's own spec_accept_length is completion_tokens / verify steps; with the prefill token and the last
    # step cut at max_new_tokens it is not 1 + accepted / steps in general (the batch's first request: 32/18)
    assert batch[0]["meta_info"]["spec_accept_length"] == 32 / 18 != 1 + 15 / 18


def test_counters_that_are_not_a_chain_are_refused() -> None:
    client = SglangClient("http://127.0.0.1:1")
    meta = dict(_recorded("POST_generate_greedy.json")["meta_info"])  # type: ignore[index]
    with pytest.raises(EngineAnswerError, match=r"spec_correct_drafts_histogram \[2, 3, 8\] is not a count of 0..3"):
        client._counts(meta, 3)
    with pytest.raises(EngineAnswerError, match=r"the counters disagree .* not a 2-step chain"):
        client._counts({**meta, "spec_num_proposed_drafts": 40}, 2)
    without = {k: v for k, v in meta.items() if not k.startswith("spec_")}
    with pytest.raises(EngineAnswerError, match="has no spec_verify_ct, spec_num_correct_drafts"):
        client._counts(without, 2)


def test_sampling_settings_as_sglang_names_them() -> None:
    # the recorded requests' sampling_params (README of tests/fixtures/sglang-cpu)
    assert GREEDY.sglang_fields(32) == {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    sampled = SamplingSettings(temperature=0.8, top_p=0.95, seed=7).sglang_fields(32)
    assert sampled == {"temperature": 0.8, "top_p": 0.95, "sampling_seed": 7, "max_new_tokens": 32, "ignore_eos": True}
    assert GREEDY.vllm_fields() == {"temperature": 0, "seed": 0}


def test_validate_through_sglang(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with SglangReplay() as server:
        code, out, err = _cli(capsys, TINY, "--server", server.url, *ARGS, "--report-dir", str(tmp_path / "r"))
        sent = server.posted("/generate")
    assert code == 0, err
    assert out.splitlines()[:3] == [
        "             k     AL           95 % CI    rate  per-position acceptance",
        "checkpoint   2  2.462               n/a   73.1%   84.6%  61.5%",  # 4 prompts: too few for an interval
        f"engine: SGLang 0.5.23 at {server.url}, model {MODEL}, k=2 (server)",
    ]
    # the built-in path's prompts (the checkpoint's tokenizer, the first 32 tokens) and greedy settings
    from mtpquant.checkpoint.source import open_source
    from mtpquant.text.prompts import default_prompts, tokenize_prompts

    ids = tokenize_prompts(open_source(TINY), default_prompts(4))
    assert sent == [
        {"input_ids": row[:32], "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
        for row in ids
    ]
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    (engine,) = data["engine"]
    assert {k: engine[k] for k in ("name", "version", "model", "k", "k_source", "counters", "other_requests")} == {
        "name": "sglang",
        "version": "0.5.23",
        "model": MODEL,
        "k": 2,
        "k_source": "server",
        "counters": "per-request",
        "other_requests": 0,  # /metrics: 4 requests finished meanwhile, the 4 sent
    }
    assert engine["speculative"] == {"algorithm": "EAGLE", "k": 2, "topk": 1, "draft_tokens": 3}
    assert engine["server_args"][:8] == [
        "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
    ]  # fmt: skip
    (row,) = data["reference"]["acceptance"]["by_k"]
    assert (row["num_steps"], row["num_drafted"], row["num_accepted"]) == (4 * 13, 4 * 26, 4 * 19)
    assert row["accepted_per_position"] == [4 * 11, 4 * 8] and row["drafted_per_position"] == [52, 52]
    md = (tmp_path / "r" / "report.md").read_text()
    assert f"| reference | SGLang 0.5.23 | {server.url} | `{MODEL}` | 2 (server) | 0 |" in md
    assert "SGLang's speculative counters come with each request" in md


def test_other_requests_are_reported_not_counted(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The recorded /metrics counts 4 finished requests; with 2 sent, 2 were someone else's (not in the counts)."""
    with SglangReplay() as server:
        code, _, err = _cli(
            capsys, TINY, "--server", server.url, "--num-prompts", "2", "--max-len", "64", "--report-dir", str(tmp_path)
        )
    assert code == 0, err
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["engine"][0]["other_requests"] == 2
    assert data["reference"]["acceptance"]["by_k"][0]["num_steps"] == 2 * 13  # only the 2 requests sent
    assert f"2 other request(s) finished on {server.url} during the measurement (k=2); not counted in" in data["notes"]


def test_pair_of_sglang_servers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with SglangReplay() as ref, SglangReplay() as cand:
        code, out, err = _cli(
            capsys, TINY, "--server", ref.url, "--candidate-server", cand.url, *ARGS, "--report-dir", str(tmp_path)
        )
    # the same answers on both sides (change 0), but 4 prompts are too few to decide anything: inconclusive
    assert code == ExitCode.VALIDATE_INCONCLUSIVE, err
    assert "verdict: INCONCLUSIVE: sample too small" in out
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["mode"] == "pair" and [(e["side"], e["name"]) for e in data["engine"]] == [
        ("reference", "sglang"),
        ("candidate", "sglang"),
    ]
    assert data["comparison"]["al_delta_by_k"] == [0.0]
    assert f"engine: candidate: SGLang 0.5.23 at {cand.url}" in out


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"speculative_algorithm": None},
            "SGLang 0.5.23 serves tiny-qwen3_5-mtp without speculative decoding (speculative_algorithm null): "
            "start it with --speculative-algorithm NEXTN --speculative-num-steps K --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens K+1",
        ),
        (
            {"speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8},
            "SGLang 0.5.23 drafts a tree (speculative_eagle_topk 4, speculative_num_draft_tokens 8 for 2 steps), not "
            "the 2-step MTP chain validate measures: start it with --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 3",
        ),
        (
            {"speculative_algorithm": "NGRAM"},
            "SGLang 0.5.23 drafts with NGRAM, not with the checkpoint's MTP: start it with --speculative-algorithm "
            "NEXTN --speculative-num-steps K --speculative-eagle-topk 1 --speculative-num-draft-tokens K+1",
        ),
        (
            {"speculative_adaptive": True},
            "SGLang 0.5.23 changes its number of draft steps as it runs (speculative_adaptive): per-position "
            "acceptance needs a fixed k; start it without --speculative-adaptive",
        ),
    ],
    ids=["no-speculative-decoding", "tree", "ngram", "adaptive"],
)
def test_servers_that_do_not_draft_an_mtp_chain(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, settings: dict[str, object], message: str
) -> None:
    with SglangReplay(settings) as server:
        code, _, err = _cli(capsys, TINY, "--server", server.url, *ARGS, "--report-dir", str(tmp_path / "r"))
        assert server.posted("/generate") == []  # refused before any prompt is sent
    assert code == ExitCode.ENGINE_SPEC_DECODE
    assert err == f"mtpquant: error: {server.url}: {message}"
    assert not (tmp_path / "r").exists()


def test_a_separate_draft_model_is_measured_and_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with SglangReplay({"speculative_draft_model_path": "org/eagle-head"}) as server:
        code, _, err = _cli(capsys, TINY, "--server", server.url, *ARGS, "--report-dir", str(tmp_path))
    assert code == 0, err
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["engine"][0]["speculative"]["draft_model"] == "org/eagle-head"
    assert (
        f"{server.url} drafts with org/eagle-head (its draft model), not necessarily with the MTP of {MODEL}"
        in (data["notes"])
    )


def test_server_serving_another_model(capsys: pytest.CaptureFixture[str]) -> None:
    with SglangReplay() as server:
        code, _, err = _cli(capsys, TINY, "--server", server.url, "--served-model", "org/other")
    assert code == ExitCode.ENGINE_MODEL
    assert err == f"mtpquant: error: {server.url}: serves {MODEL}, not org/other"


def test_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there
    code, _, err = _cli(capsys, TINY, "--server", f"http://127.0.0.1:{port}")
    assert code == ExitCode.ENGINE_UNREACHABLE
    assert err == f"mtpquant: error: http://127.0.0.1:{port}: cannot connect (connection refused)"


@pytest.mark.skipif(not os.environ.get("MTPQUANT_SGLANG_URL"), reason="MTPQUANT_SGLANG_URL names no SGLang server")
def test_real_sglang_server(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A real SGLang server (NEXTN, topk 1) serving an MTP checkpoint: what validate reports must be what the
    server counted. MTPQUANT_SGLANG_CHECKPOINT (optional) is the served checkpoint, for its tokenizer."""
    url = os.environ["MTPQUANT_SGLANG_URL"]
    ckpt = os.environ.get("MTPQUANT_SGLANG_CHECKPOINT")
    code, _, err = _cli(capsys, *([ckpt] if ckpt else []), "--server", url, *ARGS, "--report-dir", str(tmp_path))
    assert code in (0, ExitCode.VALIDATE_FAIL), err
    data = json.loads((tmp_path / "report.json").read_text())
    (engine,) = data["engine"]
    assert engine["name"] == "sglang" and engine["version"] and engine["counters"] == "per-request"
    (row,) = data["reference"]["acceptance"]["by_k"]
    k = engine["k"]
    assert row["k"] == k and row["num_drafted"] == k * row["num_steps"] > 0
    assert 1.0 <= row["mean_acceptance_length"] <= k + 1
    per_pos = row["accepted_per_position"]
    assert sum(per_pos) == row["num_accepted"] and list(per_pos) == sorted(per_pos, reverse=True)  # a chain


def test_engine_sglang_start_failure_names_the_cause_and_the_log(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``--engine sglang`` with a Python that has no SGLang (this one): the server's own error, its log, exit 44.
    The log opens with the command mtpquant ran: the NEXTN chain, the recorded CPU settings, the sized memory. It is
    kept (a failed run's logs are what explains it) in the temporary directory the servers log into, and said where;
    the report directory is not made."""
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    report_dir = tmp_path / "r"
    code, _, err = _cli(
        capsys, TINY, "--engine", "sglang", "--sglang-python", sys.executable, "--k", "1", "--device", "cpu",
        "--report-dir", str(report_dir),
    )  # fmt: skip
    (logs,) = (tmp_path / "tmp").iterdir()
    assert logs.name.startswith("mtpquant-sglang-logs-")
    log = logs / "sglang-reference-k1.log"
    assert code == ExitCode.ENGINE_START
    assert err == (
        f"mtpquant: error: SGLang server exited with code 1 before it was ready: {sys.executable}: "
        "Error while finding module specification for 'sglang.launch_server' (ModuleNotFoundError: No module named "
        f"'sglang') (log: {log})"
    )
    assert sorted(p.name for p in logs.iterdir()) == ["sglang-reference-k1.log"]
    assert f"the engine's server logs are kept in {logs} (the run did not finish)" in caplog.messages
    assert not report_dir.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]  # no report, no trace
    command = log.read_text().splitlines()[0].split()
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    port = command[command.index("--port") + 1]
    assert command[3:] == [
        "--model-path", TINY, "--host", "127.0.0.1", "--port", port, "--random-seed", "0",
        "--context-length", "512", "--max-running-requests", "4", "--max-total-tokens", "2048",
        "--mem-fraction-static", command[command.index("--mem-fraction-static") + 1],
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "2",
        "--device", "cpu", "--dtype", "bfloat16", "--disable-radix-cache", "--skip-server-warmup",
    ]  # fmt: skip


@pytest.mark.slow
def test_engine_sglang_start_refusals_say_what_the_server_needs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--engine sglang` on the shipped tiny model, on a CPU without AMX (tests/support/sglang_start.py goes through
    SGLang's start-up as far as it gets there): the asset lacked preprocessor_config.json, which SGLang reads for
    this vision-language architecture (transformers' own error, with the asset as it was); with the file, SGLang's
    torch_native attention refuses NEXTN, and the error said so in SGLang's words ("ValueError: EAGLE is not
    supported in decode attention backend torch_native"). Each is now one line saying what the server needs."""
    import shutil
    import sys
    import tempfile

    from mtpquant.synth.tiny import vision_processor_configs

    monkeypatch.setenv("PYTHONPATH", str(fake_sglang(tmp_path / "engine")))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the servers' logs go while validate runs
    argv = ("--engine", "sglang", "--sglang-python", sys.executable, "--k", "1,2", "--device", "cpu")
    # the asset ships the files the Qwen3.5 checkpoints ship, for its vision tower's sizes
    config = json.loads((TINY_MTP_ASSET / "config.json").read_text())
    for name, expected in vision_processor_configs(config["vision_config"]).items():
        assert json.loads((TINY_MTP_ASSET / name).read_text()) == expected
    old = tmp_path / "asset-as-it-was"
    shutil.copytree(TINY_MTP_ASSET, old)
    (old / "preprocessor_config.json").unlink()
    (old / "video_preprocessor_config.json").unlink()
    for model, report_dir, cause in [
        (old, tmp_path / "r1",
         f"{old}: no preprocessor_config.json, which SGLang reads to serve this vision-language architecture, text "
         "too (the Qwen3.5 checkpoints ship it and video_preprocessor_config.json: copy both from the base model)"),
        (TINY_MTP_ASSET, tmp_path / "r2",
         "SGLang cannot draft NEXTN on the torch_native attention backend (what it chooses on a CPU without AMX): its "
         "MTP speculative decoding needs a GPU (flashinfer, fa3 or triton attention) or an Intel CPU with AMX "
         "(intel_amx); here, measure with --engine vllm or the built-in path"),
    ]:  # fmt: skip
        shutil.rmtree(tmp_path / "tmp", ignore_errors=True)
        (tmp_path / "tmp").mkdir()
        code, _, err = _cli(capsys, str(model), *argv, "--report-dir", str(report_dir))
        (logs,) = (tmp_path / "tmp").iterdir()  # a failed run keeps its servers' logs where they were written
        log = logs / "sglang-reference-k1.log"  # the first server mtpquant starts (k = 1)
        killed = "-9" if model == TINY_MTP_ASSET else "1"  # SGLang's launcher kills its own process tree
        assert (code, err) == (
            ExitCode.ENGINE_START,
            f"mtpquant: error: SGLang server exited with code {killed} before it was ready: {cause} (log: {log})",
        )


@pytest.mark.parametrize("steps", [1, 2])
def test_the_nextn_refusal_of_either_draft_backend(steps: int) -> None:
    """SGLang words the refusal after its draft backend: the draft-extend one (1 step) or the multi-step decode one."""
    from mtpquant.engine.sglang import start_refusal

    explained = start_refusal(scheduler_refusal(steps))
    assert explained is not None and explained.startswith("SGLang cannot draft NEXTN on the torch_native attention")
    assert start_refusal("ValueError: something else") is None


def test_the_asset_processor_loads_in_transformers() -> None:
    """transformers' AutoImageProcessor reads the asset's preprocessor_config.json as the Qwen3.5 one (this
    environment has no torchvision, which AutoProcessor's video processor needs: the vLLM environment's transformers
    builds the whole Qwen3VLProcessor, below)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(TINY_MTP_ASSET)
    assert type(processor).__name__.startswith("Qwen2VLImageProcessor")
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (16, 2, 2)
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (65536, 16777216)


@pytest.mark.slow
def test_the_asset_processor_loads_as_autoprocessor() -> None:
    """The whole processor an engine builds (transformers' AutoProcessor: image, video and tokenizer), in the vLLM
    environment's transformers (5.19, with torchvision)."""
    import subprocess

    from tests.support.vllm_env import vllm_python

    python = vllm_python()
    if not python.exists():
        pytest.skip("the vLLM test engine is not installed (python -m tests.support.vllm_env)")
    code = (
        "import sys; from transformers import AutoProcessor; p = AutoProcessor.from_pretrained(sys.argv[1]); "
        "print(type(p).__name__, type(p.image_processor).__name__, type(p.video_processor).__name__, "
        "p.video_processor.size.longest_edge, p.video_processor.size.shortest_edge)"
    )
    out = subprocess.run([str(python), "-c", code, TINY], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["Qwen3VLProcessor", "Qwen2VLImageProcessor", "Qwen3VLVideoProcessor", "25165824",
                                  "4096"]  # fmt: skip


def test_engine_sglang_needs_its_python(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(capsys, TINY, "--engine", "sglang", "--vllm-python", "/usr/bin/python3")
    assert code == ExitCode.USAGE
    assert err == ("mtpquant: error: --engine sglang needs --sglang-python PATH (the python of the SGLang environment)")
