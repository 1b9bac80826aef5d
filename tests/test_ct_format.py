"""``convert --format compressed-tensors``: the modelopt export converted by compressed-tensors' own converter, in
every MTP mode, on the tiny models of all three families; checked against the modelopt output of the same convert
(the same weights, dequantized), by inspect, graft and validate. The real vLLM CPU engine loading and drafting from
these outputs is in tests/test_engine_validate.py."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from mtpquant.api import ConvertOptions, GraftOptions, ValidateOptions, convert, graft, validate
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode
from mtpquant.formats.nvfp4 import dequantize_nvfp4, from_compressed_tensors
from mtpquant.synth.train import TINY_MTP_ASSET

pytestmark = pytest.mark.slow

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
CALIB = {"calib_samples": 2, "calib_seq_len": 32}
CT = "compressed-tensors"


@pytest.fixture(scope="module")
def converted(
    tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str, str, str], Path]]:
    """OUT of ``convert SRC --mtp MODE --format FMT`` (once per module and arguments)."""
    root = tmp_path_factory.mktemp("ct")
    runs: dict[tuple[str, str, str], Path] = {}

    def get(family: str, mode: str, fmt: str) -> Path:
        key = (family, mode, fmt)
        if key not in runs:
            src = TINY_MTP_ASSET if family == "trained" else tiny_factory(family)
            out = root / f"{family}-{mode}-{fmt}"
            convert(
                ConvertOptions(
                    src=str(src), out=out, mtp=mode, output_format=fmt, device="cpu", progress=False, **CALIB
                )  # type: ignore[arg-type]
            )
            runs[key] = out
        return runs[key]

    yield get


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Every Linear weight, dequantized to float32 from either layout; every other tensor as stored."""
    ckpt = Checkpoint.open(path)
    t = ckpt.tensors
    out: dict[str, torch.Tensor] = {}
    for name in t:
        module, _, param = name.rpartition(".")
        if param == "weight_packed":
            w = from_compressed_tensors(
                ckpt.read_tensor(name),
                ckpt.read_tensor(f"{module}.weight_scale"),
                ckpt.read_tensor(f"{module}.weight_global_scale"),
            )
            out[f"{module}.weight"] = dequantize_nvfp4(w.packed, w.weight_scale, w.weight_scale_2)
        elif param == "weight" and t[name].dtype == "U8":
            out[name] = dequantize_nvfp4(
                ckpt.read_tensor(name),
                ckpt.read_tensor(f"{module}.weight_scale"),
                ckpt.read_tensor(f"{module}.weight_scale_2"),
            )
        elif param in ("input_scale", "input_global_scale"):
            s = ckpt.read_tensor(name).float().reshape(())
            out[f"{module}.input_scale"] = s if param == "input_scale" else 1 / s
        elif param not in ("weight_scale", "weight_scale_2", "weight_global_scale"):
            out[name] = ckpt.read_tensor(name)
    return out


def _same_weights(modelopt: Path, ct: Path) -> None:
    a, b = _weights(modelopt), _weights(ct)
    assert sorted(a) == sorted(b)
    for name in a:
        if a[name].dtype == torch.float32 and b[name].dtype == torch.float32:
            # the global scales are stored as reciprocals: 1 / (1 / s) is s to within one float32 ulp
            assert torch.allclose(a[name], b[name], rtol=2**-22, atol=0), name
        else:
            assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def _qc(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("family", FAMILIES)
def test_keep(converted: Callable[[str, str, str], Path], tiny_factory: Callable[[str], Path], family: str) -> None:
    out = converted(family, "keep", CT)
    qc = _qc(out)
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
    assert qc["config_groups"]["config_group_0"]["targets"] == ["Linear"]
    assert r"re:^mtp\..*" in qc["ignore"] and "lm_head" in qc["ignore"]
    assert not (out / "hf_quant_config.json").exists()
    ckpt, src = Checkpoint.open(out), Checkpoint.open(tiny_factory(family))
    names = sorted(ckpt.tensors)
    assert any(n.endswith(".weight_packed") for n in names) and not any(n.endswith(".weight_scale_2") for n in names)
    for e in src.mtp_tensors():  # the MTP byte for byte
        assert ckpt.read_raw(ckpt.tensors[e.name]) == src.read_raw(e), e.name
    report = inspect_checkpoint(out)
    assert report.healthy, report.failure_messages
    assert report.quantization.method == "compressed-tensors" and report.mtp_precision == "BF16"
    assert report.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    assert report.verdicts["sglang"] == "SGLang: MTP loads (BF16)"  # SGLang keeps a compressed-tensors config
    assert report.main_model.quantized == inspect_checkpoint(converted(family, "keep", "modelopt")).main_model.quantized
    _same_weights(converted(family, "keep", "modelopt"), out)


@pytest.mark.parametrize("family", FAMILIES)
def test_quantize(converted: Callable[[str, str, str], Path], family: str) -> None:
    out = converted(family, "quantize", CT)
    ckpt = Checkpoint.open(out)
    mtp = {n for n in ckpt.tensors if n.startswith("mtp.")}
    assert "mtp.layers.0.self_attn.o_proj.weight_packed" in mtp
    assert "mtp.layers.0.self_attn.o_proj.input_global_scale" in mtp
    assert ckpt.tensors["mtp.fc.weight"].dtype == "BF16" and "mtp.fc" in _qc(out)["ignore"]
    assert not any(n.endswith((".weight_scale_2", ".input_scale")) for n in mtp)
    report = inspect_checkpoint(out)
    assert report.healthy, report.failure_messages
    assert report.verdicts["vllm"].startswith("vLLM: MTP loads (mixed: BF16, NVFP4-CT")
    # SGLang builds the MTP with a compressed-tensors config (only ModelOpt formats get a BF16 MTP there)
    assert report.verdicts["sglang"] == (
        "SGLang: MTP loads (mixed: BF16, NVFP4-CT; SGLang builds the MTP with the checkpoint's compressed-tensors "
        "quantization)"
    )
    _same_weights(converted(family, "quantize", "modelopt"), out)


def test_extract_and_drop(converted: Callable[[str, str, str], Path], tmp_path: Path) -> None:
    out = converted("qwen3_5", "extract", CT)
    sidecar = out.with_name(out.name + "-mtp")
    modelopt_sidecar = converted("qwen3_5", "extract", "modelopt").with_name("qwen3_5-extract-modelopt-mtp")
    for name in ("mtp-00001-of-00001.safetensors", "model.safetensors.index.json", "config.json"):
        assert (sidecar / name).read_bytes() == (modelopt_sidecar / name).read_bytes(), name  # the format is OUT's
    for path in (out, converted("qwen3_5", "drop", CT)):
        assert not any(n.startswith("mtp.") for n in Checkpoint.open(path).tensors)
        assert _qc(path)["format"] == "nvfp4-pack-quantized"
        assert r"re:^mtp\..*" not in _qc(path)["ignore"]
    _same_weights(converted("qwen3_5", "drop", "modelopt"), converted("qwen3_5", "drop", CT))
    # graft reads compressed-tensors: the sidecar back into the CT output gives what CT keep gives
    grafted = tmp_path / "grafted"
    graft(GraftOptions(quant=str(out), source=str(sidecar), out=grafted))
    report = inspect_checkpoint(grafted)
    assert report.healthy and report.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    assert r"re:^mtp\..*" in _qc(grafted)["ignore"]
    _same_weights(converted("qwen3_5", "keep", CT), grafted)


def test_validate_keep_mtp_kl_is_zero(converted: Callable[[str, str, str], Path], tmp_path: Path) -> None:
    out = converted("trained", "keep", CT)
    result = validate(
        ValidateOptions(TINY_MTP_ASSET, out, num_prompts=2, max_len=32, k=2, device="cpu", progress=False)
    )
    cmp = result.report.comparison
    assert cmp is not None and cmp.mtp is not None and cmp.mtp.kl is not None
    assert cmp.mtp.kl.mean == 0.0 and cmp.mtp.top1_agreement == 1.0


@pytest.mark.parametrize(
    "argv",
    [["--recipe", "nvfp4-w4a16"], ["--mtp", "quantize", "--mtp-format", "fp8"]],
    ids=["weights-only", "fp8-mtp"],
)
def test_what_the_converter_does_not_convert_is_refused_before_anything(
    argv: list[str], tiny_factory: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = main(["convert", str(tiny_factory("qwen3_5")), str(out), "--format", CT, *argv, "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == ExitCode.USAGE and err.startswith("mtpquant: error: --format compressed-tensors"), err
    assert len(err.splitlines()) == 1 and list(tmp_path.iterdir()) == []
