"""The families beyond Qwen as registry data: recognition, where each stores its MTP, the exact inventories (the
counts of the published checkpoints; the block as transformers 5.19 builds the trunk's layer), optional copies, the
exclusions in every form the engines match, and the families mtpquant recognises but does not repair (their own
exit codes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main as cli
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode, UnsupportedArchitectureError
from mtpquant.families import family, resolve
from tests.support.nextn_layouts import full_config

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


@pytest.mark.parametrize(
    ("name", "key", "count", "copies"),
    [
        # 6 glue (copies included) + 2 norms + 7 MLA + 2 router + 3 shared + 768 routed (mtp-families.md §5)
        ("DeepSeek-V3", "deepseek_v3", 788, True),
        ("DeepSeek-V3.2", "deepseek_v32", 793, True),  # + the indexer's 5
        ("GLM-4.5", "glm4_moe", 502, True),  # 6 glue + 2 + 9 attention (QKV bias, QK norm) + 2 + 3 + 480 (§6)
        ("GLM-4.5", "glm4_moe", 500, False),  # GLM-4.6 / 4.7: no head / embedding copies
        ("GLM-5", "glm_moe_dsa", 791, False),  # 4 glue + 2 + 7 MLA + 5 indexer + 2 + 3 + 768
    ],
)
def test_full_size_inventories_have_the_published_counts(name: str, key: str, count: int, copies: bool) -> None:
    spec = resolve(full_config(name))
    assert spec.family.key == key and spec.mtp.layers == 1
    n = spec.dim("num_hidden_layers")
    present = [f"model.layers.{n}.shared_head.head.weight"] if copies else [f"model.layers.{n}.eh_proj.weight"]
    shapes = spec.expected_mtp_shapes(present)
    assert len(shapes) == count
    assert all(name.startswith(f"model.layers.{n}.") for name in shapes)
    H = spec.hidden_size
    assert shapes[f"model.layers.{n}.eh_proj.weight"] == (H, 2 * H)
    assert (f"model.layers.{n}.embed_tokens.weight" in shapes) == copies


def test_deepseek_v3_mla_shapes_and_copies_are_required() -> None:
    spec = resolve(full_config("DeepSeek-V3"))
    shapes = spec.expected_mtp_shapes([])  # DeepSeek-V3's drafter loads its head from the copy: always expected
    p = "model.layers.61."
    assert shapes[p + "shared_head.head.weight"] == shapes[p + "embed_tokens.weight"] == (129280, 7168)
    assert shapes[p + "self_attn.q_a_proj.weight"] == (1536, 7168)
    assert shapes[p + "self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert shapes[p + "self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert shapes[p + "self_attn.o_proj.weight"] == (7168, 128 * 128)
    assert shapes[p + "mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert spec.mtp_exclusion_patterns() == (("model.layers.61*",), (r"re:^model\.layers\.61\..*",))
    # vLLM's draft names its head {layer}.head (SharedHead(prefix=layer)), the rest as on disk (deepseek_mtp.py)
    assert spec.engine_mtp_name(p + "shared_head.head") == "model.layers.61.head"
    assert spec.engine_mtp_name(p + "self_attn.o_proj") == p + "self_attn.o_proj"


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe-copies", "mimo"])
def test_registry_inventory_is_transformers_layer_plus_glue(tiny_factory: Factory, variant: str) -> None:
    """The tiny checkpoints take the MTP's block from the trunk class's own layer (transformers 5.19), the glue from
    the registry: the registry's exact inventory must be that set, name for name and shape for shape."""
    ckpt = Checkpoint.open(tiny_factory(variant))
    present = {e.name: e.shape for e in ckpt.mtp_tensors()}
    assert present and present == ckpt.spec.expected_mtp_shapes(present)


def test_storage_classes_of_the_tiny_checkpoints(tiny_factory: Factory) -> None:
    ds = Checkpoint.open(tiny_factory("deepseek_v3"))
    assert ds.is_mtp("model.layers.2.enorm.weight") and not ds.is_mtp("model.layers.1.mlp.gate.weight")
    assert {e.shard for e in ds.mtp_tensors()} == {"model-00003-of-00003.safetensors"}  # the MTP alone, last
    glm = Checkpoint.open(tiny_factory("glm4_moe"))
    assert {e.shard for e in glm.mtp_tensors()} == {"mtp.safetensors"}  # GLM-4.7: its own file, in the index
    assert not any(e.name.endswith("embed_tokens.weight") for e in glm.mtp_tensors())
    nemo = Checkpoint.open(tiny_factory("nemotron_h"))
    assert nemo.main_prefix == "backbone."
    names = [e.name for e in nemo.mtp_tensors()]
    assert {n.split(".")[2] for n in names} == {"0", "1"} and nemo.spec.mtp_depth(names) == 1  # "*E": one depth
    mimo = Checkpoint.open(tiny_factory("mimo_v2_flash"))
    assert all(e.name.startswith("model.mtp.layers.0.") for e in mimo.mtp_tensors())
    assert Checkpoint.open(tiny_factory("mimo")).spec.engine_mtp_name("model.mtp_layers.0.mlp.up_proj") == (
        "model.layers.2.mlp.up_proj"  # vLLM's MiMoMTP: depth i at num_hidden_layers + i
    )


def test_glm5_next_needs_both_prefix_forms() -> None:
    """GLM-5.3-Flash keeps its text tower under model.language_model.; vLLM's Glm5NextMTP strips it and builds
    layer 45 as model.layers.45 (glm5next/common/mtp.py 332-337): the exclusions need both names."""
    text = {**full_config("GLM-5"), "num_hidden_layers": 45, "model_type": "glm5_next_text"}
    spec = resolve({"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
                    "text_config": text})
    assert spec.family.key == "glm5_next" and spec.is_mtp("model.language_model.layers.45.eh_proj.weight")
    assert next(iter(spec.expected_mtp_shapes())).startswith("model.language_model.layers.45.")
    assert spec.mtp_exclusion_patterns()[0] == ("model.language_model.layers.45*", "model.layers.45*")
    assert spec.engine_mtp_name("model.language_model.layers.45.self_attn.o_proj") == "model.layers.45.self_attn.o_proj"


def test_step_block_sits_under_mtp_block_in_the_engine() -> None:
    cfg = {"architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5", "hidden_size": 64, "vocab_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "num_nextn_predict_layers": 3}
    spec = resolve(cfg)
    assert spec.mtp.layers == 3 and spec.mtp_names.first == 4
    shapes = spec.expected_mtp_shapes()
    assert {"model.layers.6.shared_head.output.weight", "model.layers.4.eh_proj.weight"} <= set(shapes)
    assert spec.engine_mtp_name("model.layers.5.self_attn.o_proj") == "model.layers.5.mtp_block.self_attn.o_proj"
    assert spec.engine_mtp_name("model.layers.5.shared_head.output") == "model.layers.5.shared_head.head"
    assert spec.mtp_exclusion_patterns()[0] == ("model.layers.4*", "model.layers.5*", "model.layers.6*")


def _write(path: Path, config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> Path:
    from tests.support.skeleton import SkeletonTensor, write_sparse_safetensors

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    write_sparse_safetensors(path / "model.safetensors", [SkeletonTensor(n, d, s, "") for n, (d, s) in tensors.items()])
    return path


_TRUNK = {"model.embed_tokens.weight": ("BF16", (128, 64)), "model.layers.0.input_layernorm.weight": ("BF16", (64,)),
          "model.norm.weight": ("BF16", (64,)), "lm_head.weight": ("BF16", (128, 64))}


def test_minimax_m2_is_declared_never_shipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "hidden_size": 64,
           "vocab_size": 128, "num_hidden_layers": 1, "use_mtp": True, "num_mtp_modules": 3}
    path = _write(tmp_path / "m2", cfg, _TRUNK)
    r = inspect_checkpoint(path)
    assert r.mtp_status == "never_shipped" and r.exit_code() == ExitCode.MTP_NEVER_SHIPPED == 26
    assert [f.category for f in r.failures] == ["never_shipped"] and r.fixes == []
    assert cli(["graft", str(path), "--fix-metadata", "--out", str(tmp_path / "out")]) == 26
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "graft --fix-metadata refused: MiniMax-M2 configs declare num_mtp_modules" in err
    assert not (tmp_path / "out").exists()


def test_deepseek_v41_dspark_is_not_an_mtp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "hidden_size": 64,
           "vocab_size": 128, "num_hidden_layers": 1, "dspark_block_size": 5}
    path = _write(tmp_path / "v41", cfg, {**_TRUNK, "mtp.0.markov_head.markov_w1.weight": ("BF16", (64, 64))})
    r = inspect_checkpoint(path)
    assert r.exit_code() == ExitCode.NOT_AN_MTP == 28 and [f.category for f in r.failures] == ["not_mtp"]
    assert r.verdicts["vllm"].startswith("vLLM: no MTP to draft with: DeepSeek-V4.1 keeps a DSpark drafter")
    assert cli(["graft", str(path), "--from", str(path), "--out", str(tmp_path / "out")]) == 28
    assert "graft refused: DeepSeek-V4.1 keeps a DSpark drafter under mtp.*" in capsys.readouterr().err


def test_deepseek_v4_mtp_is_repaired_as_its_drafter_loads_it(tmp_path: Path) -> None:
    """DeepSeek-V4 keeps its MTP under mtp.{i}.* with separate e_proj / h_proj (vLLM 0.32
    models/deepseek_v4/nvidia/mtp.py): a quant that lost it fails inspect, and --fix-metadata un-declares it."""
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 64,
           "vocab_size": 128, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}
    path = _write(tmp_path / "v4", cfg, _TRUNK)  # a quant that lost mtp.0.* (RedHat's V4-Flash NVFP4)
    r = inspect_checkpoint(path)
    assert r.drafters == {"vllm": "DeepSeekV4MTPModel", "sglang": "DeepseekV4ForCausalLMNextN"}
    assert r.exit_code() == ExitCode.INSPECT_MTP and r.mtp_status == "supported"
    assert cli(["graft", str(path), "--fix-metadata", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert inspect_checkpoint(tmp_path / "out").healthy
    glue = {"mtp.0.enorm.weight": ("BF16", (64,)), "mtp.0.hnorm.weight": ("BF16", (64,)),
            "mtp.0.e_proj.weight": ("BF16", (64, 64)), "mtp.0.h_proj.weight": ("BF16", (64, 64)),
            "mtp.0.mlp.experts.0.w1.weight": ("BF16", (32, 64))}
    whole = inspect_checkpoint(_write(tmp_path / "whole", cfg, {**_TRUNK, **glue}))
    assert whole.healthy and whole.mtp_present_tensors == 5 and whole.mtp_expected_tensors == 4
    torn = inspect_checkpoint(_write(tmp_path / "torn", cfg, {**_TRUNK, "mtp.0.enorm.weight": ("BF16", (64,))}))
    assert torn.exit_code() == ExitCode.INSPECT_MTP and torn.mtp_missing[0] == "mtp.0.hnorm.weight"


def test_convert_refuses_the_families_it_does_not_quantize(tiny_factory: Factory, tmp_path: Path) -> None:
    from mtpquant.convert.plan import plan_convert
    from mtpquant.convert.run import ConvertOptions

    with pytest.raises(UnsupportedArchitectureError, match=r"convert does not quantize MiMo-7B") as err:
        plan_convert(ConvertOptions(src=tiny_factory("mimo"), out=tmp_path / "out"))
    assert "DeepSeek-V3 / R1 / V3.1" in str(err.value) and "GLM-4.5 / 4.6 / 4.7" in str(err.value)  # what it converts
    assert not (tmp_path / "out").exists()
    assert family("mimo").convert is False and family("deepseek_v3").convert is True
