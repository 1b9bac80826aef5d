"""Every MTP drafter vLLM 0.32 serves is a registry family: inspect, graft, extract and graft --fix-metadata on each
family whose MTP is stored in the target, the separate drafter named as such, and ``mtpquant families``.

The oracles are independent of the registry: the drafter classes are the installed vLLM 0.32's registry
(tests/fixtures/vllm/mtp-drafters-0.32.0.json), and each family's MTP tensor names below are read from its vLLM
loader (the file named beside it), written here by hand.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main as cli
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode
from mtpquant.families import FAMILIES, family, resolve
from mtpquant.families.catalogue import CAPABILITIES, catalogue, render_markdown, render_summary
from mtpquant.graft.extract import ExtractOptions, extract_mtp
from mtpquant.graft.run import GraftOptions, graft
from tests.support.skeleton import SkeletonTensor, write_sparse_safetensors

pytestmark = pytest.mark.dev

ROOT = Path(__file__).resolve().parents[1]
DRAFTERS = json.loads((ROOT / "tests/fixtures/vllm/mtp-drafters-0.32.0.json").read_text())["drafters"]
H, V, N = 64, 128, 2
NORM, PROJ, BLOCK = (H,), (H, 2 * H), (H, H)


def _appended(p: str, *extra: str) -> dict[str, tuple[int, ...]]:
    """A DeepSeek-style appended layer at ``p``: enorm, hnorm, eh_proj, the ``extra`` norms, one block Linear."""
    return {p + "enorm.weight": NORM, p + "hnorm.weight": NORM, p + "eh_proj.weight": PROJ,
            **{p + e + ".weight": NORM for e in extra}, p + "self_attn.o_proj.weight": BLOCK}


def _fc(p: str = "mtp.") -> dict[str, tuple[int, ...]]:
    """Qwen3.5's / EXAONE's mtp. namespace: fc over [embed, hidden], its norms, one layer's Linear."""
    return {p + "fc.weight": PROJ, p + "pre_fc_norm_embedding.weight": NORM, p + "pre_fc_norm_hidden.weight": NORM,
            p + "norm.weight": NORM, p + "layers.0.self_attn.o_proj.weight": BLOCK}


def _cfg(arch: str, model_type: str, key: str = "num_nextn_predict_layers", **text: Any) -> dict[str, Any]:
    return {"architectures": [arch], "model_type": model_type, "hidden_size": H, "vocab_size": V,
            "num_hidden_layers": N, key: 1, **text}


def _wrapped(arch: str, model_type: str, key: str = "num_nextn_predict_layers") -> dict[str, Any]:
    return {"architectures": [arch], "model_type": model_type,
            "text_config": {"hidden_size": H, "vocab_size": V, "num_hidden_layers": N, key: 1}}


# family key -> (config, trunk prefix, MTP tensors as the family's checkpoints store them; the loader read)
CASES: dict[str, tuple[dict[str, Any], str, dict[str, tuple[int, ...]]]] = {
    # bailing_moe_mtp.py get_spec_layer_idx / normalize_name: model.layers.{N}, final_layernorm
    "bailing_moe_v25": (_cfg("BailingMoeV2_5ForCausalLM", "bailing_hybrid"), "model.",
                        _appended("model.layers.2.", "final_layernorm")),
    "bailing_moe_v3": (_cfg("BailingMoeV3ForCausalLM", "bailing_hybrid"), "model.",
                       _appended("model.layers.2.", "final_layernorm")),  # bailing_moe_v3_mtp.py
    "dots3_note": (_cfg("Dots3NoteForCausalLM", "dots3_note"), "model.",
                   _appended("model.layers.2.", "shared_head.norm")),  # dots3_note/nvidia/mtp.py (V3.2's)
    "glm4_moe_lite": (_cfg("Glm4MoeLiteForCausalLM", "glm4_moe_lite"), "model.",
                      _appended("model.layers.2.", "shared_head.norm")),  # glm4_moe_lite_mtp.py
    "glm_ocr": (_wrapped("GlmOcrForConditionalGeneration", "glm_ocr"), "model.language_model.",
                _appended("model.language_model.layers.2.", "shared_head.norm")),  # glm_ocr_mtp.py 253
    "hy_v3": (_cfg("HYV3ForCausalLM", "hy_v3"), "model.",
              _appended("model.layers.2.", "final_layernorm")),  # hy_v3_mtp.py 470
    "kimi_k3": (_wrapped("KimiK3ForConditionalGeneration", "kimi_k3"), "language_model.model.",
                _appended("language_model.model.layers.2.", "shared_head.norm")),  # kimi_k3/nvidia/mtp.py 324
    "pangu_ultra_moe": (_cfg("PanguUltraMoEForCausalLM", "pangu_ultra_moe"), "model.",
                        _appended("model.layers.2.", "shared_head.norm")),  # openpangu_mtp.py
    "exaone_moe": (_cfg("ExaoneMoeForCausalLM", "exaone_moe"), "model.", _fc()),  # exaone_moe_mtp.py 195
    "exaone4_5": ({**_wrapped("Exaone4_5_ForConditionalGeneration", "exaone4_5"), "num_nextn_predict_layers": 1},
                  "model.language_model.", _fc()),  # exaone4_5_mtp.py: config.num_nextn_predict_layers (top level)
    "interns2": (_wrapped("InternS2MobiusForConditionalGeneration", "interns2_mobius", "mtp_num_hidden_layers"),
                 "model.language_model.", _fc()),  # interns2_mobius.py: Qwen3.5's MTP loader
    "ernie4_5_moe": (_cfg("Ernie4_5_MoeForCausalLM", "ernie4_5_moe"), "model.", {  # ernie_mtp.py WeightsMapper
        "model.mtp_emb_norm.0.weight": NORM, "model.mtp_hidden_norm.0.weight": NORM,
        "model.mtp_linear_proj.0.weight": PROJ, "model.mtp_block.0.self_attn.o_proj.weight": BLOCK}),
    "hy_v4": (_cfg("HYV4ForCausalLM", "hy_v4"), "model.",
              _appended("model.mtp_layers.0.")),  # hy_v4/nvidia/mtp.py _remap_mtp_quant_exclusions
    "inkling": ({**_cfg("InklingForCausalLM", "inkling_model", "unused"),
                 "mtp_config": {"num_nextn_predict_layers": 1}},
                "model.", {"model.mtp.chain_norm.weight": NORM,  # inkling/nvidia/mtp.py _load_inkling_mtp_weights
                           "model.mtp.layers.0.transformer_block.wq_du.weight": BLOCK}),
    "longcat_flash": (_cfg("LongcatFlashForCausalLM", "longcat_flash"), "model.", {  # new_to_old_names_mapping
        "model.mtp.layers.0.enorm.m.weight": NORM, "model.mtp.layers.0.hnorm.m.weight": NORM,
        "model.mtp.layers.0.eh_proj.weight": PROJ, "model.mtp.norm.weight": NORM,
        "model.mtp.layers.0.self_attn.o_proj.weight": BLOCK}),
    "mimo_v2_omni": (_cfg("MiMoV2OmniForCausalLM", "mimo_v2_omni"), "model.",
                     _appended("model.mtp.layers.0.", "final_layernorm")),  # mimo_v2_mtp.py
    "minimax_m3": (_wrapped("MiniMaxM3SparseForConditionalGeneration", "minimax_m3_vl", "num_mtp_modules"),
                   "language_model.model.",  # minimax_m3/nvidia/mtp.py _map_checkpoint_name
                   _appended("language_model.model.mtp.layers.0.")),
    "deepseek_v4": (_cfg("DeepseekV4ForCausalLM", "deepseek_v4"), "model.", {  # deepseek_v4/nvidia/mtp.py 343
        "mtp.0.enorm.weight": NORM, "mtp.0.hnorm.weight": NORM, "mtp.0.e_proj.weight": BLOCK,
        "mtp.0.h_proj.weight": BLOCK, "mtp.0.attn.wo.weight": BLOCK}),
}


def _write(path: Path, config: dict[str, Any], trunk: str, mtp: dict[str, tuple[int, ...]]) -> Path:
    """A two-shard checkpoint: the trunk (two layers) in the first, the MTP alone in the second, with its index."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    main = {trunk + "embed_tokens.weight": (V, H), trunk + "layers.0.self_attn.o_proj.weight": BLOCK,
            trunk + "layers.1.self_attn.o_proj.weight": BLOCK, trunk + "norm.weight": NORM, "lm_head.weight": (V, H)}
    shards = {"model-00001-of-00002.safetensors": main, "model-00002-of-00002.safetensors": mtp}
    weight_map = {}
    for shard, tensors in shards.items():
        write_sparse_safetensors(path / shard, [SkeletonTensor(n, "BF16", s, shard) for n, s in tensors.items()],
                                 fill=lambda t: bytes([len(t.name) % 251]) * t.nbytes)
        weight_map |= dict.fromkeys(tensors, shard)
    total = sum(2 * math.prod(s) for t in shards.values() for s in t.values())
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return path


def _lost(out: Path, config: dict[str, Any], trunk: str) -> Path:
    """The checkpoint as a quantizer that lost the MTP leaves it: the MTP's shard gone, still declared."""
    path = _write(out, config, trunk, {})
    (path / "model-00002-of-00002.safetensors").unlink()
    return path


def test_every_vllm_drafter_is_a_registry_family() -> None:
    """The 31 MTP drafter classes of vLLM 0.32's registry (EAGLE aside) each name a family of the registry."""
    assert len(DRAFTERS) == 31 and not any(k.startswith("Eagle") for k in DRAFTERS)
    named = {d: r.key for r in catalogue() for d in r.vllm_drafters}
    assert sorted(set(DRAFTERS) - set(named)) == []
    assert set(named) <= set(DRAFTERS)  # no drafter the installed vLLM does not have


@pytest.mark.parametrize("key", sorted(CASES))
def test_inspect_graft_extract_and_fix_metadata(key: str, tmp_path: Path) -> None:
    config, trunk, mtp = CASES[key]
    assert resolve(config).family.key == key
    src = _write(tmp_path / "src", config, trunk, mtp)
    ckpt = Checkpoint.open(src)
    assert sorted(e.name for e in ckpt.mtp_tensors()) == sorted(mtp)  # the MTP, and nothing of the trunk
    r = inspect_checkpoint(src)
    assert r.healthy and r.mtp_declared and r.mtp_layers_present == 1, r.failure_messages
    assert r.drafters["vllm"] == family(key).engine.drafters["vllm"] and r.drafters["vllm"] in DRAFTERS
    # a quant that lost the MTP: declared, missing (exit 10); graft puts back exactly the source's bytes
    lost = _lost(tmp_path / "lost", config, trunk)
    assert inspect_checkpoint(lost).exit_code() == ExitCode.INSPECT_MTP
    graft(GraftOptions(quant=lost, source=src, out=tmp_path / "grafted"))
    out = Checkpoint.open(tmp_path / "grafted")
    assert {n: out.read_raw(out.tensors[n]) for n in mtp} == {n: ckpt.read_raw(ckpt.tensors[n]) for n in mtp}
    assert inspect_checkpoint(tmp_path / "grafted").healthy
    # extract: the MTP alone, a sidecar inspect recognises
    side = extract_mtp(ExtractOptions(src, tmp_path / "side"))
    assert side.mtp_tensors == len(mtp) and inspect_checkpoint(tmp_path / "side").kind == "mtp-only"
    # the MTP present but undeclared: --fix-metadata declares it (1 layer) and inspect is healthy after
    undeclared = json.loads(json.dumps(config))
    for scope in (undeclared, undeclared.get("text_config") or {}, undeclared.get("mtp_config") or {}):
        for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules"):
            scope.pop(k, None)
    bare = _write(tmp_path / "bare", undeclared, trunk, mtp)
    if family(key).mtp.default_layers > 0:  # engines assume one layer without the key: nothing to declare
        assert inspect_checkpoint(bare).healthy
        return
    assert inspect_checkpoint(bare).exit_code() == ExitCode.INSPECT_MTP
    assert cli(["graft", str(bare), "--fix-metadata", "--out", str(tmp_path / "fixed")]) == 0
    fixed = inspect_checkpoint(tmp_path / "fixed")
    assert fixed.healthy and fixed.mtp_declared, fixed.failure_messages


def test_a_torn_glue_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The glue inventory is checked by name and shape: ERNIE's transposed mtp_linear_proj (sgl#7657) and a missing
    LongCat eh_proj fail inspect."""
    config, trunk, mtp = CASES["ernie4_5_moe"]
    bad = _write(tmp_path / "ernie", config, trunk, {**mtp, "model.mtp_linear_proj.0.weight": (2 * H, H)})
    assert cli(["inspect", str(bad)]) == ExitCode.CHECKPOINT
    assert "implies model.mtp_linear_proj.0.weight of shape [64, 128], but" in capsys.readouterr().err
    config, trunk, mtp = CASES["longcat_flash"]
    torn = {n: s for n, s in mtp.items() if "eh_proj" not in n}
    r = inspect_checkpoint(_write(tmp_path / "longcat", config, trunk, torn))
    assert r.exit_code() == ExitCode.INSPECT_MTP and r.mtp_missing == ["model.mtp.layers.0.eh_proj.weight"]


def test_a_separate_drafter_is_named_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma-4 drafts with a separate assistant checkpoint (gemma4_mtp.py, speculative.py gemma4_assistant): the
    target holds no MTP, inspect says where the drafter is, every surgery refuses in one line (exit 28)."""
    cfg = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": H, "vocab_size": V,
           "num_hidden_layers": N}
    path = _write(tmp_path / "gemma", cfg, "model.", {"model.layers.1.mlp.up_proj.weight": BLOCK})
    r = inspect_checkpoint(path)
    assert r.healthy and r.mtp_status == "separate_drafter" and r.drafters["vllm"] == "Gemma4MTPModel"
    assert r.verdicts["vllm"].startswith("vLLM: Gemma-4's MTP drafter is a separate assistant model")
    assert cli(["graft", str(path), "--fix-metadata", "--out", str(tmp_path / "out")]) == ExitCode.NOT_AN_MTP
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "graft --fix-metadata refused: Gemma-4's MTP drafter is a separate" in err
    assert not (tmp_path / "out").exists()


def test_families_json_names_every_drafter_and_what_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["families", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {d for r in rows for d in r["vllm_drafters"]} == set(DRAFTERS)
    by_key = {r["key"]: r for r in rows}
    assert len(by_key) == len(FAMILIES)
    for r in rows:
        assert set(r["works"]) == set(CAPABILITIES) and r["works"]["inspect"] and r["mtp_location"]
    assert by_key["kimi_k3"]["mtp_location"].startswith("language_model.model.layers.{N+i}.*")
    assert by_key["gemma4"]["storage"] == "separate" and not by_key["gemma4"]["works"]["graft"]
    assert by_key["qwen3_5"]["works"] == dict.fromkeys(CAPABILITIES, True)
    assert by_key["ernie4_5_moe"]["works"]["graft"] and not by_key["ernie4_5_moe"]["works"]["convert"]
    assert all(r["sources"] for r in rows)  # every fact cites the vLLM file it is read from


def test_families_table_in_the_docs_is_the_registrys(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/families-table.md is the table rendered from the registry (regenerate it with ``mtpquant families >
    docs/families-table.md``), and the README block between the families markers its summary."""
    table = render_markdown()
    assert cli(["families"]) == 0 and capsys.readouterr().out == table
    assert (ROOT / "docs/families-table.md").read_text() == table
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- families:begin -->\n(.*?)<!-- families:end -->", readme, re.DOTALL)
    assert block is not None and block.group(1) == render_summary()
    summary_rows = block.group(1).splitlines()[2:]
    for f in FAMILIES:  # every family in exactly one row of the summary
        assert sum(f"{f.display} (" in row for row in summary_rows) == 1, f.display
    assert len(table.splitlines()) == len(FAMILIES) + 2


def test_tiny_step3p5_is_three_appended_layers_graft_and_extract_carry(
    tiny_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    """``tiny --variant step3p5``: Step-3.5-Flash's three appended MTP layers (step3p5_mtp.py: model.layers.{N+i},
    each with enorm / hnorm / eh_proj / shared_head.{norm,output}) alone in the last shard; a quant that lost them
    gets them back, byte for byte, and extract writes them alone."""
    src = tiny_factory("step3p5")
    ckpt = Checkpoint.open(src)
    mtp = sorted(e.name for e in ckpt.mtp_tensors())
    assert {n.split(".")[2] for n in mtp} == {"2", "3", "4"} and ckpt.config["num_hidden_layers"] == 2
    for i in (2, 3, 4):
        assert {f"model.layers.{i}.{g}.weight" for g in ("enorm", "hnorm", "eh_proj", "shared_head.norm",
                                                         "shared_head.output")} <= set(mtp)
    assert {e.shard for e in ckpt.mtp_tensors()} == {"model-00003-of-00003.safetensors"}
    r = inspect_checkpoint(src)
    assert r.healthy and r.mtp_layers_present == 3 and r.drafters["vllm"] == "Step3p5MTP"
    lost = tmp_path / "lost"
    lost.mkdir()
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if not ckpt.is_mtp(n)}
    for f in src.iterdir():
        if f.name != "model-00003-of-00003.safetensors" and f.name != INDEX_NAME:
            (lost / f.name).write_bytes(f.read_bytes())
    (lost / INDEX_NAME).write_text(json.dumps(index))
    assert inspect_checkpoint(lost).exit_code() == ExitCode.INSPECT_MTP
    graft(GraftOptions(quant=lost, source=src, out=tmp_path / "out"))
    out = Checkpoint.open(tmp_path / "out")
    assert {n: out.read_raw(out.tensors[n]) for n in mtp} == {n: ckpt.read_raw(ckpt.tensors[n]) for n in mtp}
    assert inspect_checkpoint(tmp_path / "out").healthy
    assert extract_mtp(ExtractOptions(src, tmp_path / "side")).mtp_tensors == len(mtp)


def test_the_committed_drafter_list_is_the_installed_vllms() -> None:
    """The test data above is the installed vLLM 0.32's registry (skipped where the test engine is not built), and
    every vLLM file a family cites exists in it."""
    import ast

    from tests.support.vllm_env import vllm_env_dir
    from tests.support.vllm_source import vllm_source

    tree = vllm_source("model_executor/models/registry.py")
    table = next(
        n.value for n in tree.body
        if isinstance(n, ast.AnnAssign | ast.Assign) and isinstance(n.value, ast.Dict)
        and any(isinstance(t, ast.Name) and t.id == "_SPECULATIVE_DECODING_MODELS"
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
    )
    drafters = {}
    for key, value in zip(table.keys, table.values, strict=True):
        assert isinstance(key, ast.Constant) and isinstance(value, ast.Tuple)
        name = key.value
        if "MTP" in name and not name.startswith("Eagle"):
            module, cls = (e.value for e in value.elts if isinstance(e, ast.Constant))
            drafters[name] = {"module": module, "class": cls}
    assert drafters == DRAFTERS
    vllm = next(vllm_env_dir().glob("lib/python3*/site-packages/vllm"))
    cited = {s for f in FAMILIES for s in f.sources}
    assert cited and sorted(s for s in cited if not (vllm / s).is_file()) == []


@pytest.mark.parametrize(
    ("key", "layer"),
    [("ernie4_5_moe", "model.mtp_block.0.self_attn.o_proj"), ("hy_v4", "model.mtp_layers.0.self_attn.o_proj"),
     ("deepseek_v4", "mtp.0.attn.wo"), ("longcat_flash", "model.mtp.layers.0.self_attn.o_proj")],
)
def test_the_mtp_exclusions_cover_the_drafts_own_names(key: str, layer: str) -> None:
    """Where vLLM's draft builds a sub-namespace layer as model.layers.{k} (ernie_mtp.py WeightsMapper, hy_v4's
    _remap_mtp_quant_exclusions, deepseek_v4's _to_spec_layer_name, LongCat's 2 x num_hidden_layers), the whole-MTP
    exclusions name that too, and the compressed-tensors form matches the checkpoint's names."""
    config = CASES[key][0]
    spec = resolve(config)
    modelopt, ct = spec.mtp_exclusion_patterns()
    engine = spec.engine_mtp_name(layer)
    k = 2 * N if key == "longcat_flash" else N
    assert engine.startswith(f"model.layers.{k}.")
    assert f"model.layers.{k}*" in modelopt and any(re.match(p[3:], layer) for p in ct)
    assert any(re.match(p[3:], engine) for p in ct)
