"""validate through the real vLLM CPU engine: ``--engine vllm`` (servers mtpquant starts) and ``--server URL``.

The trained tiny model's ``convert --keep-mtp`` and ``--mtp quantize`` outputs are measured by the engine's own
counters at k = 3 and 2 (per draft position: the first j are what k = j accepts), greedy and under sampling
(T = 0.8; top-p 0.9 on the keep output), and compared with the built-in prediction on the same prompts (their
compressed-tensors twins greedily at k = 2); a ``--mtp drop``
output grafted back measures as the keep output does; the bad-input cases are one-line errors with their
exit codes and nothing written into the report directory.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from mtpquant.api import ConvertOptions, GraftOptions, ValidateOptions, convert, graft, inspect_checkpoint, validate
from mtpquant.cli import main as cli
from mtpquant.engine.launch import free_port
from mtpquant.engine.table import engine as engine_row
from mtpquant.errors import ExitCode
from mtpquant.synth.train import TINY_MTP_ASSET
from tests.support.engine import CONCURRENCY, CPU_ENV, MP_CPU_ENV, EnginePool
from tests.support.hubserver import LocalHub
from tests.support.sglang_replay import SglangReplay

pytestmark = pytest.mark.engine

Factory = Callable[[str], Path]
# The pair of servers with the same MTP (the grafted output against the keep output): any prompts measure the same on
# both, and 8 are enough for an interval (records/evidence.py MIN_UNITS)
PROMPTS = 8
MAX_LEN = 64


class Outputs:
    """convert of the trained tiny model, each made on first use: keep, quantize (NVFP4 MTP) and drop, drop grafted
    back, and keep and quantize in the compressed-tensors layout (``ct-keep``, ``ct-quantize``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.made:
            out = self.root / name
            if name == "grafted":
                graft(GraftOptions(quant=self["drop"], source=TINY_MTP_ASSET, out=out))
            else:
                layout, _, mode = name.rpartition("-")
                fmt: Literal["modelopt", "compressed-tensors"] = "compressed-tensors" if layout == "ct" else "modelopt"
                convert(ConvertOptions(src=str(TINY_MTP_ASSET), out=out, mtp=mode, calib_samples=8, calib_seq_len=128,
                                       output_format=fmt, device="cpu", progress=False))  # fmt: skip
            self.made[name] = out
        return self.made[name]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    return Outputs(tmp_path_factory.mktemp("engine-validate"))


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli(["-q", "validate", *argv])
    return code, capsys.readouterr().err.strip()


# Sampled and greedy, on both outputs: the quantize output at T = 0 and 0.8 through a server mtpquant starts (k = 3;
# the full lane: T = 0 alone),
# the keep output at T = 0 and T = 0.8 with top-p 0.9 through a running one (k = 2: the pool's, shared with the pair
# tests below). One server per output, every setting on it. vLLM accepts draft i with the same probability, given the
# context, whatever k >= i (the argmax draft accepted with the target's probability of it, given drafts 1..i-1 were),
# so a k-server's first j positions measure what a j-server accepts (AL for k = j: 1 + their sum), up to where the
# steps start (measured on the keep output: position 1 at k = 2 within 0.02 of a k = 1 server's): k = 1 and 2 are
# checked per position, on both outputs.
SAMPLING: dict[str, dict[str, Any]] = {
    "keep": {"temperatures": (0.0, 0.8), "top_p": (1.0, 0.9)},
    "quantize": {"temperatures": (0.0, 0.8)},
    "quantize-greedy": {"temperatures": (0.0,)},  # the full lane's (the test's "greedy" case)
}
LABELS = {"keep": ["T=0", "T=0.8, top-p 0.9"], "quantize": ["T=0", "T=0.8"], "quantize-greedy": ["T=0"]}
# Sized so that the engine's own sampling noise is well below the tolerances. A per-position acceptance is a rate
# over the verification steps, so its standard error is at most 0.5 / sqrt(steps); the built-in prediction's is
# smaller (it adds expected acceptances, not coin flips). 48 prompts of at most 80 tokens (half of 160), each continued
# by 80 or more tokens, give >= 3,840 generated tokens per setting: ~1,800 steps at the greedy AL of ~2.1 the tiny
# model has at k = 3 (>= 1,000 while AL < 3.8: asserted) and ~2,500 at its AL of ~1.5 at T = 0.8: the engine's
# standard error is <= 0.016 (~0.010 at T = 0.8), the difference's about 0.02 at most, and 0.05 is ~3-5 of it; AL's
# (1 + the sum over positions) 0.1 is further off. The prompts are the same on both sides, so prompt-to-prompt
# differences cancel.
# (Measured at k = 1 and 2 over both outputs and three settings: the largest differences were 0.051 in AL and 0.037
# per position; the keep output at k = 2 here: 0.014 and 0.011, with 1,979 and 2,403 steps.)
SAMPLED_PROMPTS = 48
SAMPLED_LEN = 160
AL_TOLERANCE = 0.1
POSITION_TOLERANCE = 0.05
MIN_STEPS = 1000


def _agree(mode: str, k: int, rows: list[dict[str, Any]]) -> None:
    """The engine's AL and per-position acceptance against the prediction's, per setting, and the sampled setting's
    cost in acceptance as predicted."""
    assert [(r["label"], r["k"]) for r in rows] == [(label, k) for label in LABELS[mode]]
    for r in rows:
        where = f"{mode}: {r}"
        assert r["engine_steps"] >= MIN_STEPS, where  # the sizing above
        # AL is 1 + the sum of k per-position rates (greedy: a near-tie argmax that the engine's kernels and torch
        # break differently changes the rest of a sequence; sampled: the two sides sample their own sequences)
        assert abs(r["difference"]) <= max(AL_TOLERANCE, 0.05 * k), where
        for e, p in zip(r["engine_per_position"], r["predicted_per_position"], strict=True):
            assert abs(e - p) <= POSITION_TOLERANCE, where
    if len(rows) == 2:  # sampling costs acceptance, and the prediction says how much before any engine runs
        greedy, hot = (r["predicted_al"] for r in rows)
        assert hot < greedy - 0.1


@pytest.mark.parametrize("settings", [
    "greedy",
    pytest.param("sampled", marks=pytest.mark.nightly(
        reason="greedy and T = 0.8 on one server, 48 prompts each: the full lane runs the greedy setting alone (the "
        "same server, prompts and tolerances); the sampled setting's agreement at scale is the nightly lane's, with "
        "test_running_server_measures_what_the_builtin_path_predicts")),
])  # fmt: skip
def test_engine_measures_what_the_builtin_path_predicts(
    outputs: Outputs, vllm: EnginePool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: str
) -> None:
    """``--engine vllm --compare-reference`` on the quantize output (NVFP4 MTP): the server mtpquant starts itself
    (every sampling setting on it, ``--concurrency`` requests in flight) against the built-in prediction (the rule's
    probabilities along sequences the target samples) on the same prompts, lengths and seeds, per setting and draft
    position (``greedy``: T = 0 alone; ``sampled``: T = 0 and 0.8, and the sampled setting's predicted cost). Also:
    the engine starts with no memory argument and no memory variable from the test (mtpquant sizes it), and with
    vLLM's default CPU executor (``MP_CPU_ENV``: the other tests' servers run one process less)."""
    mode = "quantize" if settings == "sampled" else "quantize-greedy"
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    report_dir = tmp_path / "report"
    result = validate(
        ValidateOptions(
            outputs["quantize"],
            num_prompts=SAMPLED_PROMPTS,
            max_len=SAMPLED_LEN,
            ks=(3,),
            device="cpu",
            activations="emulate",  # the engine runs the W4A4 activations too
            engine="vllm",
            vllm_python=vllm.python,
            env=MP_CPU_ENV,
            concurrency=CONCURRENCY,
            compare_reference=True,
            report_dir=report_dir,
            progress=False,
            **SAMPLING[mode],
        )
    )
    report = result.report
    assert [e.k for e in report.engine] == [3] and report.engine[0].version == "0.32.0"
    assert report.engine[0].k_source == "server" and report.engine[0].other_requests == 0
    assert [a.sampling.label for a in report.reference.acceptance_by_sampling] == LABELS[mode]
    args = report.engine[0].server_args
    assert "--speculative-config" in args
    # sized by mtpquant: a KV cache for the requests in flight, sequences of max(512, 2 * max_len) tokens (the floor
    # for this model)
    assert args[args.index("--max-model-len") + 1] == "512"
    assert args[args.index("--max-num-seqs") + 1] == str(CONCURRENCY)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(512 * 2**20)
    assert "--gpu-memory-utilization" not in args  # on the CPU backend the KV size replaces the utilization check
    sized = f"engine memory (cpu): KV cache 536.87 MB for {CONCURRENCY} sequences of 512"
    assert report.engine[0].memory.startswith(sized) and not any("engine memory" in n for n in report.notes)
    _agree(mode, 3, report.predicted.to_json()["reference"] if report.predicted else [])
    assert report.verdict.status == "pass"
    files = sorted(p.relative_to(report_dir).as_posix() for p in report_dir.rglob("*"))
    assert files == [
        "acceptance.png", "logs", "logs/vllm-reference-k3.log", "report.json", "report.md", "speculation_profile.json"
    ]  # fmt: skip
    profile = json.loads((report_dir / "speculation_profile.json").read_text())
    assert profile["num_speculative_tokens"] == 3 and profile["measurement_conditions"]["engine"] == "vllm 0.32.0"
    md = (report_dir / "report.md").read_text()
    assert "## Engine vs built-in prediction" in md and f"| reference | {LABELS[mode][-1]} | 3 |" in md
    log = (report_dir / "logs" / "vllm-reference-k3.log").read_text()
    assert "GiB for KV cache on node" in log  # took the size
    assert "(Worker pid=" in log  # vLLM's default executor: the model runs in a worker process of its own


@pytest.mark.parametrize("mode", [
    pytest.param("keep", marks=pytest.mark.nightly(
        reason="the compressed-tensors keep output through vLLM (a convert and a server more): the full lane serves "
        "the compressed-tensors quantize output, whose MTP vLLM reads quantized in that layout")),
    "quantize",
])  # fmt: skip
def test_compressed_tensors_outputs_load_and_draft(
    outputs: Outputs, vllm: EnginePool, tmp_path: Path, mode: str
) -> None:
    """vLLM serves the compressed-tensors outputs (its NVFP4 GEMM through the emulation kernel the engine
    environment registers for the CPU, as for modelopt's) and drafts as the built-in path predicts."""
    result = validate(
        ValidateOptions(
            outputs[f"ct-{mode}"],
            num_prompts=8,
            max_len=96,
            ks=(2,),
            device="cpu",
            activations="emulate",
            engine="vllm",
            vllm_python=vllm.python,
            env=CPU_ENV,
            compare_reference=True,
            report_dir=tmp_path / "report",
            progress=False,
        )
    )
    report = result.report
    (row,) = report.predicted.to_json()["reference"] if report.predicted else [None]
    assert row is not None and row["k"] == 2 and row["engine_al"] > 1.5 and abs(row["difference"]) <= 0.15, row
    assert report.verdict.status == "pass"
    log = (tmp_path / "report" / "logs" / "vllm-reference-k2.log").read_text()
    assert "quantization=compressed-tensors" in log and "Using EmulationNvFp4LinearKernel for NVFP4 GEMM" in log


def test_validate_through_the_engine_then_publish(
    outputs: Outputs,
    vllm: EnginePool,
    tmp_path: Path,
    local_hub: LocalHub,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a user saw: ``validate --engine vllm --report-dir OUT/validation`` wrote each server's log into the report
    directory, and ``publish OUT --dry-run`` refused (exit 13: a log names the local path); report.md listed the
    first server's arguments only, the card two unlabelled "engine memory" notes and a serve command at k = 3 after
    validation measured k <= 2. Now the logs land in validation/logs/, which publish keeps local: the dry run and the
    upload succeed, no log is uploaded; report.md names the server's arguments and memory by side and k (every
    server's, with several: tests/test_validate.py, on reports of two servers); the card has neither memory note and
    serves the k validation measured. One server (k = 1: each k is a server start)."""
    import shutil

    from mtpquant.publish.run import PublishOptions, publish

    for key, value in CPU_ENV.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "tiny-keep"
    shutil.copytree(outputs["keep"], out)
    report_dir = out / "validation"
    code, err = _cli(
        capsys, str(out), "--engine", "vllm", "--vllm-python", str(vllm.python), "--k", "1", "--num-prompts", "8",
        "--max-len", "64", "--device", "cpu", "--report-dir", str(report_dir),
    )  # fmt: skip
    assert code == 0, err
    files = sorted(p.relative_to(report_dir).as_posix() for p in report_dir.rglob("*"))
    assert files == [
        "acceptance.png", "logs", "logs/vllm-reference-k1.log", "report.json", "report.md", "speculation_profile.json"
    ]  # fmt: skip
    assert str(out) in (report_dir / "logs" / "vllm-reference-k1.log").read_text()  # why the logs stay local
    report = json.loads((report_dir / "report.json").read_text())
    md = (report_dir / "report.md").read_text()
    assert [e["k"] for e in report["engine"]] == [1]
    for e in report["engine"]:
        assert e["memory"].startswith("engine memory (cpu): KV cache ")
        assert f"- reference, k = {e['k']}: `{' '.join(e['server_args'])}`" in md
        assert f"- reference, k = {e['k']}: {e['memory']}" in md
    assert not any("engine memory" in n for n in report["notes"])

    capsys.readouterr()
    assert cli(["-q", "publish", str(out), "--repo", "org/tiny-keep", "--dry-run"]) == 0, capsys.readouterr().err
    assert "logs/" not in capsys.readouterr().out
    result = publish(PublishOptions(out=out, repo="org/tiny-keep"))
    uploaded = sorted(local_hub.repo_dir("org/tiny-keep", "main").rglob("*"))
    names = {p.relative_to(local_hub.repo_dir("org/tiny-keep", "main")).as_posix() for p in uploaded if p.is_file()}
    assert {f"validation/{f}" for f in files if not f.startswith("logs")} <= names
    assert not any(n.startswith("validation/logs") or n.endswith(".log") for n in names)
    assert names - {".gitattributes"} == {f.path for f in result.files}
    card = result.card
    assert "engine memory" not in card and "measured this checkpoint through vllm 0.32.0" in card
    assert "Drafting 1 token per step (k = 1), the largest k the validation report measured." in card
    assert '"num_speculative_tokens":1}' in card and '"num_speculative_tokens":3}' not in card


def test_without_report_dir_the_servers_logs_are_removed(
    outputs: Outputs, vllm: EnginePool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a user saw: without ``--report-dir`` the servers' logs went to a temporary directory nothing removed.
    A run that finishes removes it (one that fails keeps it, and says where: the tests above)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where validate's own temporary files go
    (tmp_path / "tmp").mkdir()
    report = validate(
        ValidateOptions(
            outputs["keep"], num_prompts=4, max_len=64, ks=(1,), device="cpu", engine="vllm",
            vllm_python=vllm.python, env=CPU_ENV, progress=False,
        )
    ).report  # fmt: skip
    assert [e.k for e in report.engine] == [1] and report.engine[0].memory
    assert list((tmp_path / "tmp").iterdir()) == []


# The tests from here to test_default_prediction_agrees_with_vllm_without_bias take their servers from the session's
# pool, which keeps 2 alive and stops the least recently used (tests/support/engine.py): in this order every
# (output, k) starts once, 3 servers in the full lane (the keep output at k = 2 for the tests up to
# test_server_serving_another_model, the grafted one, the drop output), 7 in the nightly lane (the default-prediction
# test's four).
def test_running_server_reports_each_sampling_setting(
    outputs: Outputs, vllm: EnginePool, tmp_path: Path
) -> None:
    """``--server URL`` on the keep output, greedy and T = 0.8 / top-p 0.9 on one running server: one measurement per
    setting, the server's k, the requests in flight, and the profile naming the engine (the prediction's agreement
    with these numbers is the test below's, and test_engine_measures_what_the_builtin_path_predicts')."""
    server = vllm.get(outputs["keep"], 2)
    report = validate(
        ValidateOptions(outputs["keep"], server=server.server.url, concurrency=CONCURRENCY, num_prompts=8, max_len=64,
                        report_dir=tmp_path / "r", progress=False, **SAMPLING["keep"])
    ).report  # fmt: skip
    assert report.engine[0].k == 2 and report.engine[0].sampling["concurrency"] == CONCURRENCY
    measured = report.reference.acceptance_by_sampling
    assert [a.sampling.label for a in measured] == LABELS["keep"]
    assert [a.sampling.top_p for a in measured] == [1.0, 0.9]
    assert all(a.by_k[0].k == 2 and a.by_k[0].num_steps > 0 for a in measured)
    profile = json.loads((tmp_path / "r" / "speculation_profile.json").read_text())
    assert profile["num_speculative_tokens"] == 2 and profile["measurement_conditions"]["engine"] == "vllm 0.32.0"


@pytest.mark.nightly(
    reason="the --server measurement against the prediction at 48 prompts per setting: the full lane checks the same "
    "agreement through --engine (test_engine_measures_what_the_builtin_path_predicts) and --server's settings on 8 "
    "prompts (test_running_server_reports_each_sampling_setting)"
)
def test_running_server_measures_what_the_builtin_path_predicts(
    outputs: Outputs, vllm: EnginePool, tmp_path: Path
) -> None:
    """``--server URL`` on the keep output, greedy and T = 0.8 / top-p 0.9 on one running server, beside the built-in
    prediction of the same prompts and settings (a separate run, as a user without ``--compare-reference`` gets)."""
    common: dict[str, Any] = {
        "num_prompts": SAMPLED_PROMPTS,
        "max_len": SAMPLED_LEN,
        "progress": False,
        **SAMPLING["keep"],
    }
    server = vllm.get(outputs["keep"], 2)
    report = validate(
        ValidateOptions(
            outputs["keep"], server=server.server.url, concurrency=CONCURRENCY, report_dir=tmp_path / "r", **common
        )
    ).report
    assert report.engine[0].k == 2 and report.engine[0].sampling["concurrency"] == CONCURRENCY
    measured = report.reference.acceptance_by_sampling
    assert [a.sampling.label for a in measured] == LABELS["keep"]
    profile = json.loads((tmp_path / "r" / "speculation_profile.json").read_text())
    assert profile["num_speculative_tokens"] == 2 and profile["measurement_conditions"]["engine"] == "vllm 0.32.0"
    predicted = validate(
        ValidateOptions(outputs["keep"], ks=(2,), device="cpu", activations="emulate", **common)
    ).report.reference.acceptance_by_sampling
    rows = []
    for e_acc, p_acc in zip(measured, predicted, strict=True):
        (e,), p = e_acc.by_k, p_acc.by_k[-1]
        rows.append(
            {
                "label": e_acc.sampling.label,
                "k": e.k,
                "engine_steps": e.num_steps,
                "difference": e.mean_acceptance_length - p.mean_acceptance_length,
                "predicted_al": p.mean_acceptance_length,
                "engine_per_position": list(e.acceptance_per_position),
                "predicted_per_position": list(p.acceptance_per_position),
            }
        )
    _agree("keep", 2, rows)


def test_server_pair_grafted_drop_measures_as_keep(
    outputs: Outputs, vllm: EnginePool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep, grafted = vllm.get(outputs["keep"], 2), vllm.get(outputs["grafted"], 2)
    code, err = _cli(
        capsys,
        str(outputs["keep"]),  # the tokenizer of the prompts (a local checkpoint: the built-in path's ids)
        "--server",
        keep.server.url,
        "--candidate-server",
        grafted.server.url,
        "--num-prompts",
        str(PROMPTS),
        "--max-len",
        str(MAX_LEN),
        "--report-dir",
        str(tmp_path / "r"),
    )
    assert code == 0, err
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["mode"] == "pair" and [e["k"] for e in data["engine"]] == [2, 2]
    ref, cand = data["reference"]["acceptance"]["by_k"], data["candidate"]["acceptance"]["by_k"]
    assert ref == cand and data["comparison"]["al_delta_by_k"] == [0.0]  # the same MTP, the same acceptance
    assert ref[0]["num_accepted"] > 0


def test_server_pair_across_engines(
    outputs: Outputs, vllm: EnginePool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A vLLM reference and an SGLang candidate (the recorded real SGLang server, replayed: it served the same
    trained tiny model's MTP at k = 2): one report, each side measured by its own engine's counters."""
    keep = vllm.get(outputs["keep"], 2)
    with SglangReplay() as sglang:
        code, err = _cli(
            capsys,
            str(TINY_MTP_ASSET),
            "--server",
            keep.server.url,
            "--candidate-server",
            sglang.url,
            "--num-prompts",
            "4",
            "--max-len",
            "64",  # 32-token prompts and 32 new tokens: the recorded SGLang request
            "--report-dir",
            str(tmp_path / "r"),
        )
    # 4 prompts are fewer than an interval needs (evidence.MIN_UNITS): the verdict says so instead of guessing
    assert code == ExitCode.VALIDATE_INCONCLUSIVE, err
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["verdict"]["status"] == "inconclusive"
    assert [(e["side"], e["name"], e["k"], e["counters"]) for e in data["engine"]] == [
        ("reference", "vllm", 2, "server-wide"),
        ("candidate", "sglang", 2, "per-request"),
    ]
    ref, cand = data["reference"]["acceptance"]["by_k"][0], data["candidate"]["acceptance"]["by_k"][0]
    assert cand["mean_acceptance_length"] == 1 + 19 / 13 and ref["num_accepted"] > 0
    assert data["comparison"]["al_delta_by_k"] == [cand["mean_acceptance_length"] - ref["mean_acceptance_length"]]


def test_server_without_speculative_decoding_is_a_failure(
    outputs: Outputs, vllm: EnginePool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = vllm.get(outputs["drop"], None)  # the MTP is gone: served without speculative decoding
    code, err = _cli(capsys, "--server", plain.server.url, "--num-prompts", "2", "--report-dir", str(tmp_path / "r"))
    assert code == ExitCode.ENGINE_SPEC_DECODE
    assert err == (
        f"mtpquant: error: {plain.server.url}: {outputs['drop']} exports no speculative-decoding counters during 2 "
        "requests: speculative decoding with MTP is not configured (start it with --speculative-config "
        '\'{"method":"mtp","num_speculative_tokens":K}\')'
    )
    assert not (tmp_path / "r").exists()


def test_server_serving_another_model(
    outputs: Outputs, vllm: EnginePool, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = vllm.get(outputs["keep"], 2)
    code, err = _cli(capsys, "--server", keep.server.url, "--served-model", "org/other")
    assert code == ExitCode.ENGINE_MODEL
    assert err == f"mtpquant: error: {keep.server.url}: serves {outputs['keep']}, not org/other"


# issue 43: validate's default prediction against vLLM, greedy, k = 1 and 3, on DEFAULT_PROMPTS of validate's default
# length (scripts/bench_engine_agreement.py measures the same cells and the source's; docs/BENCHMARKS.md has them).
DEFAULT_PROMPTS = 96
CELL_TOLERANCE = 0.05  # every (output, k): |engine AL - predicted AL|
MEAN_TOLERANCE = 0.02  # the mean signed difference over the cells: no bias


@pytest.mark.nightly(
    reason="issue 43's 96-prompt agreement (four more servers): the full lane checks the prediction against vLLM on "
    "48 prompts per setting (test_engine_measures_what_the_builtin_path_predicts); scripts/bench_engine_agreement.py "
    "measures these cells and the source's for docs/BENCHMARKS.md"
)
def test_default_prediction_agrees_with_vllm_without_bias(outputs: Outputs, vllm: EnginePool) -> None:
    """The keep and quantize outputs through running vLLM servers (k = 1 and 3, greedy, ``--concurrency 8``) beside
    validate's built-in prediction with its DEFAULT settings (activations emulated as served, the last steps counted
    as vLLM counts them): every cell within 0.05 AL, and the mean signed difference within +-0.02. Before issue 43
    the default prediction read above vLLM by up to +0.105 (activations off), and the emulated one below it in every
    cell (its last steps drafted only the tokens left, where vLLM drafts k and counts acceptances past max_tokens)."""
    diffs = []
    for mode in ("keep", "quantize"):
        predicted = validate(
            ValidateOptions(outputs[mode], num_prompts=DEFAULT_PROMPTS, ks=(1, 3), device="cpu", progress=False)
        ).report
        assert predicted.settings.activations == "emulate"
        assert predicted.reference.acceptance is not None
        by_k = {r.k: r for r in predicted.reference.acceptance.by_k}
        for k in (1, 3):
            server = vllm.get(outputs[mode], k)
            served = ValidateOptions(outputs[mode], server=server.server.url, num_prompts=DEFAULT_PROMPTS,
                                     concurrency=CONCURRENCY, progress=False)  # fmt: skip
            engine = validate(served).report
            assert engine.reference.acceptance is not None and engine.engine[0].k == k
            (e,) = engine.reference.acceptance.by_k
            assert e.num_steps >= 1000  # a per-position rate's standard error <= 0.016
            diff = e.mean_acceptance_length - by_k[k].mean_acceptance_length
            where = f"{mode} k={k}: engine {e.mean_acceptance_length:.3f}, "
            where += f"predicted {by_k[k].mean_acceptance_length:.3f}"
            assert abs(diff) <= CELL_TOLERANCE, where
            for ep, pp in zip(e.acceptance_per_position, by_k[k].acceptance_per_position, strict=True):
                assert abs(ep - pp) <= POSITION_TOLERANCE, where
            diffs.append(diff)
    assert abs(sum(diffs) / len(diffs)) <= MEAN_TOLERANCE, diffs


def test_unreachable_server(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    code, err = _cli(capsys, "--server", f"http://127.0.0.1:{port}", "--report-dir", str(tmp_path / "r"))
    assert code == ExitCode.ENGINE_UNREACHABLE
    assert err == f"mtpquant: error: http://127.0.0.1:{port}: cannot connect (connection refused)"
    assert not (tmp_path / "r").exists()


@pytest.fixture
def not_vllm() -> Iterator[str]:
    """A plain HTTP server on 127.0.0.1 (answers 404 everywhere): not an OpenAI-compatible vLLM server."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_server_that_is_not_vllm(not_vllm: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _cli(capsys, "--server", not_vllm)
    assert code == ExitCode.ENGINE_ANSWER
    assert err == (
        f'mtpquant: error: {not_vllm}: not a vLLM server (no /version answering {{"version": ...}}) and not an '
        'SGLang server (no /get_server_info answering {"version": ..., "model_path": ...}) and not a TensorRT-LLM '
        "server (no /prometheus/metrics with trtllm_ metrics)"
    )


def test_engine_that_fails_to_start_names_its_log(
    vllm: EnginePool,
    peer_quant: Factory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tempfile

    for key, value in CPU_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the servers' logs go while validate runs
    (tmp_path / "tmp").mkdir()
    path = peer_quant("autoround-nvfp4-native-dense")  # vLLM 0.32 refuses its nv_fp data type, as inspect predicts
    assert "does not support auto-round data_type 'nv_fp'" in inspect_checkpoint(path).verdicts["vllm"]
    report_dir = tmp_path / "r"
    code, err = _cli(
        capsys,
        str(path),
        "--engine",
        "vllm",
        "--vllm-python",
        str(vllm.python),
        "--k",
        "1",
        "--device",
        "cpu",
        "--report-dir",
        str(report_dir),
    )
    assert code == ExitCode.ENGINE_START
    (logs,) = (tmp_path / "tmp").iterdir()  # a failed run keeps its servers' logs (named in the error), no report
    log = logs / "vllm-reference-k1.log"
    # one line naming the cause (vLLM's own message; its set of types prints in any order) and the log
    assert err.startswith(
        "mtpquant: error: vLLM server exited with code 1 before it was ready: Unsupported data_type: nv_fp"
    )
    assert err.endswith(f"(log: {log})") and "\n" not in err
    assert sorted(p.name for p in logs.iterdir()) == ["vllm-reference-k1.log"] and not report_dir.exists()
    # started through the entry point vLLM supports: its log warned that `python -m vllm.entrypoints.openai.api_server`
    # "is deprecated and may be removed in a future release"
    text = log.read_text()
    assert text.split()[1:3] == ["-m", engine_row("vllm").launch_module] and "deprecated" not in text


def _requests_running(port: int) -> bool:
    """Whether the vLLM server on ``port`` is serving a request now (its ``vllm:num_requests_running`` gauge)."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1, never through a proxy
    try:
        with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return False  # not listening yet
    return any(
        line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[1]) > 0 for line in text.splitlines()
    )


@pytest.fixture
def short_tmpdir() -> Iterator[Path]:
    """A temporary directory with a short path, for a command's TMPDIR (the servers it starts put sockets there)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="mtpq-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ctrl_c_leaves_no_server_behind(
    outputs: Outputs, vllm: EnginePool, tmp_path: Path, short_tmpdir: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    report_dir = tmp_path / "r"
    logs_in = short_tmpdir  # the command's temporary directory: where its server logs while it runs
    cmd = [sys.executable, "-m", "mtpquant", "-q", "validate", str(outputs["keep"]), "--engine", "vllm"]
    cmd += ["--vllm-python", str(vllm.python), "--k", "1", "--device", "cpu", "--report-dir", str(report_dir)]
    cmd += ["--num-prompts", "32", "--max-len", "384"]  # a measurement long enough to be interrupted in
    # Ctrl-C as a terminal delivers it: SIGINT at its default disposition in the command, whatever this test process
    # inherited (a non-interactive shell starts background jobs with SIGINT ignored, and exec keeps that)
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, **CPU_ENV, "TMPDIR": str(logs_in)},
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300

    def waiting(what: str) -> None:  # the command still runs and time is left; else why not (its error, its log)
        if proc.poll() is None and time.monotonic() < deadline:
            return
        found = [*logs_in.glob("mtpquant-*/*"), *report_dir.rglob("*.log")]
        logs = "".join(f"\n--- {p}:\n" + p.read_text(errors="replace")[-3000:] for p in found)
        err = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
        raise AssertionError(f"{what} (exit {proc.returncode}): {err.strip()}{logs}")

    while not list(logs_in.glob("mtpquant-vllm-logs-*/vllm-reference-k1.log")):
        waiting("the server was never started")
        time.sleep(0.05)
    (log,) = logs_in.glob("mtpquant-vllm-logs-*/vllm-reference-k1.log")
    # The server's own log is buffered, so it cannot say when the measurement runs; the server's gauge of running
    # requests does (the log opens with the server's command line, written by mtpquant: its port).
    while not (log.exists() and "--port " in log.read_text(errors="replace")):
        waiting("the server was never started")
        time.sleep(0.05)
    port = log.read_text().split("--port ", 1)[1].split()[0]
    while not _requests_running(int(port)):
        waiting("no request ever ran on the server")
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # Ctrl-C while the measurement runs
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert err.strip().splitlines()[-1] == "mtpquant: interrupted; no output was left behind"
    pattern = f"{engine_row('vllm').launch_module} --model {outputs['keep']} --host 127.0.0.1 --port {port} "
    for _ in range(60):  # the server and its engine-core workers are gone
        alive = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        if not alive:
            break
        time.sleep(0.5)
    assert alive == []
    assert not report_dir.exists()  # no report; the server's log kept where it was written, for a look at why
    assert list(logs_in.glob("mtpquant-*/*")) == [log]
