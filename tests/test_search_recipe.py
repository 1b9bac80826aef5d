"""The recipe and the memory plan are law for ``tune-mtp`` as for ``convert --mtp auto``: what QUANT's recipe (or
``--recipe``) leaves unquantized stays BF16 in the MTP; ``--max-memory`` caps the target the search measures on.

A ``--keep-mtp`` quant of the trained tiny Qwen3.5-MoE made with ``--set 'quantization.exclude=["*mlp.experts*"]'``
(its routed experts BF16, as the engine tests serve it on CPU), then ``tune-mtp --al-budget 1.0`` (a budget every
configuration meets): the MTP's routed experts are SRC's BF16 bytes, no configuration measured quantizes them, and
the report names the group the recipe fixed. ``--recipe`` replaces QUANT's recipe (the plan says what it fixes).
``--max-memory`` is planned as convert plans it (the dry run prints the plan) and its caps reach the target's loader
(accelerate's device map: what does not fit is read from the files).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from mtpquant.api import ConvertOptions, SearchSettings, TuneOptions, convert, inspect_checkpoint, tune_mtp
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main as cli
from mtpquant.synth.train import TINY_MTP_ASSETS

pytestmark = pytest.mark.slow

MOE = TINY_MTP_ASSETS["qwen3_5_moe"]
EXCLUDE = 'quantization.exclude=["*mlp.experts*"]'


@pytest.fixture(scope="module")
def keep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("recipe") / "keep"
    convert(ConvertOptions(src=str(MOE), out=out, mtp="keep", device="cpu", progress=False, overrides=(EXCLUDE,),
                           calib_samples=8, calib_seq_len=64))  # fmt: skip
    return out


def _experts(ckpt: Checkpoint) -> dict[str, str]:
    """The MTP's routed-expert tensors (stored per expert in this asset) and their bytes' digests."""
    names = [e.name for e in ckpt.mtp_tensors() if ".mlp.experts." in e.name]
    return {e.name: hashlib.sha256(data).hexdigest() for e, data in ckpt.iter_raw(names)}


def test_tune_mtp_keeps_what_quants_recipe_excludes(keep: Path, tmp_path: Path) -> None:
    settings = SearchSettings(budget=1.0, num_prompts=8, confirm_prompts=8, max_len=48, k=2, precisions=("nvfp4",),
                              max_confirm=1)  # fmt: skip
    result = tune_mtp(TuneOptions(quant=keep, source=MOE, out=tmp_path / "tuned", search=settings, device="cpu",
                                  progress=False))  # fmt: skip
    search = result.search
    assert search is not None
    assert result.plan.fixed == ("experts",) and search.fixed == ("experts",)
    assert {j.assignment["experts"] for j in search.evaluated} == {"bf16"}
    # at a budget of 1 AL something is quantized (the MTP shrinks), but never the routed experts
    assert not search.choice.assignment.all_bf16
    out = Checkpoint.open(tmp_path / "tuned")
    src = _experts(Checkpoint.open(MOE))
    assert len(src) == 12 and _experts(out) == src  # SRC's BF16 bytes, and no scale beside them
    assert {e.dtype for e in out.mtp_tensors() if ".mlp.experts." in e.name} == {"BF16"}
    # declared unquantized, as the engines read the declaration: excluded by name, or absent from MIXED_PRECISION's
    # quantized layers
    modules = {n.rsplit(".", 1)[0] for n in src}
    hfq = json.loads((tmp_path / "tuned" / "hf_quant_config.json").read_text())["quantization"]
    if hfq["quant_algo"] == "MIXED_PRECISION":
        assert not modules & set(hfq["quantized_layers"]), hfq["quantized_layers"]
    else:
        assert all(any(fnmatch.fnmatch(m, pat) for pat in hfq["exclude_modules"]) for m in modules), hfq
    assert inspect_checkpoint(tmp_path / "tuned").verdicts["vllm"].startswith("vLLM: MTP loads")
    report = json.loads((tmp_path / "tuned" / "mtp_search/report.json").read_text())
    assert report["fixed"] == ["experts"]
    assert len(report["selection_prompts"]) == len(report["confirmation_prompts"]) == 8
    assert not set(report["selection_prompts"]) & set(report["confirmation_prompts"])
    assert "keeps experts BF16" in (tmp_path / "tuned" / "mtp_search/report.md").read_text()


def test_recipe_flag_replaces_quants_recipe(keep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--recipe: the named recipe's exclusions, not QUANT's (the built-in MoE recipe excludes no MTP group)."""

    def plan(*extra: str) -> dict[str, Any]:
        capsys.readouterr()
        code = cli(["-q", "tune-mtp", str(keep), "--from", str(MOE), "--out", str(tmp_path / "o"), "--dry-run",
                    "--json", *extra])  # fmt: skip
        assert code == 0
        data: dict[str, Any] = json.loads(capsys.readouterr().out)["plan"]
        return data

    assert plan()["fixed"] == ["experts"]
    other = plan("--recipe", "qwen3_5_moe-nvfp4")
    assert other["fixed"] == [] and other["calibration_from"] == "recipe qwen3_5_moe-nvfp4"
    assert not (tmp_path / "o").exists()


def test_max_memory_caps_the_search_target(keep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import mtpquant.measure.target as target

    seen: list[Any] = []
    real = target.load_target

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("max_memory"))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "load_target", recording)
    settings = SearchSettings(budget=0.0, confirm_prompts=5, max_len=32, k=1)
    result = tune_mtp(TuneOptions(quant=keep, source=MOE, out=tmp_path / "capped", search=settings, device="cpu",
                                  progress=False, max_memory="cpu=3GiB"))  # fmt: skip
    assert seen == [{"cpu": 3 * 2**30}] and result.plan.memory.caps is not None
    capsys.readouterr()
    code = cli(["-q", "tune-mtp", str(keep), "--from", str(MOE), "--out", str(tmp_path / "o"), "--max-memory",
                "cpu=3GiB", "--dry-run"])  # fmt: skip
    assert code == 0
    assert "memory     QUANT's main model (the search's target)" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()
