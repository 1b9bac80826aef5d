"""The precision search on the trained tiny Qwen3.5: ``convert --mtp auto`` and ``tune-mtp`` of a keep convert.

One convert ``--mtp auto``, one keep convert and its ``tune-mtp`` (the same calibration and search settings) are made
once for the module: the choice is within the budget as the search predicts it, smaller than the BF16 MTP (every
group alone fits the budget on this model), written as planned and declared so vLLM loads it; ``tune-mtp`` writes only
the MTP (every other tensor QUANT's bytes) and measures exactly what convert measured, so it chooses the same
configuration (the search is deterministic); a budget of 0 keeps the BF16 MTP.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mtpquant.api import (
    ConvertOptions,
    ConvertResult,
    PublishOptions,
    SearchSettings,
    TuneOptions,
    TuneResult,
    convert,
    inspect_checkpoint,
    publish,
    tune_mtp,
)
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main as cli
from mtpquant.errors import ExitCode
from mtpquant.families import is_mtp_name
from mtpquant.recipes.recipe import RECIPE_FILE, load_recipe
from mtpquant.search.report import read_result
from mtpquant.search.run import search_space
from mtpquant.synth.train import TINY_MTP_ASSET, TINY_MTP_ASSETS

pytestmark = pytest.mark.slow

CALIB = {"calib_samples": 8, "calib_seq_len": 128}
SETTINGS = SearchSettings(num_prompts=24, max_len=96)


def digests(path: Path, *, mtp: bool) -> dict[str, str]:
    ckpt = Checkpoint.open(path)
    names = [n for n in ckpt.tensors if is_mtp_name(n) == mtp]
    return {e.name: hashlib.sha256(data).hexdigest() for e, data in ckpt.iter_raw(names)}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """convert --mtp auto, a keep convert, and tune-mtp of the keep convert (all with the same settings)."""
    root = tmp_path_factory.mktemp("search")
    out: dict[str, Any] = {"root": root}
    common = {"src": str(TINY_MTP_ASSET), "device": "cpu", "progress": False, **CALIB}
    out["auto"] = convert(ConvertOptions(out=root / "auto", mtp="auto", search=SETTINGS, **common))
    out["keep"] = convert(ConvertOptions(out=root / "keep", mtp="keep", **common))
    out["tuned"] = tune_mtp(
        TuneOptions(quant=root / "keep", source=TINY_MTP_ASSET, out=root / "tuned", search=SETTINGS, device="cpu",
                    progress=False)
    )  # fmt: skip
    return out


def _reports_without_timings(root: Path, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each output's mtp_search/report.json less its timings (the one field two seeded runs may differ in)."""
    reports = []
    for name in names:
        report = json.loads((root / name / "mtp_search/report.json").read_text())
        assert report.pop("seconds").keys() == {"target", "sensitivity", "confirm", "total"}
        reports.append(report)
    return reports


def test_convert_auto_chooses_the_smallest_mtp_within_the_budget(made: dict[str, Any]) -> None:
    result: ConvertResult = made["auto"]
    search = result.search
    assert search is not None and result.output is not None
    chosen = search.choice
    budget = SETTINGS.budget
    # predicted within the budget at every k, beyond noise: the whole interval of the change above -budget
    changes = [c.change for s in chosen.by_sampling for c in s.by_k]
    assert len(changes) == SETTINGS.k and all(c is not None and c.low > -budget for c in changes)
    assert chosen.verdict == "within" and chosen.accepted
    # the sensitivity measured every group alone in both precisions (vLLM loads each), and some fit the budget: the
    # chosen MTP is smaller than the BF16 one and than any measured configuration within the budget
    alone = [j for j in search.evaluated if j.role == "sensitivity"]
    assert len(alone) == 6 and any(j.verdict == "within" for j in alone)
    assert chosen.nbytes < search.bf16_bytes
    assert chosen.nbytes == min(j.nbytes for j in search.evaluated if j.accepted)
    assert search.evaluated[0].role == "baseline" and search.evaluated[0].assignment.all_bf16
    assert search.chosen in search.front
    # what was written is the plan of the chosen configuration, in the declaration the plan said
    src = Checkpoint.open(TINY_MTP_ASSET)
    q = load_recipe("qwen3_5-nvfp4").quantization
    space = search_space(src, SETTINGS, main_algo=q.quant_algo, activations=q.activations)
    out = Checkpoint.open(result.output)
    assert {e.name: (e.dtype, e.shape) for e in out.mtp_tensors()} == {
        n: (t.dtype, t.shape) for n, t in space.planned_table(chosen.assignment).items()
    }
    assert sum(e.nbytes for e in out.mtp_tensors()) == chosen.nbytes
    hfq = json.loads((result.output / "hf_quant_config.json").read_text())["quantization"]
    assert (hfq["quant_algo"] == "MIXED_PRECISION") == (chosen.declaration == "mixed")
    assert inspect_checkpoint(result.output).verdicts["vllm"].startswith("vLLM: MTP loads")
    # the recipe records the precision per group; the report reads back and says the same
    recipe = (result.output / RECIPE_FILE).read_text()
    assert "mode: search" in recipe and "  precision:\n" in recipe
    for group, precision in zip(chosen.assignment.groups, chosen.assignment.precisions):
        assert f"    {group}: {precision}\n" in recipe
    report = read_result(json.loads((result.output / "mtp_search/report.json").read_text()))
    assert report.choice.assignment == chosen.assignment and len(report.evaluated) == len(search.evaluated)
    md = (result.output / "mtp_search/report.md").read_text()
    assert f"| {chosen.assignment.label} **chosen** |" in md
    profile = json.loads((result.output / "mtp_search/speculation_profile.json").read_text())
    assert profile["num_speculative_tokens"] == 3
    assert profile["mean_accept_length"] == pytest.approx(chosen.by_sampling[0].by_k[-1].al.estimate, abs=1e-6)
    assert (result.output / "mtp_search/pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_tune_mtp_writes_only_the_mtp_and_chooses_what_convert_chose(made: dict[str, Any]) -> None:
    """tune-mtp of a keep convert: every tensor outside the MTP is QUANT's own bytes (hard-linked), only the MTP bytes
    are written; it measured exactly what convert --mtp auto measured (the same target bytes, MTP, calibration and
    prompts: the search is deterministic), so it chose the same configuration and wrote the same MTP bytes."""
    root: Path = made["root"]
    tuned: TuneResult = made["tuned"]
    auto: ConvertResult = made["auto"]
    assert tuned.search is not None and auto.search is not None
    assert digests(root / "tuned", mtp=False) == digests(root / "keep", mtp=False)
    assert tuned.new_shards == ["mtp-00001-of-00001.safetensors"] and not tuned.rewritten and not tuned.copied
    written = sum(e.nbytes for e in Checkpoint.open(root / "tuned").mtp_tensors())
    assert tuned.mtp_bytes_after == written < tuned.mtp_bytes_before
    # the same measurements, configuration by configuration, and the same choice
    assert [j.assignment for j in tuned.search.evaluated] == [j.assignment for j in auto.search.evaluated]
    assert [j.by_sampling for j in tuned.search.evaluated] == [j.by_sampling for j in auto.search.evaluated]
    assert tuned.search.choice.assignment == auto.search.choice.assignment
    assert digests(root / "tuned", mtp=True) == digests(root / "auto", mtp=True)
    assert inspect_checkpoint(root / "tuned").verdicts == inspect_checkpoint(root / "auto").verdicts
    provenance = json.loads((root / "tuned" / "mtpquant_provenance.json").read_text())
    assert [s["tool"] for s in provenance["steps"]] == ["convert", "tune-mtp"]


def test_a_budget_of_zero_keeps_the_bf16_mtp(made: dict[str, Any], tmp_path: Path) -> None:
    """With no AL to lose, no quantized configuration is taken (none is proven lossless): the MTP stays SRC's BF16
    bytes, as the keep convert has it."""
    root: Path = made["root"]
    small = SearchSettings(budget=0.0, num_prompts=16, max_len=64, max_confirm=1)
    result = tune_mtp(TuneOptions(quant=root / "keep", source=TINY_MTP_ASSET, out=tmp_path / "zero", search=small,
                                  device="cpu", progress=False))  # fmt: skip
    assert result.search is not None
    assert result.search.choice.assignment.all_bf16 and result.search.choice.role == "baseline"
    assert "a budget of 0" in result.search.reason
    assert digests(tmp_path / "zero", mtp=True) == digests(root / "keep", mtp=True)
    assert result.mtp_bytes_after == result.mtp_bytes_before


def test_the_card_describes_the_chosen_mtp(made: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """publish's card of a --mtp auto convert: the search's section with the chosen precision of every group, its
    bytes, the predicted AL of the BF16 MTP and of the chosen one per k with the change's interval (the report's
    numbers), and the links to the full report; mtp_search/ is published beside it. A keep convert's card has none."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result: ConvertResult = made["auto"]
    assert result.search is not None and result.output is not None
    chosen = result.search.choice
    dry = publish(PublishOptions(out=result.output, repo="me/tiny-auto", dry_run=True, base_model="Qwen/Qwen3.5-0.8B"))
    card = dry.card
    assert "MTP) layer's precision chosen per module group by search" in card
    assert "## MTP precision chosen by search" in card and "| Mode | `search` |" in card
    for g in result.search.groups:
        assert f"| {g.label} | {g.linears} | {chosen.assignment[g.key]} |" in card
    base = result.search.evaluated[0].by_sampling[0].by_k
    for c, b in zip(chosen.by_sampling[0].by_k, base, strict=True):
        assert c.change is not None
        assert f"| {c.k} | {b.al.text()} | {c.al.text()} | {c.change.text(signed=True)} |" in card
    assert "[`mtp_search/report.md`](mtp_search/report.md)" in card
    assert {"mtp_search/report.json", "mtp_search/report.md", "mtp_search/pareto.png",
            "mtp_search/speculation_profile.json"} <= {f.path for f in dry.files}  # fmt: skip
    keep = publish(PublishOptions(out=made["root"] / "keep", repo="me/tiny-keep", dry_run=True,
                                  base_model="Qwen/Qwen3.5-0.8B"))  # fmt: skip
    assert "chosen by search" not in keep.card


def test_the_search_is_deterministic_with_its_seed(made: dict[str, Any], tmp_path: Path) -> None:
    """Two tune-mtp runs of the same quant with the same seed, greedy and sampled at T = 0.7: the same configurations
    measured, the same numbers (every AL and interval in report.json; only the timings differ), the same choice and
    the same MTP bytes; report.md has a table of every configuration per sampling setting."""
    root: Path = made["root"]
    small = SearchSettings(num_prompts=16, max_len=64, max_confirm=1, seed=7, temperatures=(0.7,))
    for name in ("one", "two"):
        tune_mtp(TuneOptions(quant=root / "keep", source=TINY_MTP_ASSET, out=tmp_path / name, search=small,
                             device="cpu", progress=False))  # fmt: skip
    reports = _reports_without_timings(tmp_path, ("one", "two"))
    assert reports[0] == reports[1] and reports[0]["settings"]["seed"] == 7
    assert len(reports[0]["evaluated"]) >= 7  # the BF16 MTP and the 6 groups alone at least
    assert digests(tmp_path / "one", mtp=True) == digests(tmp_path / "two", mtp=True)
    md = (tmp_path / "one" / "mtp_search/report.md").read_text()
    rows = len(reports[0]["evaluated"])
    for label in ("T=0", "T=0.7"):
        table = md.split(f"### {label}\n", 1)[1].split("\n\n", 1)[0].strip()
        assert len(table.splitlines()) == 2 + rows  # the head, the rule, every configuration


def test_tune_mtp_refusals(made: dict[str, Any], tiny_factory: Callable[[str], Path], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """One line and its exit code, nothing written: a BF16 checkpoint is no quant (28); an existing OUT (5); a
    source of another family (9); --al-budget without --mtp auto (2). (--mtp auto --heal: tests/test_search_heal.py.)"""
    root: Path = made["root"]

    def run(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = cli(["-q", *argv])
        return code, capsys.readouterr().err.strip()

    code, err = run("tune-mtp", str(TINY_MTP_ASSET), "--from", str(TINY_MTP_ASSET), "--out", str(tmp_path / "a"))
    assert code == ExitCode.TUNE_REFUSED and "re-quantizes the MTP of a ModelOpt NVFP4 quant" in err
    code, err = run("tune-mtp", str(root / "keep"), "--from", str(TINY_MTP_ASSET), "--out", str(root / "auto"))
    assert code == ExitCode.OUTPUT_EXISTS and "already exists" in err
    code, err = run("tune-mtp", str(root / "keep"), "--from", str(tiny_factory("qwen3_next")), "--out",
                    str(tmp_path / "b"))  # fmt: skip
    assert code == ExitCode.LINEAGE and "lineage mismatch" in err
    code, err = run("convert", str(TINY_MTP_ASSET), str(tmp_path / "c"), "--al-budget", "0.1", "--dry-run")
    assert code == ExitCode.USAGE and err.endswith("--al-budget is only used with --mtp auto")
    assert not any(tmp_path.iterdir())


def test_the_trained_tiny_moe_mtp(tmp_path: Path) -> None:
    """The trained tiny Qwen3.8-Flash-Next (its MTP an MoE: fused routed experts, a shared expert, two input
    projections) converted with --mtp auto for every engine: each group alone is measured (the ones no engine loads
    alone too: a quantized shared expert beside BF16 routed experts is read by vLLM's MIXED_PRECISION resolution as
    quantized experts), the choice is within the budget, loads in vLLM and SGLang as inspect reads them, and routed
    experts it quantized are written per expert. (The trained tiny Qwen3.5-MoE: below; vLLM's CPU backend runs no NVFP4
    MoE, so no engine here measures either: scripts/gpu_check.sh step 5a serves the Qwen3.5-MoE's.)"""
    settings = SearchSettings(num_prompts=16, max_len=64, engine="any")
    result = convert(ConvertOptions(src=str(TINY_MTP_ASSETS["qwen4_exp"]), out=tmp_path / "q4", mtp="auto",
                                    search=settings, device="cpu", progress=False, calib_samples=8,
                                    calib_seq_len=64))  # fmt: skip
    search = result.search
    assert search is not None and result.output is not None
    alone = {(j.assignment.changed()[0], j.assignment[j.assignment.changed()[0]]): j
             for j in search.evaluated if j.role == "sensitivity"}  # fmt: skip
    assert set(alone) == {(g, p) for g in ("input", "attention", "shared_expert", "experts") for p in ("fp8", "nvfp4")}
    chosen = search.choice
    assert chosen.accepted and all(c.change is None or c.change.low > -settings.budget
                                   for s in chosen.by_sampling for c in s.by_k)  # fmt: skip
    # smaller than the BF16 MTP whenever some configuration the engines load fits the budget
    if any(j.accepted for j in search.evaluated if j.role != "baseline"):
        assert chosen.nbytes < search.bf16_bytes and chosen.nbytes == min(j.nbytes for j in search.evaluated
                                                                          if j.accepted)  # fmt: skip
    else:
        assert chosen.assignment.all_bf16
    verdicts = inspect_checkpoint(result.output).verdicts
    assert verdicts["vllm"].startswith("vLLM: MTP loads") and verdicts["sglang"].startswith("SGLang: MTP loads")
    names = {e.name for e in Checkpoint.open(result.output).mtp_tensors()}
    fused = {"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"}
    if chosen.assignment["experts"] == "bf16":
        assert fused <= names
    else:
        assert not fused & names and "mtp.layers.0.mlp.experts.3.down_proj.weight_scale" in names


MOE = TINY_MTP_ASSETS["qwen3_5_moe"]
MOE_CALIB = {"calib_samples": 8, "calib_seq_len": 64}


def _moe_auto(out: Path, settings: SearchSettings) -> ConvertResult:
    return convert(ConvertOptions(src=str(MOE), out=out, mtp="auto", search=settings, device="cpu", progress=False,
                                  **MOE_CALIB))  # fmt: skip


def test_the_trained_tiny_qwen3_5_moe(tmp_path: Path) -> None:
    """The trained tiny Qwen3.5-MoE (its MTP an MoE: 4 routed experts per expert, a shared expert) converted with
    --mtp auto for vLLM: every group alone measured in FP8 and NVFP4 (the shared expert too, which vLLM does not load
    quantized beside BF16 routed experts: measured, never chosen); the choice is within the budget at every k beyond
    noise, smaller than the BF16 MTP and the smallest accepted (some group fits the budget on this model), written as
    its plan says and loaded by vLLM as inspect reads it."""
    settings = SearchSettings(num_prompts=16, max_len=64)
    result = _moe_auto(tmp_path / "auto", settings)
    search = result.search
    assert search is not None and result.output is not None
    assert [g.key for g in search.groups] == ["input", "attention", "shared_expert", "experts"]
    alone = {(j.assignment.changed()[0], j.assignment[j.assignment.changed()[0]]): j
             for j in search.evaluated if j.role == "sensitivity"}  # fmt: skip
    assert set(alone) == {(g, p) for g in ("input", "attention", "shared_expert", "experts") for p in ("fp8", "nvfp4")}
    assert not any(alone[("shared_expert", p)].accepted for p in ("fp8", "nvfp4"))
    chosen = search.choice
    assert chosen.accepted and chosen.verdict == "within"
    changes = [c.change for s in chosen.by_sampling for c in s.by_k]
    assert len(changes) == settings.k and all(c is not None and c.low > -settings.budget for c in changes)
    assert any(j.accepted for j in alone.values())  # some group fits the budget: the MTP shrinks
    assert chosen.nbytes < search.bf16_bytes
    assert chosen.nbytes == min(j.nbytes for j in search.evaluated if j.accepted)
    q = load_recipe("qwen3_5_moe-nvfp4").quantization
    space = search_space(Checkpoint.open(MOE), settings, main_algo=q.quant_algo, activations=q.activations)
    out = Checkpoint.open(result.output)
    assert {e.name: (e.dtype, e.shape) for e in out.mtp_tensors()} == {
        n: (t.dtype, t.shape) for n, t in space.planned_table(chosen.assignment).items()
    }
    assert inspect_checkpoint(result.output).verdicts["vllm"].startswith("vLLM: MTP loads")


def test_the_qwen3_5_moe_search_is_deterministic_and_a_budget_of_zero_keeps_bf16(tmp_path: Path) -> None:
    """On the trained tiny Qwen3.5-MoE (BF16 / NVFP4, greedy and T = 0.7, seed 7): two --mtp auto converts measure the
    same numbers (report.json but its timings), choose the same and write the same MTP bytes; with a budget of 0 the
    MTP is the source's BF16 bytes."""
    small = SearchSettings(num_prompts=8, max_len=48, k=2, precisions=("nvfp4",), max_confirm=1, seed=7,
                           temperatures=(0.7,))  # fmt: skip
    for name in ("one", "two"):
        _moe_auto(tmp_path / name, small)
    reports = _reports_without_timings(tmp_path, ("one", "two"))
    assert reports[0] == reports[1] and reports[0]["settings"]["seed"] == 7
    assert len(reports[0]["evaluated"]) >= 5  # the BF16 MTP and the 4 groups alone at least
    assert digests(tmp_path / "one", mtp=True) == digests(tmp_path / "two", mtp=True)
    zero = _moe_auto(tmp_path / "zero", dataclasses.replace(small, budget=0.0))
    assert zero.search is not None
    assert zero.search.choice.assignment.all_bf16 and zero.search.choice.role == "baseline"
    assert "a budget of 0" in zero.search.reason
    assert digests(tmp_path / "zero", mtp=True) == digests(MOE, mtp=True)
