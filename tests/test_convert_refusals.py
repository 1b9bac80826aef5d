"""convert refuses bad inputs early: one line on stderr, a meaningful exit code, nothing written."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from mtpquant.cli import main
from mtpquant.errors import ExitCode
from mtpquant.synth.tiny import TinySpec, make_tiny_checkpoint

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()  # drop what building the fixtures printed
    code = main(["convert", *argv])
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("mtpquant: error: ")
    return code, lines[0][len("mtpquant: error: ") :]


def _nothing_written(parent: Path, *keep: str) -> None:
    assert sorted(p.name for p in parent.iterdir()) == sorted(keep)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


def test_unsupported_architecture(tiny_copy: Factory, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_copy("qwen3_next")
    config = json.loads((src / "config.json").read_text())
    config["architectures"], config["model_type"] = ["LlamaForCausalLM"], "llama"
    (src / "config.json").write_text(json.dumps(config))
    code, msg = _run(capsys, str(src), str(work / "out"))
    assert code == 4
    assert msg == (
        "config.json: unsupported architecture LlamaForCausalLM; supported: BailingMoeV2_5ForCausalLM, "
        "BailingMoeV3ForCausalLM, BailingMoeV3VLForConditionalGeneration, DeepseekV32ForCausalLM, "
        "DeepseekV3ForCausalLM, DeepseekV41ForCausalLM, DeepseekV4ForCausalLM, "
        "DeepseekV4ForConditionalGeneration, Dots3NoteForCausalLM, Ernie4_5_MoeForCausalLM, "
        "Exaone4_5_ForConditionalGeneration, ExaoneMoEForCausalLM, ExaoneMoeForCausalLM, Gemma4ForCausalLM, "
        "Gemma4ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration, Glm4MoeForCausalLM, "
        "Glm4MoeLiteForCausalLM, Glm5NextForCausalLM, Glm5NextForConditionalGeneration, "
        "GlmMoeDsaForCausalLM, GlmOcrForConditionalGeneration, HYV3ForCausalLM, HYV4ForCausalLM, "
        "InklingForCausalLM, InklingForConditionalGeneration, InternS2MobiusForConditionalGeneration, "
        "InternS2PreviewForConditionalGeneration, KimiK3ForCausalLM, KimiK3ForConditionalGeneration, "
        "LongcatFlashForCausalLM, LongcatFlashNgramForCausalLM, MiMoForCausalLM, MiMoV2FlashForCausalLM, "
        "MiMoV2ForCausalLM, MiMoV2OmniForCausalLM, MiniMaxM2ForCausalLM, MiniMaxM3SparseForCausalLM, "
        "MiniMaxM3SparseForConditionalGeneration, NemotronHForCausalLM, NemotronHPuzzleForCausalLM, "
        "PanguUltraMoEForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, "
        "Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, "
        "Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, Step3p5ForCausalLM, "
        "Step3p7ForConditionalGeneration"
    )
    _nothing_written(work)


@pytest.mark.parametrize("mode", ["keep", "quantize", "extract"])
def test_mtp_mode_on_source_without_mtp(
    tmp_path: Path, work: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    src = make_tiny_checkpoint(tmp_path / "no-mtp", TinySpec("qwen3_5", mtp=False), tokenizer=False)
    code, msg = _run(capsys, str(src), str(work / "out"), "--mtp", mode)
    assert code == ExitCode.MTP_MODE
    assert msg == (
        f"{src}: has no MTP tensors (mtp.*), so --mtp {mode} has nothing to work on; use --mtp drop to convert "
        "without MTP, or add one with `mtpquant graft`"
    )
    _nothing_written(work)


def test_keep_mtp_flag_on_source_without_mtp(tmp_path: Path, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_tiny_checkpoint(tmp_path / "no-mtp", TinySpec("qwen3_5_moe", mtp=False), tokenizer=False)
    code, msg = _run(capsys, str(src), str(work / "out"), "--keep-mtp")
    assert code == ExitCode.MTP_MODE
    assert "--mtp keep has nothing to work on; use --mtp drop" in msg and "mtpquant graft" in msg
    _nothing_written(work)


def test_default_mode_without_mtp_is_drop(tmp_path: Path, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_tiny_checkpoint(tmp_path / "no-mtp", TinySpec("qwen3_5", mtp=False), tokenizer=False)
    capsys.readouterr()
    assert main(["convert", str(src), str(work / "out"), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mode"] == "drop"
    _nothing_written(work)


def test_incomplete_mtp(tiny_copy: Factory, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_copy("qwen3_5")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    victim = "mtp.layers.0.self_attn.k_proj.weight"
    shard = src / index["weight_map"].pop(victim)
    tensors = load_file(shard)
    del tensors[victim]
    save_file(tensors, shard, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index["weight_map"]}))
    code, msg = _run(capsys, str(src), str(work / "out"), "--mtp", "keep")
    assert code == ExitCode.MTP_MODE
    assert msg == (
        f"{src}: MTP incomplete, 1 of 15 expected tensors missing (first: {victim}); use --mtp drop, or repair "
        "the source with `mtpquant graft`"
    )
    _nothing_written(work)


def test_output_exists(tiny_factory: Factory, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = work / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    code, msg = _run(capsys, str(tiny_factory("qwen3_5")), str(out))
    assert code == 5  # not "use --overwrite": --overwrite would refuse a folder mtpquant did not write
    assert msg == (
        f"{out}: not a checkpoint mtpquant wrote (no readable mtpquant_provenance.json; it holds 1 entry: keep.txt); "
        "not replacing it (--overwrite replaces only a checkpoint mtpquant wrote): remove it yourself or choose "
        "another output"
    )
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    _nothing_written(work, "out")
    (out / "keep.txt").unlink()  # an empty folder is one --overwrite replaces
    code, msg = _run(capsys, str(tiny_factory("qwen3_5")), str(out))
    assert (code, msg) == (5, f"{out}: output already exists (use --overwrite to replace it)")


def test_extract_mtp_out_exists(tiny_factory: Factory, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (work / "out-mtp").mkdir()
    code, msg = _run(capsys, str(tiny_factory("qwen3_5")), str(work / "out"), "--mtp", "extract")
    assert code == 5 and msg == f"{work / 'out-mtp'}: output already exists (use --overwrite to replace it)"
    _nothing_written(work, "out-mtp")


def test_output_is_source_even_with_overwrite(tiny_copy: Factory, capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_copy("qwen3_5")
    before = sorted(p.name for p in src.iterdir())
    code, msg = _run(capsys, str(src), str(src), "--overwrite")
    assert code == 5 and msg == f"{src}: OUT must not be the source directory, inside it, or contain it"
    assert sorted(p.name for p in src.iterdir()) == before


def test_dimension_not_divisible_by_16(tmp_path: Path, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_tiny_checkpoint(tmp_path / "h120", TinySpec("qwen3_5", hidden_size=120), tokenizer=False)
    code, msg = _run(capsys, str(src), str(work / "out"))
    assert code == 7
    module = "model.language_model.layers.0.linear_attn.in_proj_qkv"
    assert msg == (
        f"{module}: input dimension 120 is not a multiple of 16 (the NVFP4 block size); keep it in BF16 with "
        f"--set 'quantization.exclude=[\"{module}\"]' or use another recipe"
    )
    _nothing_written(work)


def test_already_quantized_source(tiny_copy: Factory, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_copy("qwen3_next")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": []}
    (src / "config.json").write_text(json.dumps(config))
    code, msg = _run(capsys, str(src), str(work / "out"))
    assert code == ExitCode.SOURCE_QUANTIZED
    assert msg == (
        f"{src}: already quantized (modelopt NVFP4); convert needs the BF16 checkpoint (to add a missing MTP to an "
        "existing quant, use `mtpquant graft`)"
    )
    _nothing_written(work)


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (
            ["--recipe", "nope"],
            2,
            "unknown recipe 'nope'; built-in recipes: deepseek_v3-nvfp4, deepseek_v32-nvfp4, glm4_moe-nvfp4, "
            "glm_moe_dsa-nvfp4, mimo_v2_flash-nvfp4, nemotron_h-nvfp4, nvfp4-w4a16, qwen3_5-nvfp4, "
            "qwen3_5_moe-experts-nvfp4, qwen3_5_moe-nvfp4, qwen3_next-nvfp4, qwen4_exp-nvfp4, step3p5-nvfp4",
        ),
        (
            ["--recipe", "qwen3_5_moe-nvfp4"],
            2,
            "recipe 'qwen3_5_moe-nvfp4' is for qwen3_5_moe, but the source is qwen3_5 (use --recipe qwen3_5-nvfp4)",
        ),
        (["--set", "calibration.bogus=1"], 2, "--set calibration.bogus: unknown key 'calibration.bogus'"),
        (
            ["--set", "calibration.samples=0"],
            2,
            "mtpquant/recipes/qwen3_5-nvfp4.yaml + --set: calibration.samples: input should be greater than 0, got 0",
        ),
        (["--calib-data", "missing.jsonl"], 2, "missing.jsonl: calibration data file does not exist"),
        (
            ["--max-shard-size", "lots"],
            2,
            "--max-shard-size: 'lots' is not a size (for example 5GB, 500MiB or a byte count)",
        ),
        (["--mtp-out", "elsewhere"], 2, "--mtp-out is only used with --mtp extract (mode is keep)"),
        (["--keep-mtp", "--mtp", "drop"], 2, "--keep-mtp contradicts --mtp drop"),
        # flags that would be ignored are refused
        (["--keep-mtp", "--mtp-format", "fp8"], 2, "--mtp-format is only used with --mtp quantize (mode is keep)"),
        (["--revision", "v2"], 2, "{src}: a local directory has no revisions (a revision applies to a Hub repo id)"),
        (["--heal-steps", "5"], 2, "--heal-steps is only used with --heal"),
        (["--heal-force"], 2, "--heal-force is only used with --heal"),
    ],
)
def test_bad_options(
    tiny_factory: Factory, work: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str
) -> None:
    src = str(tiny_factory("qwen3_5"))
    got_code, msg = _run(capsys, src, str(work / "out"), *argv)
    assert (got_code, msg) == (code, message.format(src=src))
    _nothing_written(work)


def test_recipe_file_with_unknown_key(
    tiny_factory: Factory, work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("name: mine\nquantization:\n  scheme: nvfp4\n  calibrate: max\n")
    code, msg = _run(capsys, str(tiny_factory("qwen3_5")), str(work / "out"), "--recipe", str(recipe))
    assert code == 2
    assert msg == (
        f"{recipe}: unknown key 'quantization.calibrate' (allowed: quantization.scheme, quantization.targets, "
        "quantization.algorithm, quantization.group_size, quantization.exclude)"
    )
    _nothing_written(work)


@pytest.mark.parametrize(
    ("family", "kept"),
    [
        ("qwen3_5", "mtp.fc, mlp.gate, mlp.shared_expert_gate stay BF16"),
        ("glm4_moe", "eh_proj, mlp.gate, norm, shared_head.head stay BF16"),
    ],
)
def test_the_quantize_plan_line_names_the_familys_bf16_modules(
    family: str, kept: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dry run's mode line reads the registry's list of MTP modules kept BF16 (it named Qwen's for every family)."""
    src = make_tiny_checkpoint(tmp_path / "src", TinySpec(family))
    assert main(["convert", str(src), str(tmp_path / "out"), "--mtp", "quantize", "--dry-run"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("mode ")]
    assert f"with calibrated input scales; {kept} (excluded by name)." in line
    assert not (tmp_path / "out").exists()
