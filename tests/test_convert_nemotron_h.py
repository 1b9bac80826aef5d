"""convert and validate on the tiny Nemotron-H (``tiny --variant nemotron_h``: a Mamba, an attention and an MoE layer
under ``backbone.``; the MTP one depth of two sub-layers, ``mtp.layers.{0,1}``, "*E").

Oracles: the source's bytes (what keep carries, what the recipe leaves BF16), the recipe as NVIDIA's Nemotron-3 NVFP4
releases quantize (routed and shared experts only), fnmatch of every exclusion against the output's own Linear
modules (an exclusion that matches nothing is how vLLM came to quantize what the export left BF16), and validate on
the same MTP bytes on both sides (keep) being exactly equal.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pytest

from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.convert.result import ConvertResult
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.diagnose.report import inspect_checkpoint

pytestmark = pytest.mark.slow

CALIB = {"calib_samples": 4, "calib_seq_len": 32, "device": "cpu", "progress": False}
MTP_EXPERTS = {f"mtp.layers.1.mixer.experts.{e}.{x}_proj" for e in range(4) for x in ("up", "down")}
MTP_SHARED = {f"mtp.layers.1.mixer.shared_experts.{x}_proj" for x in ("up", "down")}


@pytest.fixture(scope="module")
def outputs(
    tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], tuple[Path, ConvertResult]]]:
    root = tmp_path_factory.mktemp("nemotron-convert")
    done: dict[str, tuple[Path, ConvertResult]] = {}

    def get(mode: str) -> tuple[Path, ConvertResult]:
        if mode not in done:
            out = root / mode
            extra: dict[str, Any] = {"mtp_out": root / "extract-mtp"} if mode == "extract" else {}
            opts = ConvertOptions(src=str(tiny_factory("nemotron_h")), out=out, mtp=mode, **extra, **CALIB)
            done[mode] = (out, convert(opts))
        return done[mode]

    yield get


def raw(ckpt: Checkpoint, name: str) -> tuple[str, tuple[int, ...], bytes]:
    e = ckpt.tensors[name]
    return e.dtype, tuple(e.shape), ckpt.read_raw(e)


def quantized(ckpt: Checkpoint) -> set[str]:
    return {n[: -len(".weight_scale")] for n in ckpt.tensors if n.endswith(".weight_scale")}


@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_keep_and_quantize(
    mode: str, tiny_factory: Callable[[str], Path], outputs: Callable[[str], tuple[Path, ConvertResult]]
) -> None:
    out, result = outputs(mode)
    source, ckpt = Checkpoint.open(tiny_factory("nemotron_h"), strict=True), Checkpoint.open(out, strict=True)
    mtp_src = sorted(e.name for e in source.mtp_tensors())
    config = json.loads((out / "config.json").read_text())
    assert len(mtp_src) == 3 + 4 + 2 + 2 + 2 + 8 + 1  # glue, attention, norms, router, shared, experts, end norm
    assert result.plan.recipe.name == "nemotron_h-nvfp4" and inspect_checkpoint(out).healthy
    assert config["num_nextn_predict_layers"] == 1 and config["mtp_hybrid_override_pattern"] == "*E"
    q = {m for m in quantized(ckpt) if m.startswith("mtp.")}
    if mode == "keep":
        assert q == set() and sorted(e.name for e in ckpt.mtp_tensors()) == mtp_src
        assert all(raw(ckpt, n) == raw(source, n) for n in mtp_src)
        assert result.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    else:
        assert q == MTP_EXPERTS | MTP_SHARED  # attention and eh_proj stay BF16, as the trunk's attention
        assert all(f"{m}.input_scale" in ckpt.tensors for m in q)  # calibrated through the MTP forward
        kept = [n for n in mtp_src if n.rsplit(".", 1)[0] not in q]
        assert all(raw(ckpt, n) == raw(source, n) for n in kept)
        assert ckpt.tensors["mtp.layers.1.mixer.gate.e_score_correction_bias"].dtype == "F32"
        # modelopt's expert amax sync: one input scale per projection kind across the MTP's experts
        for proj in ("up", "down"):
            scales = {raw(ckpt, f"mtp.layers.1.mixer.experts.{e}.{proj}_proj.input_scale")[2] for e in range(4)}
            assert len(scales) == 1
        assert result.verdicts["vllm"] == "vLLM: MTP loads (mixed: BF16, NVFP4)"


@pytest.mark.parametrize("mode", ["extract", "drop"])
def test_extract_and_drop(
    mode: str, tiny_factory: Callable[[str], Path], outputs: Callable[[str], tuple[Path, ConvertResult]]
) -> None:
    """No MTP in OUT, none declared; extract's side checkpoint holds the source's MTP bytes."""
    out, _ = outputs(mode)
    source, ckpt = Checkpoint.open(tiny_factory("nemotron_h"), strict=True), Checkpoint.open(out, strict=True)
    assert list(ckpt.mtp_tensors()) == [] and inspect_checkpoint(out).healthy
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    if mode == "extract":
        side = Checkpoint.open(out.parent / "extract-mtp", strict=True)
        mtp_src = sorted(e.name for e in source.mtp_tensors())
        assert sorted(side.tensors) == mtp_src and all(raw(side, n) == raw(source, n) for n in mtp_src)


@pytest.mark.parametrize("mode", ["keep", "quantize", "drop"])
def test_carried_tensors_are_the_sources_bytes(
    mode: str, tiny_factory: Callable[[str], Path], outputs: Callable[[str], tuple[Path, ConvertResult]]
) -> None:
    """Every trunk tensor the recipe leaves BF16 (Mamba mixer, attention, router, norms, embeddings, lm_head) is the
    source's bytes under the source's name (backbone.), and NVFP4 holds exactly the routed and shared experts."""
    out, _ = outputs(mode)
    source, ckpt = Checkpoint.open(tiny_factory("nemotron_h"), strict=True), Checkpoint.open(out, strict=True)
    q = {m for m in quantized(ckpt) if not m.startswith("mtp.")}
    main = [n for n in source.tensors if not n.startswith("mtp.")]
    assert {n.rsplit(".", 1)[0] for n in main if "experts." in n} == q  # routed and shared experts, nothing else
    carried = [n for n in main if n.rsplit(".", 1)[0] not in q]
    assert {"backbone.embeddings.weight", "backbone.layers.0.mixer.in_proj.weight", "lm_head.weight",
            "backbone.layers.1.mixer.q_proj.weight", "backbone.layers.0.mixer.A_log"} <= set(carried)  # fmt: skip
    assert [n for n in carried if raw(ckpt, n) != raw(source, n)] == []
    assert ckpt.tensors["backbone.layers.0.mixer.A_log"].dtype == "F32"


@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_every_exclusion_names_a_module_of_the_output(
    mode: str, outputs: Callable[[str], tuple[Path, ConvertResult]]
) -> None:
    """modelopt's rename back to backbone. left its name sentinel in the exclusions ("backbone.layers.0.\\x00backbone.
    pt_name_sentinel*"), which match nothing; convert strips it: every exclusion matches a BF16 Linear of OUT (or the
    embedding table), and every BF16 Linear is excluded."""
    out, _ = outputs(mode)
    ckpt = Checkpoint.open(out, strict=True)
    hfq_text = (out / "hf_quant_config.json").read_text()
    assert "\\u0000" not in hfq_text and "sentinel" not in hfq_text
    assert "sentinel" not in (out / "config.json").read_text()
    exclude = json.loads(hfq_text)["quantization"]["exclude_modules"]
    modules = [*linear_modules(ckpt.tensors), "backbone.embeddings"]
    q = quantized(ckpt)
    for pattern in exclude:
        hits = [m for m in modules if fnmatchcase(m, pattern)]
        assert hits and not set(hits) & q, pattern
    bf16 = [m for m in linear_modules(ckpt.tensors) if m not in q]
    assert [m for m in bf16 if not any(fnmatchcase(m, p) for p in exclude)] == []


def test_repair_exported_names(tmp_path: Path) -> None:
    """The names modelopt 0.47 writes for Nemotron-H (its sentinel ".\\x00modelopt_name_sentinel" renamed by the rule
    model. -> backbone.), repaired in both files; a file without one is left untouched (same bytes)."""
    from mtpquant.convert.model import repair_exported_names

    bad = ["lm_head.\x00backbone.pt_name_sentinel", "backbone.layers.0.\x00backbone.pt_name_sentinel*"]
    hfq: dict[str, Any] = {"quantization": {"exclude_modules": bad, "quant_algo": "NVFP4"}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hfq))
    config = {"quantization_config": {"ignore": bad}, "model_type": "nemotron_h"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert repair_exported_names(tmp_path) == ["hf_quant_config.json", "config.json"]
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"] == [
        "lm_head", "backbone.layers.0*"]  # fmt: skip
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"] == [
        "lm_head", "backbone.layers.0*"]  # fmt: skip
    before = (tmp_path / "config.json").read_bytes()
    assert repair_exported_names(tmp_path) == [] and (tmp_path / "config.json").read_bytes() == before


def test_validate_measures_the_tiny(
    tiny_factory: Callable[[str], Path], outputs: Callable[[str], tuple[Path, ConvertResult]], tmp_path: Path
) -> None:
    """validate's built-in path through transformers' NemotronHForCausalLM (Mamba on the CPU) and the Nemotron-H MTP
    forward: keep's MTP is the source's bytes, so on identical inputs its drafts and every acceptance number are the
    source's exactly; quantize's MTP is NVFP4 (10 expert Linears) and agrees closely. The tiny model is random, so
    the verdict is the broken-MTP one."""
    from mtpquant.validate.run import ValidateOptions, validate

    src = str(tiny_factory("nemotron_h"))
    reports = {}
    for mode in ("keep", "quantize"):
        out, _ = outputs(mode)
        opts = ValidateOptions(reference=src, candidate=str(out), num_prompts=3, max_len=40, k=2, device="cpu",
                               progress=False, report_dir=tmp_path / mode)  # fmt: skip
        reports[mode] = validate(opts).report
    keep, quant = reports["keep"], reports["quantize"]
    for report in (keep, quant):
        assert report.reference.family == "nemotron_h" and report.candidate is not None
        assert report.candidate.mtp.present and report.candidate.mtp.error is None
        assert report.comparison is not None and report.comparison.mtp is not None
        assert report.comparison.mtp.positions > 0
    assert keep.comparison is not None and keep.comparison.mtp is not None and keep.candidate is not None
    assert keep.comparison.mtp.top1_agreement == 1.0 and keep.comparison.mtp.kl is not None
    assert keep.comparison.mtp.kl.max == 0.0
    assert keep.candidate.mtp.precision == {"bf16": 5 + 1 + 2 + 8}  # eh_proj, q/k/v/o; router; shared; experts
    ref_by_k = [a.by_k for a in keep.reference.acceptance_by_sampling]
    assert ref_by_k == [a.by_k for a in keep.candidate.acceptance_by_sampling]
    assert quant.candidate is not None and quant.candidate.mtp.precision is not None
    assert quant.candidate.mtp.precision["nvfp4"] == len(MTP_EXPERTS | MTP_SHARED)
