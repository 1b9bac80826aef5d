"""The precision search with ``--heal`` on the trained tiny Qwen3.5, and heal of a mixed-precision MTP.

One keep convert is made for the module; ``tune-mtp --heal`` of it and ``convert --mtp auto --heal`` of the source
(the same calibration, search and heal settings) heal each finalist before it is confirmed on the held-out prompts:
the chosen MTP is a healed finalist, written healed (only MTP bytes differ from QUANT's; its quantized weights are not
SRC's quantized), and both runs measure, train and write exactly the same (deterministic with the seed). ``heal`` of
an MTP whose groups are in different precisions (input FP8, attention NVFP4, MLP BF16: what the search writes)
trains each Linear in its own format and writes each one back in it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mtpquant.api import (
    ConvertOptions,
    ConvertResult,
    HealOptions,
    HealSizes,
    PublishOptions,
    SearchSettings,
    TuneOptions,
    TuneResult,
    convert,
    convert_and_heal,
    heal,
    inspect_checkpoint,
    publish,
    tune_and_heal,
    tune_mtp,
)
from mtpquant.checkpoint.dtypes import st_dtype
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import ExitCode
from mtpquant.heal.precision import export_mtp, master_weights, mtp_storage
from mtpquant.measure.weights import CheckpointWeights
from mtpquant.mtp.quantize import quantize_mtp
from mtpquant.recipes.recipe import RECIPE_FILE
from mtpquant.search.report import read_result
from mtpquant.search.run import search_space
from mtpquant.search.space import Assignment
from mtpquant.synth.train import TINY_MTP_ASSETS
from tests.support.cli import one_error
from tests.test_graft import tensor_digests

pytestmark = pytest.mark.slow

ASSET = TINY_MTP_ASSETS["qwen3_5"]
CALIB = {"calib_samples": 8, "calib_seq_len": 128}
SETTINGS = SearchSettings(budget=0.15, num_prompts=12, confirm_prompts=12, max_len=64, max_confirm=1)
SIZES = HealSizes(prompt_len=32, new_tokens=32, batch_size=4, check_len=32, batch_prompts=8)
HEAL = {"samples": 16, "steps": 16, "lr": 2e-4, "seed": 3, "sizes": SIZES, "device": "cpu", "progress": False}
MIXED = Assignment.of({"input": "fp8", "attention": "nvfp4", "mlp": "bf16"})


def _without_times(report: dict[str, Any]) -> dict[str, Any]:
    report = dict(report)
    report.pop("seconds")
    report["healed"] = [{**f, "training": {**f["training"], "seconds": 0}} for f in report["healed"]]
    return report


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A keep convert; its tune-mtp --heal; convert --mtp auto --heal of the same source (the same settings)."""
    root = tmp_path_factory.mktemp("search-heal")
    out: dict[str, Any] = {"root": root}
    common = {"src": str(ASSET), "device": "cpu", "progress": False, **CALIB}
    convert(ConvertOptions(out=root / "keep", mtp="keep", **common))
    healing = HealOptions(quant=root / "keep", source=ASSET, in_place=True, **HEAL)
    out["tuned"] = tune_and_heal(
        TuneOptions(quant=root / "keep", source=ASSET, out=root / "tuned", search=SETTINGS, device="cpu",
                    progress=False), healing,
    )  # fmt: skip
    out["auto"], healed = convert_and_heal(
        ConvertOptions(out=root / "auto", mtp="auto", search=SETTINGS, **common),
        dataclasses.replace(healing, quant=root / "auto"),
    )
    assert healed is None  # the search healed its finalists: no heal afterwards
    return out


def test_tune_mtp_heal_chooses_a_healed_finalist(made: dict[str, Any]) -> None:
    """Each finalist (selected unhealed on the selection prompts) is healed and then measured on the held-out
    confirmation prompts; a healed finalist is chosen and written healed (its quantized weights are not SRC's weights
    quantized), only the MTP differs from QUANT's, and the report, recipe and profile say so."""
    root: Path = made["root"]
    tuned: TuneResult = made["tuned"]
    search = tuned.search
    assert search is not None and search.heal is not None and search.heal.steps == HEAL["steps"]
    assert search.healed, "no finalist was healed"
    for f in search.healed:
        before, after = search.evaluated[f.before], search.evaluated[f.after]
        assert before.assignment == after.assignment == f.assignment
        assert (before.phase, after.phase) == ("selection", "confirmation")
        assert before.role in ("sensitivity", "confirm") and after.role == "healed" and after.loads
        assert f.training.last_loss < f.training.first_loss
    assert len(search.healed) <= SETTINGS.finalists
    chosen = search.choice
    assert chosen.role == "healed" and chosen.confirmed, "no healed finalist confirmed on the tiny model"
    assert "healed finalist" in search.reason
    # only the MTP written, and healed: its quantized weights are not those of SRC's BF16 weights quantized
    assert tensor_digests(root / "tuned", mtp=False) == tensor_digests(root / "keep", mtp=False)
    assert tuned.new_shards == ["mtp-00001-of-00001.safetensors"]
    src = Checkpoint.open(ASSET)
    out = Checkpoint.open(root / "tuned")
    space = search_space(src, SETTINGS, main_algo="NVFP4", activations=True)
    precision = {m: p for m, p in space.module_precision(chosen.assignment).items() if p != "bf16"}
    plain = quantize_mtp({e.name: src.read_tensor(e.name) for e in src.mtp_tensors()}, None, activations=False,
                         layout=src.spec.family.mtp, precision=precision).tensors  # fmt: skip
    raw = {m: (out.read_tensor(m + ".weight").view(torch.uint8), plain[m + ".weight"].view(torch.uint8))
           for m in precision}  # fmt: skip
    changed = [m for m, (a, b) in raw.items() if not torch.equal(a, b)]
    assert changed and {e.name: e.dtype for e in out.mtp_tensors() if e.name in plain} == {
        n: st_dtype(t.dtype) for n, t in plain.items()}
    assert sum(e.nbytes for e in out.mtp_tensors()) == chosen.nbytes
    assert inspect_checkpoint(root / "tuned").verdicts["vllm"].startswith("vLLM: MTP loads")
    # what is recorded
    assert "\n  healed: true\n" in (root / "tuned" / RECIPE_FILE).read_text()
    report = read_result(json.loads((root / "tuned" / "mtp_search/report.json").read_text()))
    assert report.healed == search.healed and report.heal == search.heal
    md = (root / "tuned" / "mtp_search/report.md").read_text()
    table = md.split("## Healed finalists\n", 1)[1].split("\n\n", 2)[1]
    assert len(table.splitlines()) == 2 + len(search.healed)
    for f in search.healed:
        b, a = search.evaluated[f.before].by_sampling[0].by_k[0], search.evaluated[f.after].by_sampling[0].by_k[0]
        assert f"| {f.assignment.label} | " in table and f"{b.al.estimate:.3f} -> {a.al.estimate:.3f}" in table
    profile = json.loads((root / "tuned" / "mtp_search/speculation_profile.json").read_text())
    assert profile["target_model"]["precision"]["mtp_healed"] is True


def test_the_card_says_the_mtp_was_healed(made: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """publish's card of a --heal search: the chosen MTP was healed, and each finalist's AL before and after."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tuned: TuneResult = made["tuned"]
    assert tuned.search is not None
    card = publish(PublishOptions(out=made["root"] / "tuned", repo="me/tiny-healed", dry_run=True,
                                  base_model="Qwen/Qwen3.5-0.8B")).card  # fmt: skip
    assert "This MTP was healed" in card and "### Healed finalists" in card
    for f in tuned.search.healed:
        assert f"| {f.assignment.label} | " in card.split("### Healed finalists", 1)[1]


def test_convert_auto_heal_is_tune_mtp_heal_and_deterministic(made: dict[str, Any]) -> None:
    """convert --mtp auto --heal of the source and tune-mtp --heal of its keep convert: the same target, MTP,
    calibration, heal data, schedule and seed, so the same measurements (every AL and interval, before and after
    heal), the same losses, the same choice and the same MTP bytes."""
    root: Path = made["root"]
    auto: ConvertResult = made["auto"]
    assert auto.search is not None and auto.search.healed
    reports = [json.loads((root / name / "mtp_search/report.json").read_text()) for name in ("auto", "tuned")]
    a, b = (_without_times(r) for r in reports)
    a.pop("target"), b.pop("target")
    assert a == b and a["heal"]["seed"] == HEAL["seed"]
    assert tensor_digests(root / "auto", mtp=True) == tensor_digests(root / "tuned", mtp=True)
    assert "\n  healed: true\n" in (root / "auto" / RECIPE_FILE).read_text()


@pytest.fixture(scope="module")
def mixed(made: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tune-mtp of the keep convert asked to confirm input FP8, attention NVFP4, MLP BF16 (a budget every
    configuration meets: the combination is taken) and written as the search writes it (MIXED_PRECISION)."""
    import mtpquant.search.decide as decide

    root = tmp_path_factory.mktemp("mixed")
    settings = SearchSettings(num_prompts=6, confirm_prompts=6, max_len=32, max_confirm=1, budget=10.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decide, "next_candidates", lambda *args: [MIXED])
        mp.setattr(decide, "finalists", lambda *args, **kwargs: [MIXED])
        result = tune_mtp(TuneOptions(quant=made["root"] / "keep", source=ASSET, out=root / "quant", search=settings,
                                      device="cpu", progress=False))  # fmt: skip
    assert result.search is not None and result.search.choice.assignment == MIXED
    return root / "quant"


def test_mixed_mtp_written_back_as_the_search_wrote_it(mixed: Path) -> None:
    """Unchanged weights come back as QUANT's exact bytes from heal's write-back of a mixed MTP: each Linear
    re-quantized in its own format with the scales the search wrote (FP8 per tensor, NVFP4 with q/k/v's shared global
    scale), QUANT's input scales, the BF16 group as stored."""
    q, src = Checkpoint.open(mixed), Checkpoint.open(ASSET)
    storage = mtp_storage(q, CheckpointWeights(q).formats)
    assert storage.fmt == "mixed" and storage.activations
    assert storage.precision == {"mtp.fc": "fp8", **{f"mtp.layers.0.self_attn.{p}_proj": "nvfp4" for p in "qkvo"}}
    master, origin = master_weights(q, src, storage)
    assert origin == src.label
    written = export_mtp(q, src, storage, master)
    assert sorted(t.name for t in written) == sorted(e.name for e in q.mtp_tensors())
    for t in written:
        assert t.produce() == q.read_raw(q.tensors[t.name]), t.name


def test_heal_writes_each_group_in_its_format(mixed: Path, tmp_path: Path) -> None:
    """heal of a mixed-precision MTP: each Linear fake-quantized in its own format while it trains, and written back
    in it: every MTP tensor with QUANT's dtype and shape (FP8: weight F8_E4M3, weight_scale F32 []; NVFP4: weight U8
    [out, in / 2], weight_scale F8_E4M3 [out, in / 16], weight_scale_2 F32 [] shared by q/k/v), QUANT's input scales
    byte for byte, new weights; every other tensor and the metadata QUANT's bytes; inspect's verdicts unchanged."""
    result = heal(HealOptions(quant=mixed, source=ASSET, out=tmp_path / "healed", force=True, check_prompts=6,
                              **HEAL))  # fmt: skip
    assert result.plan.storage.fmt == "mixed" and result.plan.storage.label == "mixed: 4 NVFP4, 1 FP8 (W4A4 / W8A8)"
    q, h = Checkpoint.open(mixed), Checkpoint.open(tmp_path / "healed")
    table = {e.name: (e.dtype, tuple(e.shape)) for e in q.mtp_tensors()}
    assert {e.name: (e.dtype, tuple(e.shape)) for e in h.mtp_tensors()} == table
    fp8, nvfp4 = ["mtp.fc"], [f"mtp.layers.0.self_attn.{p}_proj" for p in "qkv"]
    for m in fp8:
        rows, cols = table[m + ".weight"][1]
        assert (table[m + ".weight"], table[m + ".weight_scale"]) == (("F8_E4M3", (rows, cols)), ("F32", ()))
        w8 = h.read_tensor(m + ".weight").float()
        assert float(w8.abs().max()) == 448.0  # the per-tensor scale maps the healed weight's max to E4M3's
    for m in nvfp4:
        rows, cols = table[m + ".weight"][1][0], table[m + ".weight"][1][1] * 2
        assert table[m + ".weight"] == ("U8", (rows, cols // 2))
        assert table[m + ".weight_scale"] == ("F8_E4M3", (rows, cols // 16))
        assert table[m + ".weight_scale_2"] == ("F32", ())
    scales = [h.read_tensor(m + ".weight_scale_2") for m in nvfp4]
    assert all(torch.equal(scales[0], s) for s in scales)  # q/k/v: one global scale, as vLLM fuses them
    assert "mtp.layers.0.mlp.down_proj.weight_scale" not in table and table["mtp.layers.0.mlp.down_proj.weight"][0] \
        == "BF16"  # fmt: skip
    for m in fp8 + nvfp4:
        assert h.read_raw(h.tensors[m + ".input_scale"]) == q.read_raw(q.tensors[m + ".input_scale"])
        assert h.read_raw(h.tensors[m + ".weight"]) != q.read_raw(q.tensors[m + ".weight"])
    assert tensor_digests(tmp_path / "healed", mtp=False) == tensor_digests(mixed, mtp=False)
    for name in ("hf_quant_config.json", "config.json"):
        assert (tmp_path / "healed" / name).read_bytes() == (mixed / name).read_bytes()
    report, before = inspect_checkpoint(tmp_path / "healed"), inspect_checkpoint(mixed)
    assert report.verdicts == before.verdicts and report.verdicts["vllm"].startswith("vLLM: MTP loads")
    assert report.healthy


def test_heal_flags_with_the_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--heal's flags where the search makes them meaningless are refused in one line (2), before any work."""
    code, err = one_error(capsys, "convert", str(ASSET), str(tmp_path / "a"), "--mtp", "auto", "--heal",
                          "--heal-force")  # fmt: skip
    assert code == ExitCode.USAGE and err.endswith("--heal-force is not used with --mtp auto: the search measures "
                                                   "each healed finalist itself (--search-prompts) and writes the "
                                                   "chosen one only within the budget")  # fmt: skip
    code, err = one_error(capsys, "tune-mtp", str(ASSET), "--from", str(ASSET), "--out", str(tmp_path / "b"),
                          "--heal-steps", "3")  # fmt: skip
    assert code == ExitCode.USAGE and err.endswith("--heal-steps is only used with --heal")
    code, err = one_error(capsys, "tune-mtp", str(ASSET), "--from", str(ASSET), "--out", str(tmp_path / "c"),
                          "--heal", "--heal-steps", "0")  # fmt: skip
    assert code == ExitCode.USAGE and err.endswith("--heal-steps must be >= 1, got 0")
    assert not any(tmp_path.iterdir())
