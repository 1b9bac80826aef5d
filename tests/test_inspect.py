"""inspect: every verdict, on tiny checkpoints and real modelopt exports of them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpquant.cli import main as cli
from mtpquant.diagnose.report import EXIT_DECLARED_MISSING, EXIT_EXCLUSIONS, EXIT_INDEX, inspect_checkpoint
from mtpquant.engine.loading import FusedShardsError, ct_ignored, expand_modelopt_patterns, modelopt_excluded
from mtpquant.render import inspect_text
from tests.support.quants import with_mtp

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


def _ignore(path: Path) -> list[str]:
    return json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]


# ---- engine matching rules ----------------------------------------------------------------------
def test_vllm_expands_star_patterns() -> None:
    assert expand_modelopt_patterns(["mtp*", "model.visual*", "a.*", "lm_head"]) == [
        "mtp",
        "mtp.*",
        "model.visual",
        "model.visual.*",
        "a.*",
        "lm_head",
    ]


def test_modelopt_matching_exact_substring_fnmatch() -> None:
    assert modelopt_excluded("mtp.fc", ["mtp*"])
    assert modelopt_excluded("mtp.layers.0.self_attn.qkv_proj", ["mtp*"])
    assert not modelopt_excluded("mtp.fc", ["mtp.layers.0*"])
    assert modelopt_excluded("mtp.layers.0.mlp.experts", ["mtp.layers.0*"])
    # the substring trap: layers.1 also matches layers.10
    assert modelopt_excluded("model.layers.10.mlp.down_proj", ["model.layers.1"])
    assert not modelopt_excluded("model.layers.10.mlp.down_proj", ["model.layers.1.*"])


def _excluded_one_by_one(prefix: str, patterns: list[str]) -> bool:
    """The rule pattern by pattern, as vLLM writes it (the compiled matcher must agree)."""
    from fnmatch import fnmatch

    expanded = expand_modelopt_patterns(patterns)
    if not expanded:
        return False
    base, _, last = prefix.rpartition(".")
    shards = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(last)
    if shards:
        hits = [f"{base}.{s}" in expanded for s in shards]
        if any(hits) and not all(hits):
            raise FusedShardsError("partly")
        if all(hits):
            return True
    elif prefix in expanded:
        return True
    return any(p != prefix and p in prefix for p in expanded) or any(fnmatch(prefix, p) for p in expanded)


_PART = st.sampled_from(["model", "mtp", "layers", "0", "1", "10", "mlp", "experts", "3", "down_proj", "gate_up_proj",
                         "qkv_proj", "q_proj", "fc", "*", "1*", "[0-9]", "?"])  # fmt: skip
_NAME = st.lists(_PART, min_size=1, max_size=5).map(".".join)


@settings(max_examples=400, deadline=None)
@given(prefix=_NAME, patterns=st.lists(_NAME | _NAME.map(lambda s: s + "*"), max_size=6))
def test_compiled_exclusions_agree_with_the_rule_pattern_by_pattern(prefix: str, patterns: list[str]) -> None:
    prefix = prefix.replace("*", "x").replace("?", "y").replace("[0-9]", "7")  # module names have no glob characters
    try:
        want: bool | type = _excluded_one_by_one(prefix, patterns)
    except FusedShardsError:
        want = FusedShardsError
    try:
        got: bool | type = modelopt_excluded(prefix, patterns)
    except FusedShardsError:
        got = FusedShardsError
    assert got == want, (prefix, patterns)


def test_fused_group_partly_excluded_is_refused() -> None:
    with pytest.raises(FusedShardsError, match=r"some but not all shards of mtp\.layers\.0\.self_attn\.qkv_proj"):
        modelopt_excluded("mtp.layers.0.self_attn.qkv_proj", ["mtp.layers.0.self_attn.q_proj"])
    assert modelopt_excluded("a.qkv_proj", ["a.q_proj", "a.k_proj", "a.v_proj"])


def test_compressed_tensors_matching() -> None:
    assert not ct_ignored("mtp.fc", ["mtp*"])  # no globbing in compressed-tensors
    assert ct_ignored("mtp.fc", [r"re:^mtp\..*"])
    assert ct_ignored("mtp.layers.0.mlp.gate_up_proj", [r"re:^mtp\..*"])
    assert ct_ignored("lm_head", ["lm_head"])


# ---- verdicts on checkpoints --------------------------------------------------------------------
def test_bf16_source_is_healthy(tiny_factory: Factory) -> None:
    r = inspect_checkpoint(tiny_factory("qwen3_5_moe"))
    assert r.healthy and r.exit_code(strict=True) == 0
    assert r.verdicts == {
        "vllm": "vLLM: MTP loads (BF16)",
        "sglang": "SGLang: MTP loads (BF16)",
        "trtllm": "TensorRT-LLM: MTP loads (BF16)",
    }
    assert r.mtp_present_tensors == r.mtp_expected_tensors == 29
    assert '"num_speculative_tokens":3' in r.serve_commands["vllm"]
    assert "--speculative-algorithm NEXTN" in r.serve_commands["sglang"]


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_modelopt_export_without_mtp_is_declared_but_missing(naive_export_factory: Factory, variant: str) -> None:
    r = inspect_checkpoint(naive_export_factory(variant))
    assert not r.healthy
    assert r.verdicts["vllm"] == "vLLM: MTP declared but missing: speculative decoding will accept nothing"
    assert r.failure_messages == ["MTP declared but missing: speculative decoding will accept nothing"]
    assert r.exit_code(strict=True) == EXIT_DECLARED_MISSING
    # graft puts the MTP back; where the config has a key, --fix-metadata un-declares it instead (Qwen3-Next has none)
    undeclare = f"mtpquant graft {r.checkpoint} --fix-metadata --out {variant}-no-mtp   (or serve it without MTP: " \
        "un-declares the MTP it does not have)"
    assert r.fixes == [
        f"mtpquant graft {r.checkpoint} --from SRC --out {variant}-mtp   (SRC: the BF16 checkpoint it was made from)",
        *([undeclare] if variant != "qwen3_next" else []),
    ]
    assert r.quantization.algorithm == "NVFP4" and r.quantization.vllm_method == "modelopt_fp4"
    assert r.main_model.quantized > 0 and r.main_model.inconsistent_modules == []
    if variant == "qwen3_5":  # the text names the fix and reads plainly (counts say what they count)
        text = inspect_text(r).splitlines()
        assert f"fix   mtpquant graft {r.checkpoint} --from SRC --out qwen3_5-mtp" in "\n".join(text)
        assert "MTP present    0/15 expected tensors, 0 B" in text
        assert "quantization   modelopt NVFP4 (vLLM: modelopt_fp4), group size 16, KV cache unquantized" in text
        assert "main Linears   32 Linears: 25 quantized (NVFP4 25), 7 unquantized (BF16 7)" in text
        assert "vision tower   present, 21 tensors; 6 Linears, all unquantized (BF16 6)" in text
        # one verdict line per engine, each with its engine's name once
        assert [line for line in text if "declared but missing" in line and not line.startswith("FAIL")] == [
            "vLLM: MTP declared but missing: speculative decoding will accept nothing",
            "SGLang: MTP declared but missing: speculative decoding will accept nothing",
            "TensorRT-LLM: MTP declared but missing: speculative decoding will accept nothing",
        ]


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_healthy_keep_bf16_quant(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path, variant: str
) -> None:
    out = with_mtp(naive_export_factory(variant), tiny_factory(variant), tmp_path / "q")
    r = inspect_checkpoint(out)
    assert r.healthy, r.failure_messages
    assert r.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    assert r.verdicts["sglang"] == "SGLang: MTP loads (BF16)"
    assert r.mtp_shards == ["mtp.safetensors"]
    assert all(m.consistent and m.vllm_quantized is False for m in r.mtp_modules)


def test_only_layers_excluded_like_nvidia_397b(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    out = with_mtp(
        naive_export_factory("qwen3_5_moe"), tiny_factory("qwen3_5_moe"), tmp_path / "q", exclude_add=["mtp.layers.0*"]
    )
    r = inspect_checkpoint(out)
    fc = next(m for m in r.mtp_modules if m.module == "mtp.fc")
    assert fc.vllm_quantized is False and "mtp.fc workaround" in fc.reason
    assert r.verdicts["vllm"].startswith("vLLM: MTP loads (BF16); mtp.fc is not covered by the exclusions")
    assert "hard-coded mtp.fc workaround" in r.verdicts["vllm"]
    assert r.healthy  # it loads today, but --strict flags the exclusions
    assert r.exit_code(strict=True) == EXIT_EXCLUSIONS
    assert any("graft --fix-metadata" in w.message for w in r.warnings)


def test_compressed_tensors_ignore_glob_is_ineffective(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    quant = naive_export_factory("qwen3_5")
    base = [p for p in _ignore(quant) if not p.endswith("*")]
    bad = inspect_checkpoint(
        with_mtp(quant, tiny_factory("qwen3_5"), tmp_path / "bad", exclude_add=[], ct_ignore=[*base, "mtp*"])
    )
    assert bad.quantization.method == "compressed-tensors"
    assert bad.verdicts["vllm"] == "vLLM will fail to load: mtp.fc is BF16 on disk but declared quantized"
    assert bad.exit_code(strict=True) == EXIT_EXCLUSIONS
    good = inspect_checkpoint(
        with_mtp(quant, tiny_factory("qwen3_5"), tmp_path / "good", exclude_add=[], ct_ignore=[*base, r"re:^mtp\..*"])
    )
    assert good.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    assert [m for m in good.mtp_modules if not m.consistent] == []


def test_substring_trap_in_main_model(naive_export_factory: Factory, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "q"
    shutil.copytree(naive_export_factory("qwen3_5"), out)
    config = json.loads((out / "config.json").read_text())
    # meant to exclude a router called `mlp.gate`; by substring it also hits `mlp.gate_up_proj`
    config["quantization_config"]["ignore"].append("model.language_model.layers.0.mlp.gate")
    (out / "config.json").write_text(json.dumps(config))
    r = inspect_checkpoint(out)
    assert "model.language_model.layers.0.mlp.gate_up_proj" in r.main_model.inconsistent_modules
    assert (
        "vLLM will fail to load: model.language_model.layers.0.mlp.gate_up_proj is NVFP4 on disk but excluded "
        "from quantization"
    ) in r.failure_messages
    assert any("list different exclusions" in w.message for w in r.warnings)


def test_fused_group_partly_excluded(naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path) -> None:
    out = with_mtp(
        naive_export_factory("qwen3_5"),
        tiny_factory("qwen3_5"),
        tmp_path / "q",
        exclude_add=["mtp.fc", "mtp.layers.0.self_attn.q_proj"],
    )
    r = inspect_checkpoint(out)
    qkv = next(m for m in r.mtp_modules if m.module == "mtp.layers.0.self_attn.qkv_proj")
    assert qkv.vllm_quantized is None and not qkv.consistent
    assert r.verdicts["vllm"] == (
        "vLLM will fail to load: some but not all shards of mtp.layers.0.self_attn.qkv_proj are excluded (q_proj)"
    )


def test_fp8_block_mtp(naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path) -> None:
    from mtpquant.checkpoint.table import Checkpoint

    src = Checkpoint.open(tiny_factory("qwen3_5"))
    tensors = {}
    for e in src.mtp_tensors():
        t = src.read_tensor(e.name)
        if e.name.endswith("proj.weight"):
            tensors[e.name] = t.float().to(torch.float8_e4m3fn)
            rows, cols = -(-t.shape[0] // 128), -(-t.shape[1] // 128)
            tensors[e.name.replace(".weight", ".weight_scale_inv")] = torch.ones(rows, cols)
        else:
            tensors[e.name] = t
    out = with_mtp(
        naive_export_factory("qwen3_5"),
        tiny_factory("qwen3_5"),
        tmp_path / "q",
        mtp_tensors=tensors,
        exclude_add=["mtp.fc"],
    )
    r = inspect_checkpoint(out)
    precisions = {m.module: m.disk for m in r.mtp_modules}
    assert precisions["mtp.layers.0.self_attn.qkv_proj"] == "FP8-block"
    assert precisions["mtp.fc"] == "BF16"
    assert r.mtp_precision == "mixed: BF16, FP8-block"
    # the scales are counted apart from the tensors the layout expects (not "19/15 tensors")
    scales = r.mtp_present_tensors - 15
    assert f"MTP present    15/15 expected tensors (+{scales} quantization scales)" in inspect_text(r)
    # SGLang builds the MTP of a modelopt_fp4 checkpoint in BF16: FP8 weights have the BF16 shape, so they load,
    # as raw values without their block scales
    assert r.verdicts["sglang"] == (
        "SGLang will draft with a wrong MTP (NEXTN): SGLang builds the MTP of a serialized modelopt_fp4 checkpoint in "
        "BF16, and loads the FP8-block values of mtp.layers.0.mlp.down_proj without their scales"
    )
    assert "sglang" not in r.serve_commands
    # FP8 block weights under an NVFP4 config: vLLM builds NVFP4 modules that cannot take these tensors
    assert not r.healthy or r.verdicts["vllm"].startswith("vLLM: MTP loads")


def test_index_naming_missing_shard(tiny_copy: Factory) -> None:
    path = tiny_copy("qwen3_5_moe")
    (path / "model.safetensors-00002-of-00003.safetensors").unlink()
    r = inspect_checkpoint(path)
    assert not r.index.intact
    assert r.failure_messages[-1] == (
        "model.safetensors.index.json: shard 'model.safetensors-00002-of-00003.safetensors' does not exist"
    )
    assert r.exit_code(strict=True) == EXIT_INDEX
    assert r.verdicts["vllm"].startswith("vLLM: index corrupt: ")


def test_shard_tensor_missing_from_index(tiny_copy: Factory) -> None:
    path = tiny_copy("qwen3_5_moe")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["mtp.norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    r = inspect_checkpoint(path)
    assert (
        "model.safetensors-00003-of-00003.safetensors: tensor 'mtp.norm.weight' is not listed in "
        "model.safetensors.index.json"
    ) in r.failure_messages
    assert r.exit_code(strict=True) == EXIT_INDEX


def test_cli_json_and_strict_exit_codes(
    naive_export_factory: Factory, tiny_factory: Factory, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["inspect", str(naive_export_factory("qwen3_5")), "--strict"]) == EXIT_DECLARED_MISSING
    # without --strict a FAIL finding still exits non-zero: `inspect X && deploy` must not deploy it
    assert cli(["inspect", str(naive_export_factory("qwen3_5"))]) == EXIT_DECLARED_MISSING
    capsys.readouterr()
    assert cli(["inspect", str(tiny_factory("qwen3_next")), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema_version"] == 1 and data["healthy"] is True
    assert data["mtp_declaration"] == "not in config (engines default to 1 layer)"
    assert data["verdicts"]["vllm"] == "vLLM: MTP loads (BF16)"
    # the typed sections (QuantizationInfo, MainModelInfo, VisionInfo, IndexInfo) write the JSON the dicts wrote,
    # byte for byte: field names, order and values
    assert cli(["inspect", str(naive_export_factory("qwen3_5")), "--json"]) == EXIT_DECLARED_MISSING
    data = json.loads(capsys.readouterr().out)
    layers = [
        f"model.language_model.layers.{i}.linear_attn.{m}"
        for i in range(3)
        for m in ("conv1d", "in_proj_a", "in_proj_b")
    ]
    exclude = json.dumps(["lm_head", "model.language_model.embed_tokens", *layers, "model.visual*"])
    assert json.dumps([data[k] for k in ("quantization", "main_model", "vision", "index")]) == (
        '[{"method": "modelopt", "vllm_method": "modelopt_fp4", "algorithm": "NVFP4", "group_size": 16, '
        f'"kv_cache": null, "exclude": {exclude}, "declared_in": ["config.json", "hf_quant_config.json"]}}, '
        '{"linear_modules": 32, "quantized": 25, "unquantized": 7, "precisions": {"BF16": 7, "NVFP4": 25}, '
        '"inconsistent_modules": []}, '
        '{"present": true, "tensors": 21, "precisions": {"BF16": 6}, "expected": true}, '
        '{"shards": 1, "tensors": 152, "problems": [], "warnings": [], "intact": true}]'
    )


def test_cli_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["inspect", str(tmp_path / "nope")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such directory, and not a Hub repo id" in err


def test_inspect_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from mtpquant.diagnose.report import inspect_checkpoint; import mtpquant.cli; "
        "mtpquant.cli.build_parser(); print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_inspect_imports_only_its_own_command() -> None:
    """``mtpquant inspect`` (and its ``--help``) builds a parser with its command alone: no other command's settings,
    recipes or schema, no engine client's threads, and no text renderer for ``--json``."""
    import subprocess
    import sys

    from mtpquant.cli import _command_of

    assert _command_of(["-q", "inspect", "X"]) == "inspect" and _command_of(["--version"]) is None
    assert _command_of(["bogus", "inspect"]) is None  # not a command: every one is registered (argparse's error)
    code = (
        "import sys, mtpquant.cli as c; p = c.build_parser('inspect'); p.parse_args(['inspect', 'X', '--json']); "
        "print(sorted(m for m in ('mtpquant.search.settings', 'mtpquant.recipes', 'mtpquant.render', 'pydantic', "
        "'concurrent.futures', 'mtpquant.cli.convert_cmd') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
