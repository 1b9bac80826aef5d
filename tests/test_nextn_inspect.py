"""inspect on the families beyond Qwen: the full-size releases (header-only skeletons: DeepSeek-V3's 91,991 tensors,
NVIDIA's DeepSeek-R1 FP4, GLM-4.5) and the published quant layouts, each verdict derived from the engines' code
(vLLM 0.32 and SGLang: the file and the rule are named at each case), locally and from the Hub (headers only)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode
from tests.support.hubserver import LocalHub
from tests.support.nextn_quants import make_nextn_quant
from tests.support.nextn_skeleton import make_nextn_skeleton

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


@pytest.fixture(scope="module")
def skeletons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Factory]:
    root = tmp_path_factory.mktemp("nextn-skeletons")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_nextn_skeleton(kind, root / kind)
        return made[kind]

    yield get


@pytest.fixture(scope="module")
def quants(tmp_path_factory: pytest.TempPathFactory, tiny_factory: Factory) -> Iterator[Factory]:
    root = tmp_path_factory.mktemp("nextn-quants")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_nextn_quant(kind, root / kind, tiny_factory("glm4_moe"))
        return made[kind]

    yield get


@pytest.mark.slow
def test_deepseek_v3_release_skeleton(skeletons: Factory) -> None:
    """The FP8 release: 163 shards, the MTP alone in the last. vLLM's Fp8Config quantizes Linear layers and routed
    experts (quantization/fp8.py get_quant_method): the MTP's block is FP8, eh_proj a plain nn.Linear
    (deepseek_mtp.py 84), the head a ParallelLMHead left unquantized: the MTP loads as stored."""
    r = inspect_checkpoint(skeletons("deepseek-v3-fp8"))
    assert (r.index.tensors, r.index.shards) == (91_991, 163)
    assert (r.mtp_expected_tensors, r.mtp_present_tensors) == (788, 1564)  # 776 weight_scale_inv beside them
    assert r.mtp_shards == ["model-00163-of-000163.safetensors"]
    disk = {m.module: m.disk for m in r.mtp_modules}
    assert disk["model.layers.61.eh_proj"] == "BF16" and disk["model.layers.61.mlp.experts"] == "FP8-block"
    assert disk["model.layers.61.shared_head.head"] == "BF16" and all(m.consistent for m in r.mtp_modules)
    assert r.verdicts["vllm"] == "vLLM: MTP loads (mixed: BF16, FP8-block)"
    assert r.healthy and r.exit_code(strict=True) == 0


@pytest.mark.slow
def test_nvidia_deepseek_fp4_keeps_the_mtp_bf16_and_excluded(skeletons: Factory) -> None:
    """nvidia/DeepSeek-R1-FP4: model.layers.61* excluded (ModelOpt examples/deepseek/ptq.py); vLLM matches it by
    substring against every MTP module, the head's model.layers.61.head included; SGLang's DeepseekV3ForCausalLMNextN
    drops the quant config for modelopt_fp4 (deepseek_nextn.py): the whole draft BF16, as on disk."""
    r = inspect_checkpoint(skeletons("deepseek-r1-nvfp4"))
    assert "model.layers.61*" in r.quantization.exclude and r.mtp_precision == "BF16"
    assert r.verdicts == {
        "vllm": "vLLM: MTP loads (BF16)",
        "sglang": "SGLang: MTP loads (BF16)",
        "trtllm": "TensorRT-LLM: MTP loads (BF16)",  # DeepseekV3MTP: model.layers.61 excluded, the layer whole
    }
    assert r.healthy and r.exit_code(strict=True) == 0 and r.fixes == []


@pytest.mark.slow
def test_glm45_release_skeleton(skeletons: Factory) -> None:
    r = inspect_checkpoint(skeletons("glm-4.5"))
    assert (r.index.tensors, r.mtp_present_tensors, r.mtp_expected_tensors) == (44_691, 502, 502)
    assert r.drafters["vllm"] == "Glm4MoeMTPModel" and r.healthy


_LOST = (
    "vLLM: MTP declared but missing: speculative decoding will accept nothing; vLLM will fail to load: "
    "ValueError: MTP speculative decoding layer 2 weights missing from checkpoint"  # deepseek_mtp.py 520-533
)


def test_deepseek_quant_that_lost_its_mtp(quants: Factory) -> None:
    r = inspect_checkpoint(quants("deepseek-mtp-lost"))
    assert r.verdicts["vllm"] == _LOST and r.exit_code() == ExitCode.INSPECT_MTP
    name = "deepseek-mtp-lost"
    assert [f.split("   (")[0] for f in r.fixes] == [
        f"mtpquant graft {r.checkpoint} --from SRC --out {name}-mtp",
        f"mtpquant graft {r.checkpoint} --fix-metadata --out {name}-no-mtp",
    ]


def test_quantized_eh_proj_fails_in_both_engines(quants: Factory) -> None:
    """eh_proj is a plain nn.Linear in vLLM's DeepSeek MTP (never quantized: vllm#35041 closed) and a plain Linear in
    SGLang's NextN (sglang_plain): an NVFP4 eh_proj loads in neither; only a BF16 MTP from the source repairs it."""
    r = inspect_checkpoint(quants("deepseek-eh-proj-nvfp4"))
    assert r.verdicts["vllm"] == (
        "vLLM will fail to load: model.layers.2.eh_proj is NVFP4 on disk but vLLM builds it without a quantization "
        "config"
    )
    assert r.verdicts["sglang"].startswith(
        "SGLang will fail to load the MTP (NEXTN): SGLang builds model.layers.2.eh_proj as a plain Linear"
    )
    assert r.exit_code() == ExitCode.INSPECT_EXCLUSIONS
    assert [f.split("   (")[0] for f in r.fixes] == [
        f"mtpquant graft {r.checkpoint} --from SRC --replace --out deepseek-eh-proj-nvfp4-mtp"
    ]


def test_nvfp4_mtp_head_excluded_under_the_checkpoints_name(quants: Factory) -> None:
    """ModelOpt's summary excludes model.layers.2.shared_head.head; vLLM's SharedHead builds model.layers.2.head
    (deepseek_mtp.py SharedHead: prefix=maybe_prefix(layer, "head")), quantized (modelopt.py get_quant_method: a
    ParallelLMHead not excluded): BF16 weights into an NVFP4 head. SGLang builds the draft BF16 for modelopt_fp4
    (deepseek_nextn.py): the packed NVFP4 experts do not fit."""
    r = inspect_checkpoint(quants("deepseek-mtp-nvfp4"))
    assert r.verdicts["vllm"] == (
        "vLLM will fail to load: model.layers.2.shared_head.head is BF16 on disk and excluded as "
        "model.layers.2.shared_head.head, but vLLM's draft builds it as model.layers.2.head"
    )
    assert r.verdicts["sglang"] == (
        "SGLang will fail to load the MTP (NEXTN): SGLang builds the MTP of a serialized modelopt_fp4 checkpoint in "
        "BF16, and the packed NVFP4 weight of model.layers.2.mlp.experts does not fit a BF16 module; serve without "
        "speculative decoding, or with vLLM"
    )
    assert r.fixes == [f"mtpquant graft {r.checkpoint} --fix-metadata --out deepseek-mtp-nvfp4-fixed"]


def test_glm5_next_quant_excluding_one_prefix_form(quants: Factory) -> None:
    """nvidia/GLM-5.3-Flash-NVFP4: model.language_model.layers.N* excluded, but vLLM's Glm5NextMTP strips the prefix
    and builds model.layers.N.* (glm5next/common/mtp.py 332-337): every MTP block module is built NVFP4 over BF16."""
    r = inspect_checkpoint(quants("glm5-next-one-prefix"))
    assert r.failure_messages == [
        "vLLM will fail to load: the exclusions cover the unquantized MTP only under the checkpoint's names "
        "(model.language_model.layers.2.mlp.experts), but vLLM's draft builds it as model.layers.2.mlp.experts, which "
        "they do not match: 10 modules built quantized over unquantized weights"
    ]
    assert r.verdicts["sglang"] == "SGLang: has no MTP drafter for GLM-5.3-Flash (SGLang 0.5.23)"
    assert r.fixes == [f"mtpquant graft {r.checkpoint} --fix-metadata --out glm5-next-one-prefix-fixed"]


def test_step_quant_declaring_layers_it_did_not_ship(quants: Factory) -> None:
    """Step-3.7-Flash-NVFP4 declared 3 MTP layers and shipped none; vLLM's Step3p5MTP checks every parameter
    (step3p5_mtp.py 300-320)."""
    r = inspect_checkpoint(quants("step-not-shipped"))
    assert r.mtp_declaration == "num_nextn_predict_layers = 3" and r.mtp_present_tensors == 0
    assert r.verdicts["vllm"].endswith(
        "vLLM will fail to load: RuntimeError: Some parameters like model.layers.2... are not in the checkpoint and "
        "will falsely use random initialization"
    )
    assert len(r.fixes) == 2 and "--fix-metadata --out step-not-shipped-no-mtp" in r.fixes[1]
    source = inspect_checkpoint(quants("step-bf16"))
    assert source.healthy and (source.mtp_layers_present, source.mtp_present_tensors) == (3, 84)


def test_glm47_mtp_file_missing_from_the_index(quants: Factory) -> None:
    """A ModelOpt GLM-4.7 export that left mtp.safetensors out of the index: vLLM reads only indexed shards
    (weight_utils.filter_duplicate_safetensors_files); Glm4MoeMTP has no completeness check, so an unquantized model
    stops at DefaultModelLoader's weight tracking."""
    r = inspect_checkpoint(quants("glm47-mtp-unindexed"))
    assert r.exit_code() == ExitCode.INSPECT_INDEX
    assert r.failure_messages[0] == (
        "mtp.safetensors holds 32 MTP tensors but model.safetensors.index.json does not list it: loaders read only the "
        "shards the index names (vLLM's filter_duplicate_safetensors_files), so engines see no MTP"
    )
    assert r.verdicts["vllm"].endswith("ValueError: Following weights were not initialized from checkpoint")
    assert r.fixes == [f"mtpquant graft {r.checkpoint} --fix-metadata --out glm47-mtp-unindexed-fixed"]


def test_hub_repo_gets_the_same_verdict_from_headers(quants: Factory, local_hub: LocalHub) -> None:
    path = quants("glm5-next-one-prefix")
    files = {p.relative_to(path).as_posix(): p for p in path.rglob("*") if p.is_file()}
    local_hub.create_repo("nvidia/glm5-next-q", files)
    remote, local = inspect_checkpoint("nvidia/glm5-next-q"), inspect_checkpoint(path)
    assert (remote.verdicts, remote.failure_messages, remote.exit_code()) == (
        local.verdicts, local.failure_messages, ExitCode.INSPECT_EXCLUSIONS
    )
    resolves = [r for r in local_hub.requests if r.kind == "resolve" and r.filename.endswith(".safetensors")]
    assert resolves and all(r.range for r in resolves)  # headers only: ranged reads, never a whole shard
