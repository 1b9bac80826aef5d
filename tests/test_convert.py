"""convert on the tiny real-layout checkpoints: three families x four MTP modes, end to end on CPU.

Every conversion runs once per module (fixture ``converted``) with a few short calibration rows; the
tests below read the outputs. Expected tensor sets are derived here from the source headers and the
format spec (nvfp4-formats.md, qwen-mtp.md), not from the pipeline's own code.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import stat
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import ModelCard

from mtpquant import __version__
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main as cli
from mtpquant.convert.result import ConvertResult
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.formats.nvfp4 import dequantize_nvfp4
from mtpquant.render import convert_text
from mtpquant.surgery.shards import MTP_SHARD_PATTERN

pytestmark = pytest.mark.slow

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MODES = ("keep", "quantize", "extract", "drop")
CALIB = {"calib_samples": 2, "calib_seq_len": 32}
# Modules NVFP4 leaves unquantized (nvfp4-formats.md, "Default NVFP4 recipe ... leaves unquantized").
NEVER_QUANTIZED = (
    "lm_head",
    "*embed_tokens",
    "*.mlp.gate",
    "*.mlp.shared_expert_gate",
    "*linear_attn.conv1d",
    "*linear_attn.in_proj_a",
    "*linear_attn.in_proj_b",
    "*linear_attn.in_proj_ba",
    "model.visual.*",
)
# MTP Linears quantize mode keeps in BF16 (qwen-mtp.md "Consequences for mtpquant").
MTP_KEPT = re.compile(r"^mtp\.(fc|layers\.\d+\.mlp\.gate|layers\.\d+\.mlp\.shared_expert_gate)$")


class Run:
    """One finished conversion and what the test fixture captured during it."""

    def __init__(self, src: Path, out: Path, result: ConvertResult, activations: list[Any]) -> None:
        self.src = src
        self.out = out
        self.result = result
        self.activations = activations


@pytest.fixture(scope="module")
def converted(
    tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str, str], Run]]:
    """Convert (once per module) a tiny family in a mode; quantize mode records the MTP's inputs."""
    from mtpquant.mtp.quantize import MtpCalibrator

    root = tmp_path_factory.mktemp("convert")
    runs: dict[tuple[str, str], Run] = {}

    def get(family: str, mode: str) -> Run:
        key = (family, mode)
        if key not in runs:
            src = tiny_factory(family)
            out = root / f"{family}-{mode}"
            acts: list[Any] = []
            original = MtpCalibrator.observe

            def recording(
                self: MtpCalibrator, hidden: torch.Tensor, embeds: torch.Tensor, positions: Any = None
            ) -> None:
                acts.append((hidden.detach().clone(), embeds.detach().clone()))
                original(self, hidden, embeds, positions)

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(MtpCalibrator, "observe", recording)
                result = convert(
                    ConvertOptions(
                        src=str(src), out=out, mtp=mode, device="cpu", max_shard_size="1MB", progress=False, **CALIB
                    )  # type: ignore[arg-type]
                )
            runs[key] = Run(src, out, result, acts)
        return runs[key]

    yield get


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _never(module: str) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in NEVER_QUANTIZED)


def _nvfp4(module: str, out_f: int, in_f: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {
        f"{module}.weight": ("U8", (out_f, in_f // 2)),
        f"{module}.weight_scale": ("F8_E4M3", (out_f, in_f // 16)),
        f"{module}.weight_scale_2": ("F32", ()),
        f"{module}.input_scale": ("F32", ()),
    }


def expected_main(src: Checkpoint) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Main-model + vision tensors of the output, from the source headers and the ModelOpt layout."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, e in src.tensors.items():
        if name.startswith("mtp."):
            continue
        shape = tuple(e.shape)
        if name.endswith(".experts.gate_up_proj") and len(shape) == 3:  # fused [E, 2I, H]: per expert on export
            experts, two_i, hidden = shape
            stem = name[: -len("gate_up_proj")]
            for x in range(experts):
                out |= _nvfp4(f"{stem}{x}.gate_proj", two_i // 2, hidden)
                out |= _nvfp4(f"{stem}{x}.up_proj", two_i // 2, hidden)
        elif name.endswith(".experts.down_proj") and len(shape) == 3:  # [E, H, I]
            experts, hidden, inter = shape
            stem = name[: -len("down_proj")]
            for x in range(experts):
                out |= _nvfp4(f"{stem}{x}.down_proj", hidden, inter)
        elif name.endswith(".weight") and len(shape) == 2 and not _never(name[: -len(".weight")]):
            out |= _nvfp4(name[: -len(".weight")], *shape)
        else:
            out[name] = (e.dtype, shape)  # unquantized: same dtype (A_log stays F32), same shape
    return out


def expected_mtp(src: Checkpoint, mode: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """MTP tensors of the output per mode."""
    if mode in {"extract", "drop"}:
        return {}
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, e in src.tensors.items():
        if not name.startswith("mtp."):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if mode == "quantize" and len(e.shape) == 2 and not MTP_KEPT.match(module):
            out |= _nvfp4(module, *e.shape)
        else:
            out[name] = (e.dtype, tuple(e.shape))
    return out


def _table(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (e.dtype, tuple(e.shape)) for n, e in Checkpoint.open(path).tensors.items()}


# ---------------------------------------------------------------------------------------------------------
# Tensor sets, dtypes and shapes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_tensor_set_dtypes_and_shapes(converted: Callable[[str, str], Run], family: str, mode: str) -> None:
    run = converted(family, mode)
    src = Checkpoint.open(run.src)
    expected = expected_main(src) | expected_mtp(src, mode)
    got = _table(run.out)
    assert sorted(set(got) - set(expected)) == []
    assert sorted(set(expected) - set(got)) == []
    assert {n: v for n, v in got.items() if v != expected[n]} == {}
    counts = run.result.tensor_counts
    assert sum(counts.values()) == len(expected)
    assert counts.get("mtp", 0) == len(expected_mtp(src, mode))


@pytest.mark.parametrize("family", FAMILIES)
def test_keep_mtp_and_vision_bytes_identical_to_source(converted: Callable[[str, str], Run], family: str) -> None:
    run = converted(family, "keep")
    src, out = Checkpoint.open(run.src), Checkpoint.open(run.out)
    carried = [n for n in src.tensors if n.startswith(("mtp.", "model.visual."))]
    assert any(n.startswith("mtp.") for n in carried)
    assert (family == "qwen3_next") != any(n.startswith("model.visual.") for n in carried)
    for name in carried:
        assert _sha(out.read_raw(out.tensors[name])) == _sha(src.read_raw(src.tensors[name])), name
    # MTP in its own deterministic shard(s): mtp-*, sorted by name.
    mtp_shards = sorted({out.tensors[n].shard for n in carried if n.startswith("mtp.")})
    assert mtp_shards == [MTP_SHARD_PATTERN.format(index=1, count=1)]
    header_order = list(out.headers[mtp_shards[0]].tensors)
    assert header_order == sorted(header_order)


@pytest.mark.parametrize("family", FAMILIES)
def test_unquantized_tensors_keep_source_bytes(converted: Callable[[str, str], Run], family: str) -> None:
    """Norms, embeddings, lm_head, routers, conv1d, A_log: the source's bytes and dtype."""
    run = converted(family, "drop")
    src, out = Checkpoint.open(run.src), Checkpoint.open(run.out)
    same = [n for n in out.tensors if n in src.tensors and n.rsplit(".", 1)[0] + ".weight_scale" not in out.tensors]
    assert len(same) > 20
    assert any(out.tensors[n].dtype == "F32" for n in same) == (family != "qwen3_next")  # A_log, gated norm
    for name in same:
        assert out.read_raw(out.tensors[name]) == src.read_raw(src.tensors[name]), name


def _source_weight(src: Checkpoint, module: str) -> torch.Tensor:
    name = module + ".weight"
    if name in src.tensors:
        return src.read_tensor(name)
    m = re.match(r"^(.*\.experts\.)(\d+)\.(gate|up|down)_proj$", module)
    assert m, module
    stem, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down":
        return src.read_tensor(stem + "down_proj")[e]
    fused = src.read_tensor(stem + "gate_up_proj")[e]
    half = fused.shape[0] // 2
    return fused[:half] if proj == "gate" else fused[half:]


@pytest.mark.parametrize("family", FAMILIES)
def test_nvfp4_weights_dequantize_within_expected_error(converted: Callable[[str, str], Run], family: str) -> None:
    run = converted(family, "keep")
    src, out = Checkpoint.open(run.src), Checkpoint.open(run.out)
    modules = sorted(n[: -len(".weight_scale_2")] for n in out.tensors if n.endswith(".weight_scale_2"))
    assert len(modules) >= 20
    for module in modules:
        packed = out.read_tensor(module + ".weight")
        scale = out.read_tensor(module + ".weight_scale")
        scale_2 = out.read_tensor(module + ".weight_scale_2")
        w = _source_weight(src, module).float()
        deq = dequantize_nvfp4(packed, scale, scale_2)
        # One E2M1 step at the block's scale is the largest rounding error (the 4 -> 6 gap is 2 steps
        # of 1.0 around the midpoint), and the fp8 block scale only shrinks it.
        unit = (scale.float() * scale_2.float()).repeat_interleave(16, dim=1)
        assert bool(((deq - w).abs() <= unit * 1.0 + 1e-12).all()), module
        rel = float((deq - w).norm() / w.norm())
        assert rel < 0.15, (module, rel)
        # max calibration: weight_scale_2 = max|W| / (6 * 448) over the fused group, so >= the own amax.
        assert float(scale_2) >= float(w.abs().max()) / 2688 * (1 - 1e-6), module
        assert float(out.read_tensor(module + ".input_scale")) > 0


# ---------------------------------------------------------------------------------------------------------
# Metadata: exclusions, declaration, inspect verdict


def _exclusions(out: Path) -> tuple[list[str], list[str], dict[str, Any]]:
    config = json.loads((out / "config.json").read_text())
    hfq = json.loads((out / "hf_quant_config.json").read_text())
    return config["quantization_config"]["ignore"], hfq["quantization"]["exclude_modules"], config


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_exclusions_consistent_and_inspect_clean(converted: Callable[[str, str], Run], family: str, mode: str) -> None:
    run = converted(family, mode)
    ignore, exclude, config = _exclusions(run.out)
    assert ignore == exclude
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "NVFP4"
    mtp_entries = [p for p in exclude if p.startswith("mtp")]
    if mode == "keep":
        assert mtp_entries == ["mtp*"]
    elif mode == "quantize":
        kept = ["mtp.fc"] + (
            ["mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.shared_expert_gate"] if family != "qwen3_5" else []
        )
        assert sorted(mtp_entries) == sorted(kept)
    else:
        assert mtp_entries == []
    assert any(p.startswith("model.visual") for p in exclude) == (family != "qwen3_next")

    report = inspect_checkpoint(run.out)
    assert [f.message for f in report.failures] == []
    assert report.healthy and report.exit_code(strict=True) == 0  # every output passes the inspect that gates publish
    if mode in {"extract", "drop"} and family == "qwen3_next":
        # Qwen3-Next has no config key to un-declare its MTP (engines assume one layer): the provenance file says
        # the MTP was removed on purpose, and the verdict says to serve without MTP speculative decoding
        assert report.mtp_removed == mode
        assert report.verdicts["vllm"] == (
            f"vLLM: no MTP (removed on purpose: convert --mtp {mode}); the config cannot un-declare it, so serve "
            "without MTP speculative decoding"
        )
        assert cli(["inspect", str(run.out)]) == 0
    text = config.get("text_config", config)
    if family != "qwen3_next":
        assert text["mtp_num_hidden_layers"] == (1 if mode in {"keep", "quantize"} else 0)
    assert report.mtp_declared == (mode in {"keep", "quantize"} or family == "qwen3_next")
    if mode == "keep":
        assert report.mtp_precision == "BF16"
        assert report.verdicts["sglang"] == "SGLang: MTP loads (BF16)" and "NEXTN" in report.serve_commands["sglang"]
    if mode == "quantize":
        # SGLang builds the MTP of a modelopt_fp4 checkpoint in BF16 (its qwen3_5_mtp.py / qwen3_next_mtp.py): the
        # packed NVFP4 weights of the first quantized MTP module (in name order) do not fit
        first = next(m.module for m in report.mtp_modules if m.disk == "NVFP4")
        assert report.verdicts["sglang"] == (
            "SGLang will fail to load the MTP (NEXTN): SGLang builds the MTP of a serialized modelopt_fp4 checkpoint "
            f"in BF16, and the packed NVFP4 weight of {first} does not fit a BF16 module; serve without speculative "
            "decoding, or with vLLM"
        )
        assert "sglang" not in report.serve_commands
        assert "vLLM: MTP loads" in report.verdicts["vllm"]
        assert any("SGLang" in n for n in run.result.notes)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_carried_files(converted: Callable[[str, str], Run], family: str) -> None:
    run = converted(family, "keep")
    src_config = json.loads((run.src / "config.json").read_text())
    config = json.loads((run.out / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert config == src_config  # text_config, vision_config, MTP keys: as in the source
    assert qc["producer"]["name"] == "modelopt"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (run.out / name).read_bytes() == (run.src / name).read_bytes()
    recipe = (run.out / "mtpquant_recipe.yaml").read_text()
    assert f"name: {family}-nvfp4" in recipe and "samples: 2" in recipe and "mode: keep" in recipe
    files = {p.name for p in run.out.iterdir()}
    assert not any(f.startswith(".") for f in files)  # no scratch export, offload or temp files left
    assert not list(run.out.parent.glob(f".{run.out.name}*"))
    umask = os.umask(0)
    os.umask(umask)
    for p in run.out.iterdir():  # modelopt writes 0600 shards; ours follow the umask
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p.name


def test_main_shards_identical_across_modes(converted: Callable[[str, str], Run]) -> None:
    """The MTP mode changes only MTP bytes and metadata: the main shards are the same files."""
    runs = [converted("qwen3_5_moe", m) for m in MODES]
    shards = [sorted(p.name for p in r.out.glob("model-*.safetensors")) for r in runs]
    assert all(s == shards[0] for s in shards) and len(shards[0]) > 1
    for name in shards[0]:
        digests = {_sha((r.out / name).read_bytes()) for r in runs}
        assert len(digests) == 1, name


# ---------------------------------------------------------------------------------------------------------
# extract


@pytest.mark.parametrize("family", FAMILIES)
def test_extract_directory(converted: Callable[[str, str], Run], family: str) -> None:
    run = converted(family, "extract")
    keep = converted(family, "keep")
    mtp_dir = run.out.with_name(run.out.name + "-mtp")
    assert run.result.mtp_output == mtp_dir
    assert sorted(p.name for p in mtp_dir.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors.index.json",
        "mtp-00001-of-00001.safetensors",
        "mtpquant_provenance.json",
    ]
    assert json.loads((mtp_dir / "config.json").read_text()) == json.loads((run.src / "config.json").read_text())
    index = json.loads((mtp_dir / "model.safetensors.index.json").read_text())
    src = Checkpoint.open(run.src)
    assert sorted(index["weight_map"]) == sorted(n for n in src.tensors if n.startswith("mtp."))
    readme = (mtp_dir / "README.md").read_text()
    assert "mtpquant graft" in readme and f"--from {mtp_dir.name}" in readme
    # The same MTP shard file keep mode writes: what graft needs to reproduce keep bit for bit.
    assert (mtp_dir / "mtp-00001-of-00001.safetensors").read_bytes() == (
        keep.out / "mtp-00001-of-00001.safetensors"
    ).read_bytes()
    assert not any(n.startswith("mtp.") for n in Checkpoint.open(run.out).tensors)


def test_extract_then_graft_equals_keep(converted: Callable[[str, str], Run], tmp_path: Path) -> None:
    from mtpquant.graft import run as graft_mod

    run, keep = converted("qwen3_5", "extract"), converted("qwen3_5", "keep")
    out = tmp_path / "grafted"
    graft_mod.graft(
        graft_mod.GraftOptions(
            quant=str(run.out), source=str(run.result.mtp_output), out=str(out), max_shard_bytes=10**6
        )
    )
    for p in sorted(keep.out.glob("*.safetensors")):
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    for name in ("config.json", "hf_quant_config.json", "model.safetensors.index.json"):
        assert json.loads((out / name).read_text()) == json.loads((keep.out / name).read_text()), name
    # the resolved recipe says what the output is now: keep (keep's own recipe body), and that the MTP was grafted
    recipe = (out / "mtpquant_recipe.yaml").read_text()
    assert recipe == textwrap.dedent(f"""\
        # Resolved recipe written by mtpquant {__version__} convert.
        # source: {run.src.name}
        # Reuse with: mtpquant convert SRC OUT --recipe mtpquant_recipe.yaml
        # MTP grafted from {run.out.name}-mtp by mtpquant {__version__} graft: mtp.mode was extract, now keep.
        schema: 1
        name: qwen3_5-nvfp4
        description: Qwen3.5/3.6 dense NVFP4 W4A4 with max calibration. lm_head, embeddings,
          linear-attention conv1d and in_proj_a/in_proj_b, the vision tower and the MTP stay
          BF16 (MTP per --mtp).
        families:
        - qwen3_5
        quantization:
          scheme: nvfp4
          targets: all
          algorithm: max
          group_size: 16
          exclude: []
        calibration:
          data: offline
          samples: 2
          seq_len: 32
          batch_size: 1
          chat_template: true
        mtp:
          mode: keep
          format: nvfp4
        output:
          max_shard_size: 1MB
        """)
    assert recipe.split("\nschema:", 1)[1] == (keep.out / "mtpquant_recipe.yaml").read_text().split("\nschema:", 1)[1]


# ---------------------------------------------------------------------------------------------------------
# quantize: the MTP tensors equal modelopt's own export of the same layer on the same activations


@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_mode_mtp_matches_modelopt_on_captured_activations(
    converted: Callable[[str, str], Run], family: str
) -> None:
    from tests.test_convert_mtp_quantize import modelopt_mtp_export

    run = converted(family, "quantize")
    assert len(run.activations) == 2  # one observation per calibration row, as convert fed the MTP
    src, out = Checkpoint.open(run.src), Checkpoint.open(run.out)
    weights = {n: src.read_tensor(n) for n in src.tensors if n.startswith("mtp.")}
    reference = modelopt_mtp_export(src.config, weights, run.activations, "nvfp4")
    mtp_out = {n for n in out.tensors if n.startswith("mtp.")}
    assert mtp_out == set(reference)
    for name in sorted(mtp_out):
        assert out.read_raw(out.tensors[name]) == _raw_bytes(reference[name]), name


def _raw_bytes(t: torch.Tensor) -> bytes:
    from mtpquant.checkpoint.dtypes import tensor_bytes

    return tensor_bytes(t)


def test_quantize_mode_fp8_is_mixed_precision(tiny_factory: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny_factory("qwen3_5")
    out = tmp_path / "fp8"
    result = convert(
        ConvertOptions(src=str(src), out=out, mtp="quantize", mtp_format="fp8", device="cpu", progress=False, **CALIB)
    )  # type: ignore[arg-type]
    ckpt = Checkpoint.open(out)
    assert ckpt.tensors["mtp.layers.0.self_attn.q_proj.weight"].dtype == "F8_E4M3"
    assert ckpt.tensors["mtp.layers.0.self_attn.q_proj.weight_scale"].shape == ()
    assert ckpt.tensors["mtp.fc.weight"].dtype == "BF16"
    hfq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hfq["quant_algo"] == "MIXED_PRECISION"
    layers = hfq["quantized_layers"]
    assert layers["mtp.layers.0.self_attn.q_proj"] == {"quant_algo": "FP8"}
    assert layers["model.language_model.layers.3.self_attn.q_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert "mtp.fc" not in layers
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == "MIXED_PRECISION"
    report = inspect_checkpoint(out)
    assert report.healthy, [f.message for f in report.failures]
    assert result.mode == "quantize"
    # modelopt_mixed listing mtp.* modules: SGLang builds the MTP with it, module by module (mtp.fc plain BF16)
    assert report.verdicts["sglang"] == (
        "SGLang: MTP loads (mixed: BF16, FP8; quantized_layers lists the MTP)"
    )
    assert "NEXTN" in report.serve_commands["sglang"]


# ---------------------------------------------------------------------------------------------------------
# result object, CLI


def test_result_summary(converted: Callable[[str, str], Run]) -> None:
    result = converted("qwen3_5", "keep").result
    assert {"load", "calibrate", "export", "write", "mtp", "verify", "total"} <= set(result.timings)
    # the time line's parts add up to its total: the imports are a part of their own, the rest is named "other"
    parts = {k: v for k, v in result.timings.items() if k != "total"}
    assert "imports" in parts and parts["other"] >= 0
    assert sum(parts.values()) == pytest.approx(result.timings["total"], abs=1e-6)
    assert result.peak_rss_bytes > 50 * 2**20
    assert result.calibration_rows == 2 and result.calibration_tokens == 64
    assert result.quantized_linears == 25 and result.unquantized_linears == 7
    assert 0 < result.output_bytes < result.plan.source_bytes
    text = convert_text(result)
    assert "MTP        15 tensors, BF16" in text and "peak RSS" in text
    data = json.loads(json.dumps(result.to_json()))
    assert data["mode"] == "keep" and data["tensor_counts"]["mtp"] == 15


def test_cli_dry_run_writes_nothing(
    tiny_factory: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mtpquant.cli import main

    out = tmp_path / "out"
    assert main(["convert", str(tiny_factory("qwen3_5_moe")), str(out), "--keep-mtp", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("dry run: nothing written")
    assert "keep: 29 MTP tensors copied byte for byte" in text
    assert "main       33 Linears -> NVFP4" in text
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert main(["convert", str(tiny_factory("qwen3_next")), str(out), "--mtp", "quantize", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mode"] == "quantize" and plan["mtp"]["tensors"] == 29 and plan["vision"]["tensors"] == 0
    assert list(tmp_path.iterdir()) == []


def test_hub_source_through_the_cli(
    local_hub: Any, tiny_factory: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SRC as a Hub repo id: the plan from ranged header reads, the conversion from a snapshot download."""
    from mtpquant.cli import main

    src = tiny_factory("qwen3_next")
    local_hub.create_repo("org/tiny-next", {p.name: p for p in src.iterdir() if p.is_file()})
    out = tmp_path / "out"
    dry = convert(ConvertOptions(src="org/tiny-next", out=out, dry_run=True, device="cpu"))
    assert dry.dry_run and dry.plan.src == "org/tiny-next" and dry.plan.mode == "keep" and not out.exists()
    capsys.readouterr()
    argv = ["convert", "org/tiny-next", str(out), "--keep-mtp", "--calib-samples", "2", "--calib-seq-len", "32"]
    assert main(["-q", *argv, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out} (") and "verdict    vLLM, SGLang, TensorRT-LLM: MTP loads (BF16)" in printed
    # the Hub's own .gitattributes came down with the snapshot but is not part of the checkpoint
    assert (local_hub.repo_dir("org/tiny-next") / ".gitattributes").is_file()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    ckpt = Checkpoint.open(out)
    src_ckpt = Checkpoint.open(src)
    for name in (n for n in src_ckpt.tensors if n.startswith("mtp.")):
        assert ckpt.read_raw(ckpt.tensors[name]) == src_ckpt.read_raw(src_ckpt.tensors[name])
    header = (out / "mtpquant_recipe.yaml").read_text().splitlines()[:4]
    assert header[1] == "# source: org/tiny-next"
    # the command line as given, in its order, less -q (it changes only what is printed); OUT by its base name: the
    # recipe goes public with OUT
    assert header[2] == f"# command: mtpquant {' '.join(argv[:2])} out {' '.join(argv[3:])} --device cpu"
    # the base model is recorded (a Hub SRC) and joins the card's metadata: the quant appears under its base model
    from mtpquant.publish.run import PublishOptions, publish

    card = publish(PublishOptions(out=out, repo="me/tiny-next-NVFP4", dry_run=True)).card
    meta = ModelCard(card).data.to_dict()
    assert (meta["base_model"], meta["base_model_relation"]) == ("org/tiny-next", "quantized")
    assert str(tmp_path) not in card


# ---------------------------------------------------------------------------------------------------------
# other recipes


def test_experts_only_recipe(tiny_factory: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "experts"
    convert(
        ConvertOptions(
            src=str(tiny_factory("qwen3_5_moe")),
            out=out,
            recipe="qwen3_5_moe-experts-nvfp4",
            device="cpu",
            progress=False,
            **CALIB,
        )  # type: ignore[arg-type]
    )
    ckpt = Checkpoint.open(out)
    quantized = {n[: -len(".weight_scale_2")] for n in ckpt.tensors if n.endswith(".weight_scale_2")}
    assert quantized and all(re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$", m) for m in quantized)
    assert len(quantized) == 4 * 4 * 3  # 4 layers x 4 experts x gate/up/down
    lm = "model.language_model.layers."
    assert ckpt.tensors[lm + "3.self_attn.q_proj.weight"].dtype == "BF16"
    assert ckpt.tensors[lm + "0.mlp.shared_expert.gate_proj.weight"].dtype == "BF16"
    assert ckpt.tensors[lm + "0.linear_attn.in_proj_qkv.weight"].dtype == "BF16"
    report = inspect_checkpoint(out)
    assert report.healthy, [f.message for f in report.failures]
    assert report.mtp_precision == "BF16"


def test_weight_only_recipe_with_quantized_mtp(tiny_factory: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "w4a16"
    convert(
        ConvertOptions(
            src=str(tiny_factory("qwen3_5")),
            out=out,
            recipe="nvfp4-w4a16",
            mtp="quantize",
            device="cpu",
            progress=False,
            **CALIB,
        )  # type: ignore[arg-type]
    )
    ckpt = Checkpoint.open(out)
    assert not any(n.endswith(".input_scale") for n in ckpt.tensors)  # W4A16: no activation scales anywhere
    assert ckpt.tensors["mtp.layers.0.mlp.down_proj.weight"].dtype == "U8"
    assert ckpt.tensors["model.language_model.layers.3.mlp.down_proj.weight"].dtype == "U8"
    hfq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hfq["quant_algo"] == "W4A16_NVFP4"
    assert [p for p in hfq["exclude_modules"] if p.startswith("mtp")] == ["mtp.fc"]
    report = inspect_checkpoint(out)
    assert report.healthy, [f.message for f in report.failures]
    # W4A16_NVFP4 is SGLang's modelopt_fp4 too ("NVFP4" in quant_algo): a BF16 MTP build, packed weights on disk
    assert report.verdicts["sglang"].startswith(
        "SGLang will fail to load the MTP (NEXTN): SGLang builds the MTP of a serialized modelopt_fp4 checkpoint"
    )
