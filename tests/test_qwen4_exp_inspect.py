"""inspect, graft, extract and --fix-metadata on the published Qwen3.8-Flash-Next (qwen4_exp) quant layouts.

Every expected verdict is derived from vLLM 0.32's loader code (quantization/modelopt.py: the MIXED_PRECISION
per-layer algo resolution and the MoE method each algo selects; fp8.py: the block method's weight_scale_inv;
fused_moe/routed_experts.py: the load error naming the missing parameter; models/qwen4_exp/nvidia/mtp.py: the
MTP layer-index remap; models/qwen4_exp/common/ngram_embedding.py: the n-gram table rule) and SGLang 0.5.23's
(models/qwen3_5_mtp.py _mtp_quant_config), not from mtpquant's own output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode
from mtpquant.graft.run import GraftOptions, fix_metadata, graft
from tests.support.hubserver import LocalHub
from tests.support.qwen4_exp_quants import make_qwen4_exp_quant

pytestmark = pytest.mark.dev

ALIAS = (
    "the day-0 label Qwen3_8FlashNextForConditionalGeneration (architectures[0]) is unknown to vLLM 0.32 and "
    "SGLang 0.5.23 (the weights are Qwen4ExpForConditionalGeneration's): relabel with `mtpquant graft QUANT "
    "--fix-metadata --out FIXED`"
)
# kind -> (exit code, vLLM verdict, SGLang verdict)
EXPECTED = {
    "nvidia-mixed": (
        0,
        "vLLM: MTP loads (mixed: BF16, FP8-block)",
        "SGLang: MTP loads (mixed: BF16, FP8-block; quantized_layers lists the MTP)",
    ),
    # vLLM keeps FP8_BLOCK_SCALES as an alias of FP8_PB_WO for routed experts (_BLOCK_FP8_MOE_ALGOS)
    "nvidia-mixed-old-label": (
        0,
        "vLLM: MTP loads (mixed: BF16, FP8-block)",
        "SGLang: MTP loads (mixed: BF16, FP8-block; quantized_layers lists the MTP)",
    ),
    # FP8 selects ModelOptFp8MoEMethod (w13/w2_weight_scale), which has no parameter for weight_scale_inv
    "nvidia-mixed-refreshed": (
        11,
        "vLLM will fail to load: mtp.layers.0.mlp.experts is FP8-block on disk but vLLM loads it as FP8 "
        "(quantized_layers: FP8)",
        "SGLang will fail to load: mtp.layers.0.mlp.experts is FP8-block on disk but SGLang resolves "
        "quantized_layers: FP8",
    ),
    # mtp.layers.4.* keys become mtp.layers.8.* after vLLM's own remap: nothing resolves, experts unquantized
    "nvidia-mixed-engine-index": (
        11,
        "vLLM will fail to load: mtp.layers.0.mlp.experts is FP8-block on disk but excluded from quantization",
        "SGLang will fail to load: mtp.layers.0.mlp.experts is FP8-block on disk but SGLang resolves absent from "
        "quantized_layers",
    ),
    "nvfp4-mtp-dropped": (
        10,
        "vLLM: MTP declared but missing: speculative decoding will accept nothing",
        "SGLang: MTP declared but missing: speculative decoding will accept nothing",
    ),
    "nvfp4-mtp-excluded": (0, "vLLM: MTP loads (BF16)", "SGLang: MTP loads (BF16)"),
    # no mtp.fc-style workaround for Qwen4-Exp: fc_embedding is built with the NVFP4 config
    "nvfp4-mtp-partly-excluded": (
        11,
        "vLLM will fail to load: mtp.fc_embedding is BF16 on disk but declared quantized",
        "SGLang: MTP loads (BF16)",
    ),
    "alias": (20, f"vLLM will fail to load: {ALIAS}", f"SGLang will fail to load: {ALIAS}"),
}
REFRESHED_FAILURE = (
    "vLLM will fail to load: mtp.layers.0.mlp.experts is FP8-block on disk but quantized_layers: FP8 selects "
    "ModelOptFp8MoEMethod, which loads FP8 (vLLM: Layer mtp.layers.4.mlp.experts has no parameter "
    "'w2_weight_scale_inv')"
)
NGRAM_REFUSAL = (
    "vLLM will fail to load: model.language_model.layers.0.ple.ple_embedding.ngram_embedding is not excluded, and "
    "vLLM's PLE n-gram table raises NotImplementedError: Qwen4Exp PLE embedding does not support quantization "
    "config ModelOptNvFp4Config"
)


@pytest.fixture(scope="module")
def quants(tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("q4quants")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_qwen4_exp_quant(tiny_factory("qwen4_exp"), root / kind, kind)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_published_layouts_get_vllms_verdict(quants: Callable[[str], Path], kind: str) -> None:
    code, vllm, sglang = EXPECTED[kind]
    report = inspect_checkpoint(quants(kind))
    assert (report.exit_code(), report.verdicts["vllm"], report.verdicts["sglang"]) == (code, vllm, sglang)
    assert report.family == "Qwen3.8-Flash-Next (Qwen4-Exp)"


def test_nvidia_quant_precision_per_mtp_module(quants: Callable[[str], Path]) -> None:
    report = inspect_checkpoint(quants("nvidia-mixed"))
    mods = {m.module: m for m in report.mtp_modules}
    experts = mods["mtp.layers.0.mlp.experts"]
    assert (experts.disk, experts.vllm_quantized, experts.expects, experts.reason) == (
        "FP8-block",
        True,
        "FP8-block",
        "quantized_layers: FP8_PB_WO",
    )
    assert (mods["mtp.fc_embedding"].disk, mods["mtp.fc_embedding"].vllm_quantized) == ("BF16", False)
    assert mods["mtp.layers.0.self_attn.qkv_proj"].members == [
        "mtp.layers.0.self_attn.indexer.index_qk_proj",
        "mtp.layers.0.self_attn.k_proj",
        "mtp.layers.0.self_attn.q_proj",
        "mtp.layers.0.self_attn.v_proj",
    ]
    assert report.main_model.precisions == {"BF16": 69, "FP8": 4, "NVFP4": 48}  # 4 FP8 n-gram shards
    assert report.quantization.algorithm == "MIXED_PRECISION"


def test_refreshed_quant_names_the_missing_parameter(quants: Callable[[str], Path]) -> None:
    report = inspect_checkpoint(quants("nvidia-mixed-refreshed"))
    assert [f.message for f in report.failures] == [REFRESHED_FAILURE]


def test_ngram_table_and_fc_exclusions(quants: Callable[[str], Path]) -> None:
    report = inspect_checkpoint(quants("nvfp4-mtp-partly-excluded"))
    assert [f.message for f in report.failures] == [
        "vLLM will fail to load: mtp.fc_embedding is BF16 on disk but declared quantized",
        "vLLM will fail to load: mtp.fc_hidden is BF16 on disk but declared quantized",
        NGRAM_REFUSAL,
    ]


@pytest.mark.parametrize(
    ("kind", "changes"),
    [
        (
            "nvidia-mixed-refreshed",
            [
                "hf_quant_config.json: quantized_layers: mtp.layers.0.mlp.experts (12 entries) FP8 -> FP8_PB_WO "
                "(weight_scale_inv on disk)",
                "config.json: quantized_layers: mtp.layers.0.mlp.experts (12 entries) FP8 -> FP8_PB_WO "
                "(weight_scale_inv on disk)",
            ],
        ),
        (
            "nvidia-mixed-engine-index",
            [
                f"{f}: quantized_layers: 12 MTP entries renamed from the engine's layer index mtp.layers.4+i to the "
                "checkpoint's mtp.layers.i (vLLM adds num_hidden_layers itself)"
                for f in ("hf_quant_config.json", "config.json")
            ],
        ),
        (
            "nvfp4-mtp-partly-excluded",
            [
                "hf_quant_config.json: exclude_modules += model.language_model.layers.0.ple.ple_embedding."
                "ngram_embedding (vLLM raises on an n-gram table it would quantize)",
                "config.json: ignore += model.language_model.layers.0.ple.ple_embedding.ngram_embedding (vLLM raises "
                "on an n-gram table it would quantize)",
                "hf_quant_config.json: exclude_modules += mtp*",
                "config.json: ignore += mtp*",
            ],
        ),
        (
            "alias",
            [
                "config.json: architectures[0] Qwen3_8FlashNextForConditionalGeneration -> "
                "Qwen4ExpForConditionalGeneration (the day-0 label engines do not know)",
                "config.json: model_type qwen3_8_flash_next -> qwen4_exp (the day-0 label engines do not know)",
                "config.json: text_config.model_type qwen3_8_flash_next_text -> qwen4_exp_text (the day-0 label "
                "engines do not know)",
            ],
        ),
    ],
)
def test_fix_metadata_repairs_each_in_one_line(
    quants: Callable[[str], Path], tmp_path: Path, kind: str, changes: list[str]
) -> None:
    out = tmp_path / "fixed"
    result = fix_metadata(quants(kind), out=out)
    assert result.action == "metadata" and result.metadata_changes == changes
    report = inspect_checkpoint(out)
    assert report.healthy and report.exit_code() == 0
    assert report.verdicts["vllm"].startswith("vLLM: MTP loads")
    # tensor files are hard links of QUANT's, untouched
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (out / shard).stat().st_ino == (quants(kind) / shard).stat().st_ino


def test_healthy_quants_need_no_repair(quants: Callable[[str], Path], tmp_path: Path) -> None:
    for kind in ("nvidia-mixed", "nvidia-mixed-old-label", "nvfp4-mtp-excluded"):
        assert fix_metadata(quants(kind), out=tmp_path / kind).action == "noop"


def test_graft_puts_the_lost_mtp_back(
    quants: Callable[[str], Path], tiny_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_factory("qwen4_exp")
    out = tmp_path / "grafted"
    result = graft(GraftOptions(quant=quants("nvfp4-mtp-dropped"), source=src, out=out))
    assert result.action == "grafted" and result.mtp_tensors == 31
    report = inspect_checkpoint(out)
    assert report.healthy and report.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    grafted, source = Checkpoint.open(out), Checkpoint.open(src)
    for e in grafted.mtp_tensors():  # the MTP bytes are SRC's
        assert grafted.read_raw(e) == source.read_raw(source.tensors[e.name])
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"][-1] == "mtp*"


def test_extract_then_graft_round_trip(
    quants: Callable[[str], Path], tiny_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    """The MTP of a quant extracted to a sidecar (as convert --mtp extract writes it) grafts back byte for byte."""
    from mtpquant.checkpoint.writer import OutputDir
    from mtpquant.surgery.modes import MODES, WriteContext

    src = Checkpoint.open(tiny_factory("qwen4_exp"))
    side = tmp_path / "side"
    with OutputDir(tmp_path / "main-out") as od, OutputDir(side) as mtp_od:
        MODES["extract"].write(WriteContext(od, src, 5 * 10**9, mtp_od=mtp_od, out_name="q"))
        mtp_od.finalize()
    sidecar = inspect_checkpoint(side)
    assert sidecar.kind == "mtp-only" and sidecar.mtp_present_tensors == 31 and sidecar.healthy
    out = tmp_path / "back"
    graft(GraftOptions(quant=quants("nvfp4-mtp-dropped"), source=side, out=out))
    back = Checkpoint.open(out)
    assert {e.name for e in back.mtp_tensors()} == {e.name for e in src.mtp_tensors()}
    assert all(back.read_raw(e) == src.read_raw(src.tensors[e.name]) for e in back.mtp_tensors())


def test_alias_is_refused_with_the_format_code(quants: Callable[[str], Path]) -> None:
    report = inspect_checkpoint(quants("alias"))
    assert report.exit_code() == int(ExitCode.INSPECT_FORMAT)
    assert report.architecture == "Qwen3_8FlashNextForConditionalGeneration"


def test_hub_repo_gets_the_same_verdict_from_headers(quants: Callable[[str], Path], local_hub: LocalHub) -> None:
    path = quants("nvidia-mixed-refreshed")
    local_hub.create_repo(
        "nvidia/q4-refreshed", {p.relative_to(path).as_posix(): p for p in path.rglob("*") if p.is_file()}
    )
    remote = inspect_checkpoint("nvidia/q4-refreshed")
    local = inspect_checkpoint(path)
    assert (remote.verdicts, remote.exit_code()) == (local.verdicts, 11)
    assert [f.message for f in remote.failures] == [REFRESHED_FAILURE]
    resolves = [r for r in local_hub.requests if r.kind == "resolve" and r.filename.endswith(".safetensors")]
    assert resolves and all(r.range for r in resolves)  # headers only: ranged reads, never a whole shard
