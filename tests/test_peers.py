"""Quants made by other tools (committed fixtures, tests/fixtures/peers): inspect, validate and graft on them.

Made by ``scripts/make_peer_fixtures.py`` with the peers' own releases (manifest.json records the versions):
llm-compressor NVFP4 (keeps the MTP itself, ``re:^mtp.*``), AutoRound NVFP4 in the ``llm_compressor`` format
(copies the MTP back but leaves ``ignore: [lm_head]``) and in its own ``auto_round`` format, and a modelopt
export made the way ModelOpt's hf_ptq example keeps the MTP. What vLLM itself does with each is checked in
``tests/test_engine_peers.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.api import GraftOptions, graft, inspect_checkpoint
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.diagnose.report import EXIT_EXCLUSIONS, EXIT_FORMAT
from mtpquant.synth.train import TINY_MTP_ASSET
from tests.conftest import PEER_FIXTURES

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]

LOADS = "vLLM: MTP loads (BF16)"
AR_FORMAT = (
    "vLLM will fail to load: vLLM 0.32 does not support auto-round data_type 'nv_fp' (INC supports int, fp, mx_fp): "
    "the checkpoint will not load"
)


def _bf16(module: str, on_disk: str = "BF16") -> str:
    return f"vLLM will fail to load: {module} is {on_disk} on disk but declared quantized"


# fixture -> (vLLM verdict, failures, total_size the peer declared (None: right), tensor bytes)
EXPECTED: dict[str, tuple[str, list[str], object, int]] = {
    "llmcompressor-nvfp4-dense": (LOADS, [], 3145344, 3123056),
    "llmcompressor-nvfp4-moe": (LOADS, [], 2289360, 2238960),
    "autoround-nvfp4-llmc-dense": (
        _bf16("mtp.fc"),
        [
            _bf16("mtp.fc"),
            _bf16("mtp.layers.0.mlp.down_proj"),
            _bf16("mtp.layers.0.mlp.gate_up_proj"),
            _bf16("mtp.layers.0.self_attn.qkv_proj"),
            _bf16("mtp.layers.0.self_attn.o_proj"),
        ],
        0,
        3123056,
    ),
    "autoround-nvfp4-llmc-moe": (
        _bf16("mtp.fc"),
        [
            _bf16("mtp.fc"),
            _bf16("mtp.layers.0.mlp.experts"),
            _bf16("mtp.layers.0.mlp.shared_expert.down_proj"),
            _bf16("mtp.layers.0.mlp.shared_expert.gate_up_proj"),
            _bf16("mtp.layers.0.self_attn.qkv_proj"),
            _bf16("mtp.layers.0.self_attn.o_proj"),
            *(
                f"vLLM will fail to load: model.language_model.layers.{i}.mlp.shared_expert_gate is NVFP4-CT on disk "
                "but vLLM builds it without a quantization config"
                for i in range(3)
            ),
            "... and 1 more main-model modules whose metadata disagrees with the tensors",
        ],
        0,
        2238256,
    ),
    "autoround-nvfp4-native-dense": (AR_FORMAT, [AR_FORMAT], 0, 3123056),
    "modelopt-hfptq-dense": (LOADS, [], None, 0),
    "modelopt-hfptq-moe": (LOADS, [], None, 0),
}


def test_every_committed_fixture_is_covered() -> None:
    manifest = json.loads((PEER_FIXTURES / "manifest.json").read_text())
    assert sorted(manifest) == sorted(EXPECTED) == sorted(p.name for p in PEER_FIXTURES.iterdir() if p.is_dir())
    assert {m["versions"].get("llmcompressor") for n, m in manifest.items() if not n.startswith("modelopt")} == {
        "0.14.0.1"
    }


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_inspect_verdict(peer_quant: Factory, name: str) -> None:
    vllm, failures, declared, actual = EXPECTED[name]
    r = inspect_checkpoint(peer_quant(name))
    assert r.verdicts["vllm"] == vllm
    assert [f.message for f in r.failures] == failures
    assert r.mtp_present_tensors == r.mtp_expected_tensors and r.mtp_precision == "BF16"
    assert r.index.intact and r.index.problems == []  # never "corrupt" over an advisory field
    advisory = (
        []
        if declared is None
        else [
            f"{INDEX_NAME}: metadata.total_size is {declared!r} but the tensors hold {actual} bytes "
            "(advisory: no loader reads it)"
        ]
    )
    assert r.index.warnings == advisory
    assert [f.message for f in r.warnings] == advisory
    expected_code = 0 if not failures else (EXIT_FORMAT if vllm == AR_FORMAT else EXIT_EXCLUSIONS)
    assert r.exit_code() == expected_code


def _source(name: str, tiny_factory: Factory) -> Path:
    return TINY_MTP_ASSET if name.endswith("-dense") else tiny_factory("qwen3_5_moe")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_validate_source_against_peer_quant(peer_quant: Factory, tiny_factory: Factory, name: str) -> None:
    from mtpquant.api import ValidateOptions, validate

    report = validate(
        ValidateOptions(
            reference=_source(name, tiny_factory),
            candidate=peer_quant(name),
            num_prompts=2,
            max_len=40,
            k=2,
            device="cpu",
            progress=False,
        )
    )
    data = report.to_json()
    # every peer kept the source's BF16 MTP byte for byte: the MTP part of the comparison is exact
    linears = 8 if name.endswith("-dense") else 22  # the MTP's Linear weights, every one still BF16
    assert data["candidate"]["mtp"]["present"] and data["candidate"]["mtp"]["precision"] == {"bf16": linears}
    assert data["comparison"]["mtp"]["kl"]["max"] == 0.0 and data["comparison"]["mtp"]["top1_agreement"] == 1.0
    assert data["comparison"]["al_delta_from_mtp_by_k"] == [0.0, 0.0]
    assert data["comparison"]["main"]["positions"] > 0


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_fix_metadata_repairs_autoround_quant(peer_quant: Factory, tmp_path: Path, variant: str) -> None:
    name = f"autoround-nvfp4-llmc-{variant}"
    _, _, declared, actual = EXPECTED[name]
    out = tmp_path / "fixed"
    result = graft(GraftOptions(quant=peer_quant(name), out=out, fix_metadata=True))
    assert result.action == "metadata"
    assert result.metadata_changes == [
        r"config.json: ignore += re:^mtp\..*",
        f"{INDEX_NAME}: metadata.total_size = {actual} (was {declared!r})",
    ]
    assert json.loads((out / INDEX_NAME).read_text())["metadata"]["total_size"] == actual
    before = json.loads((peer_quant(name) / "config.json").read_text())["quantization_config"]["ignore"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == [*before, r"re:^mtp\..*"]
    r = inspect_checkpoint(out)
    assert r.verdicts["vllm"] == (LOADS if variant == "dense" else _gate_failure())
    assert r.index.warnings == [] and [f.message for f in r.warnings] == []
    if variant == "moe":
        # the quantized shared_expert_gate is AutoRound's own main-model defect, not an MTP one: graft says so
        assert [f.message for f in r.failures] == EXPECTED[name][1][6:]
        assert result.warnings == [
            f"QUANT's own problem, not graft's to fix, remains: {m}" for m in EXPECTED[name][1][6:]
        ]
    else:
        assert r.healthy and result.warnings == []


def _gate_failure() -> str:
    return (
        "vLLM will fail to load: model.language_model.layers.0.mlp.shared_expert_gate is NVFP4-CT on disk but "
        "vLLM builds it without a quantization config"
    )


def test_fix_metadata_twice_is_a_noop(peer_quant: Factory, tmp_path: Path) -> None:
    out = tmp_path / "fixed"
    graft(GraftOptions(quant=peer_quant("autoround-nvfp4-llmc-dense"), out=out, fix_metadata=True))
    again = graft(GraftOptions(quant=out, out=tmp_path / "again", fix_metadata=True))
    assert again.action == "noop" and not (tmp_path / "again").exists()


def test_graft_corrects_a_wrong_total_size_and_says_so(peer_quant: Factory, tmp_path: Path) -> None:
    # llm-compressor's quant has its MTP and complete metadata; only total_size is off (file sizes, not tensors)
    src = TINY_MTP_ASSET
    out = tmp_path / "out"
    result = graft(GraftOptions(quant=peer_quant("llmcompressor-nvfp4-dense"), source=src, out=out))
    assert result.action == "metadata"
    assert result.metadata_changes == [f"{INDEX_NAME}: metadata.total_size = 3123056 (was 3145344)"]
    assert json.loads((out / INDEX_NAME).read_text())["metadata"]["total_size"] == 3123056
