"""convert on the appended-layer families (GLM-4.5 ``glm4_moe``, DeepSeek-V3 ``deepseek_v3``, DeepSeek-V3.2
``deepseek_v32``, GLM-5 ``glm_moe_dsa``): every MTP mode on their tiny checkpoints, bytes carried exactly, and
exclusions checked with vLLM 0.32's own loader code.

vLLM's decisions are taken from its source (the test engine's installed vLLM, ``tests/support/vllm_source.py``):
the target's ``packed_modules_mapping`` (``Glm4MoeForCausalLM``; ``DeepseekV2ForCausalLM`` with the
``fused_qkv_a_proj`` its ``__init__`` adds when ``q_lora_rank`` is set), which the draft shares (``Glm4MoeMTP`` and
``DeepSeekMTP`` define none, so ``configure_quant_config`` leaves the target's on the one quant config), and
``ModelOptQuantConfigBase.is_layer_excluded`` / ``is_layer_skipped`` run unchanged on every module vLLM builds with
the quant config: the attention (packed), the dense and shared MLPs (packed gate/up), the routed experts' FusedMoE,
and (V3.2, GLM-5) the indexer's ``wq_b`` (a ``ReplicatedLinear`` given the quant config), and GLM's draft head
(``SharedHead``'s ``ParallelLMHead``, filled with the target's ``lm_head`` when the layer has no head copy; the target's
``lm_head`` is one too, excluded by every output as ``lm_head``). The routers (``GateLinear``), ``eh_proj``
(``nn.Linear``), the indexer's fused ``wk_weights_proj`` (``quant_config=None``) and the other heads are built
unquantized whatever the list says. vLLM's CPU build serves V3.2 and GLM-5 with the DeepSeek classes
(``models/deepseek_v32/__init__.py``: ``DeepseekV3ForCausalLM``, ``GlmMoeDsaForCausalLM``, ``DeepSeekMTP``).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterator, Mapping
from fnmatch import fnmatch
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, Literal

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.convert.plan import plan_convert
from mtpquant.convert.result import ConvertResult
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.diagnose.report import inspect_checkpoint
from tests.support.vllm_source import vllm_source

pytestmark = pytest.mark.slow

CALIB = {"calib_samples": 4, "calib_seq_len": 32, "device": "cpu", "progress": False}
FAMILIES = ("glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
INDEXED = ("deepseek_v32", "glm_moe_dsa")  # the MLA with the sparse-attention indexer (5 more MTP tensors)
MTP = "model.layers.2."
EXPERTS = {f"{MTP}mlp.experts.{e}.{x}_proj" for e in range(4) for x in ("gate", "up", "down")}
SHARED = {f"{MTP}mlp.shared_experts.{x}_proj" for x in ("gate", "up", "down")}
# what --mtp quantize makes NVFP4: what vLLM builds with the quant config, less what the family keeps BF16 (DeepSeek's
# MLA, as NVIDIA's R1-FP4 and the main model's recipe)
MTP_QUANTIZED = {
    "glm4_moe": EXPERTS | SHARED | {f"{MTP}self_attn.{x}_proj" for x in ("q", "k", "v", "o")},
    "deepseek_v3": EXPERTS | SHARED,
    "deepseek_v32": EXPERTS | SHARED,
    "glm_moe_dsa": EXPERTS | SHARED,
}
# mode "quantize-cpu": --mtp quantize with the routed experts left BF16, as vLLM's CPU build serves it (it has no NVFP4
# MoE kernel; tests/test_engine_nextn.py): the recipe's exclusion holds in the MTP too
CPU_MOE = 'quantization.exclude=["*mlp.experts*"]'


@pytest.fixture(scope="module")
def outputs(
    tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str, str], tuple[Path, ConvertResult]]]:
    """convert's output per (family, MTP mode), made once; extract's MTP goes to ``<family>/extract-mtp``."""
    root = tmp_path_factory.mktemp("nextn-convert")
    done: dict[tuple[str, str], tuple[Path, ConvertResult]] = {}

    def get(variant: str, mode: str) -> tuple[Path, ConvertResult]:
        if (variant, mode) not in done:
            out = root / variant / mode
            extra: dict[str, Any] = {"mtp_out": root / variant / "extract-mtp"} if mode == "extract" else {}
            if mode == "quantize-cpu":
                extra["overrides"] = (CPU_MOE,)
            opts = ConvertOptions(src=str(tiny_factory(variant)), out=out, mtp=mode.removesuffix("-cpu"), **extra,
                                  **CALIB)  # fmt: skip
            done[variant, mode] = (out, convert(opts))
        return done[variant, mode]

    yield get


def raw(ckpt: Checkpoint, name: str) -> tuple[str, tuple[int, ...], bytes]:
    e = ckpt.tensors[name]
    return e.dtype, tuple(e.shape), ckpt.read_raw(e)


def quantized(ckpt: Checkpoint) -> set[str]:
    return {n[: -len(".weight_scale")] for n in ckpt.tensors if n.endswith(".weight_scale")}


def is_mtp(name: str) -> bool:
    return name.startswith(MTP)


# ---- the modes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("mode", ["keep", "quantize", "extract", "drop"])
def test_every_mtp_mode(
    mode: str, variant: str, tiny_factory: Callable[[str], Path], outputs: Callable[..., tuple[Path, ConvertResult]]
) -> None:
    out, result = outputs(variant, mode)
    source, ckpt = Checkpoint.open(tiny_factory(variant), strict=True), Checkpoint.open(out, strict=True)
    mtp_src = sorted(n for n in source.tensors if is_mtp(n))
    mtp_out = sorted(n for n in ckpt.tensors if is_mtp(n))
    config = json.loads((out / "config.json").read_text())
    assert len(mtp_src) == 32 + 5 * (variant in INDEXED) and result.plan.recipe.name == f"{variant}-nvfp4"
    assert inspect_checkpoint(out).healthy, mode
    if mode == "keep":
        assert mtp_out == mtp_src and all(raw(ckpt, n) == raw(source, n) for n in mtp_src)
        assert config["num_nextn_predict_layers"] == 1
        assert result.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    elif mode in ("extract", "drop"):
        assert mtp_out == [] and config["num_nextn_predict_layers"] == 0
    if mode == "extract":
        side = Checkpoint.open(out.parent / "extract-mtp", strict=True)
        assert sorted(side.tensors) == mtp_src and all(raw(side, n) == raw(source, n) for n in mtp_src)
    if mode == "quantize":
        q = {m for m in quantized(ckpt) if is_mtp(m)}
        assert q == MTP_QUANTIZED[variant]
        # every quantized MTP Linear has its activation scale (W4A4), from the MTP forward's calibration
        assert all(f"{m}.input_scale" in ckpt.tensors for m in q)
        kept = [n for n in mtp_out if n.rsplit(".", 1)[0] not in q]
        assert sorted(kept) == sorted(n for n in mtp_src if n.rsplit(".", 1)[0] not in q)
        assert all(raw(ckpt, n) == raw(source, n) for n in kept)  # eh_proj, norms, router, MLA, head copies
        assert ckpt.tensors[f"{MTP}mlp.gate.e_score_correction_bias"].dtype == "F32"
        assert config["num_nextn_predict_layers"] == 1
        assert result.verdicts["vllm"] == "vLLM: MTP loads (mixed: BF16, NVFP4)"


@pytest.mark.parametrize("variant", FAMILIES)
def test_quantize_keeps_the_recipes_exclusions_in_the_mtp(
    variant: str, tiny_factory: Callable[[str], Path], outputs: Callable[..., tuple[Path, ConvertResult]]
) -> None:
    """``--set quantization.exclude=["*mlp.experts*"]``: the MTP's routed experts stay BF16 byte for byte like the
    main model's, its attention and shared expert NVFP4 W4A4 with scales from the MTP forward, and the expert bank is
    excluded by the name vLLM's FusedMoE is built with (``model.layers.2.mlp.experts``)."""
    out, result = outputs(variant, "quantize-cpu")
    source, ckpt = Checkpoint.open(tiny_factory(variant), strict=True), Checkpoint.open(out, strict=True)
    q = quantized(ckpt)
    assert {m for m in q if is_mtp(m)} == MTP_QUANTIZED[variant] - EXPERTS
    assert not any(".mlp.experts." in m for m in q)
    assert all(f"{m}.input_scale" in ckpt.tensors for m in q)
    experts = sorted(n for n in source.tensors if ".mlp.experts." in n)
    assert len(experts) == 24 and all(raw(ckpt, n) == raw(source, n) for n in experts)
    exclusions = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert {f"model.layers.{i}.mlp.experts" for i in (1, 2)} <= set(exclusions)
    assert inspect_checkpoint(out).healthy and result.verdicts["vllm"] == "vLLM: MTP loads (mixed: BF16, NVFP4)"


def test_inspect_sees_the_glm_draft_head_vllm_builds(
    outputs: Callable[..., tuple[Path, ConvertResult]], tmp_path: Path
) -> None:
    """GLM's draft fills its head (``model.layers.2.head``, built with the quant config) with the target's BF16
    ``lm_head`` when the layer has no head copy: a quantize output whose lists forget that head fails to load in
    vLLM (the weight does not fit the packed NVFP4 head), and inspect says so."""
    import shutil

    out, _ = outputs("glm4_moe", "quantize")
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    heads = {f"{MTP}head", f"{MTP}shared_head.head"}
    hfq = json.loads((broken / "hf_quant_config.json").read_text())
    assert heads <= set(hfq["quantization"]["exclude_modules"])
    hfq["quantization"]["exclude_modules"] = [m for m in hfq["quantization"]["exclude_modules"] if m not in heads]
    (broken / "hf_quant_config.json").write_text(json.dumps(hfq))
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["ignore"] = hfq["quantization"]["exclude_modules"]
    (broken / "config.json").write_text(json.dumps(config))
    report = inspect_checkpoint(broken)
    assert not report.healthy
    assert report.verdicts["vllm"].startswith("vLLM will fail to load"), report.verdicts["vllm"]
    assert f"{MTP}shared_head.head" in report.verdicts["vllm"]


@pytest.mark.parametrize("variant", FAMILIES)
def test_quantize_scales_are_shared_as_vllm_reads_them(
    variant: str, outputs: Callable[..., tuple[Path, ConvertResult]]
) -> None:
    """One weight_scale_2 and one input_scale per packed module (q/k/v, gate/up); the routed experts' input scale
    one per kind (FusedMoE keeps one per expert but modelopt calibrates them together)."""
    out, _ = outputs(variant, "quantize")
    ckpt = Checkpoint.open(out, strict=True)
    groups = [[f"{MTP}mlp.shared_experts.{x}_proj" for x in ("gate", "up")]]
    groups += [[f"{MTP}mlp.experts.{e}.{x}_proj" for x in ("gate", "up")] for e in range(4)]
    if variant == "glm4_moe":
        groups.append([f"{MTP}self_attn.{x}_proj" for x in ("q", "k", "v")])
    for group in groups:
        for leaf in ("weight_scale_2", "input_scale"):
            assert len({ckpt.read_raw(ckpt.tensors[f"{m}.{leaf}"]) for m in group}) == 1, (group, leaf)
    scales = {float(ckpt.read_tensor(f"{m}.input_scale")) for m in MTP_QUANTIZED[variant]}
    assert all(s > 0 for s in scales) and len(scales) > 1


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("mode", ["keep", "quantize", "drop"])
def test_carried_tensors_are_the_sources_bytes(
    mode: str, variant: str, tiny_factory: Callable[[str], Path], outputs: Callable[..., tuple[Path, ConvertResult]]
) -> None:
    out, _ = outputs(variant, mode)
    source, ckpt = Checkpoint.open(tiny_factory(variant), strict=True), Checkpoint.open(out, strict=True)
    q = quantized(ckpt)
    carried = [n for n in source.tensors if not is_mtp(n) and n.rsplit(".", 1)[0] not in q]
    assert set(carried) <= set(ckpt.tensors)
    assert [n for n in carried if raw(ckpt, n) != raw(source, n)] == []
    routers = [n for n in carried if n.endswith("e_score_correction_bias")]
    assert routers and all(ckpt.tensors[n].dtype == "F32" for n in routers)
    main_q = {m for m in q if not is_mtp(m)}
    attention = {m for m in main_q if ".self_attn." in m}
    assert (attention != set()) == (variant == "glm4_moe")  # DeepSeek's MLA stays BF16
    assert {m for m in main_q if ".mlp.experts." in m} and not any(m.endswith(".mlp.gate") for m in main_q)
    lost = sorted(set(source.tensors) - set(ckpt.tensors) - ({n for n in source.tensors if is_mtp(n)}))
    assert lost == []


@pytest.mark.parametrize("variant", FAMILIES)
def test_extract_then_graft_is_keep(
    variant: str, outputs: Callable[..., tuple[Path, ConvertResult]], tmp_path: Path
) -> None:
    from mtpquant.graft.run import GraftOptions, graft

    keep, _ = outputs(variant, "keep")
    extract, _ = outputs(variant, "extract")
    grafted = tmp_path / "grafted"
    graft(GraftOptions(quant=str(extract), source=str(extract.parent / "extract-mtp"), out=grafted))
    a, b = Checkpoint.open(keep, strict=True), Checkpoint.open(grafted, strict=True)
    assert sorted(a.tensors) == sorted(b.tensors)
    assert all(raw(a, n) == raw(b, n) for n in a.tensors)
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((keep / name).read_text()) == json.loads((grafted / name).read_text())


# ---- vLLM's loader rules ---------------------------------------------------------------------------------------


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _assigned(cls: ast.ClassDef, name: str) -> Any:
    node = next(n for n in cls.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name)
    return ast.literal_eval(node.value)


def _defines(cls: ast.ClassDef, name: str) -> bool:
    return any(isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name for n in cls.body)


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    quant_utils = vllm_source("model_executor/layers/quantization/utils/quant_utils.py")
    modelopt = vllm_source("model_executor/layers/quantization/modelopt.py")
    glm, glm_mtp = (
        vllm_source("model_executor/models/glm4_moe.py"),
        vllm_source("model_executor/models/glm4_moe_mtp.py"),
    )
    ds, ds_mtp = (
        vllm_source("model_executor/models/deepseek_v2.py"),
        vllm_source("model_executor/models/deepseek_mtp.py"),
    )
    ns: dict[str, Any] = {"MappingProxyType": MappingProxyType, "Literal": Literal, "Mapping": Mapping}
    ns["fnmatch"], ns["re"] = fnmatch, re
    nodes: list[ast.stmt] = [
        n for n in quant_utils.body if isinstance(n, ast.FunctionDef) and n.name == "is_layer_skipped"
    ]
    base = _class(modelopt, "ModelOptQuantConfigBase")
    nodes += [n for n in base.body if isinstance(n, ast.FunctionDef) and n.name == "is_layer_excluded"]
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "<vllm>", "exec"), ns)
    # the drafts define no mapping of their own: the target's stays on the shared quant config
    assert not _defines(_class(glm_mtp, "Glm4MoeMTP"), "packed_modules_mapping")
    assert not _defines(_class(ds_mtp, "DeepSeekMTP"), "packed_modules_mapping")
    deepseek = dict(_assigned(_class(ds, "DeepseekV2ForCausalLM"), "packed_modules_mapping"))
    # its __init__ adds the fused q_a / kv_a pair where q_lora_rank is set (V3, the tiny)
    assert "fused_qkv_a_proj" in ast.unparse(_class(ds, "DeepseekV2ForCausalLM"))
    deepseek["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]
    # V3.2 and GLM-5 on the CPU build: the DeepSeek classes (models/deepseek_v32/__init__.py, its last branch)
    v32 = vllm_source("models/deepseek_v32/__init__.py")
    cpu = next(n for n in ast.walk(v32) if isinstance(n, ast.If) and "is_rocm" in ast.unparse(n.test)).orelse
    imported = {(n.module, a.name, a.asname) for n in cpu if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM") in imported
    assert ("vllm.model_executor.models.deepseek_v2", "GlmMoeDsaForCausalLM", None) in imported
    assert ("vllm.model_executor.models.deepseek_mtp", "DeepSeekMTP", "DeepseekV32MTP") in imported
    for name in ("DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM"):
        assert [ast.unparse(b) for b in _class(ds, name).bases] == ["DeepseekV2ForCausalLM"]
    # the indexer: wq_b built with the quant config, wk + weights_proj fused and built without one
    indexer = {
        node.targets[0].attr: ast.unparse(next(k.value for k in node.value.keywords if k.arg == "quant_config"))
        for node in ast.walk(_class(ds, "Indexer"))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and isinstance(node.targets[0], ast.Attribute) and any(k.arg == "quant_config" for k in node.value.keywords)
    }  # fmt: skip
    assert indexer == {"wq_b": "quant_config", "wk_weights_proj": "None"}
    return SimpleNamespace(
        packed={
            "glm4_moe": _assigned(_class(glm, "Glm4MoeForCausalLM"), "packed_modules_mapping"),
            "deepseek_v3": deepseek,
            "deepseek_v32": deepseek,
            "glm_moe_dsa": deepseek,
        },
        is_layer_excluded=ns["is_layer_excluded"],
    )


def _built_with_quant_config(ckpt: Checkpoint, packed: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """vLLM module prefix -> the checkpoint Linears it holds: packed attention and MLPs, one FusedMoE per MoE layer,
    the other attention Linears, the indexer's wq_b; not the routers, eh_proj, the indexer's wk_weights_proj or heads
    (built without the quant config)."""
    modules = {n[: -len(".weight")] for n, e in ckpt.tensors.items() if n.endswith(".weight") and len(e.shape) == 2}
    modules = {
        m
        for m in modules
        if re.search(
            r"\.(self_attn\.(\w+_proj(_with_mqa)?|indexer\.wq_b)|mlp\.(shared_experts\.|experts\.\d+\.)?\w+_proj)$", m
        )
    }
    experts: dict[str, list[str]] = {}
    for m in sorted(m for m in modules if ".mlp.experts." in m):
        experts.setdefault(m.split(".mlp.experts.")[0] + ".mlp.experts", []).append(m)
    modules -= {m for ms in experts.values() for m in ms}
    out: dict[str, list[str]] = {}
    taken: set[str] = set()
    for name, shards in packed.items():
        for m in sorted(modules):
            if m.endswith("." + shards[0]):
                base = m[: -len(shards[0]) - 1]
                members = [f"{base}.{s}" for s in shards]
                if all(x in modules for x in members):
                    out[f"{base}.{name}"] = members
                    taken.update(members)
    out.update({m: [m] for m in modules - taken})
    return {**out, **experts}


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("mode", ["keep", "quantize", "quantize-cpu", "drop"])
def test_exclusions_as_vllm_loads_them(
    mode: str, variant: str, vllm: SimpleNamespace, outputs: Callable[..., tuple[Path, ConvertResult]]
) -> None:
    out, _ = outputs(variant, mode)
    ckpt = Checkpoint.open(out, strict=True)
    exclusions = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == exclusions
    state = SimpleNamespace(exclude_modules=list(exclusions), packed_modules_mapping=vllm.packed[variant])
    q = quantized(ckpt)
    built = _built_with_quant_config(ckpt, vllm.packed[variant])
    if variant == "glm4_moe" and mode != "drop":
        # Glm4MoeMTP.load_weights loads the target's lm_head.weight into its SharedHead's ParallelLMHead, built with
        # the quant config as "model.layers.2.head" (the tiny layer has no head copy): excluded, or it is NVFP4
        assert f"{MTP}shared_head.head.weight" not in ckpt.tensors
        built[f"{MTP}head"] = ["lm_head"]
    checked = 0
    for prefix, members in built.items():
        excluded = vllm.is_layer_excluded(state, prefix)  # raises for a packed group only partly excluded
        member_q = [m in q for m in members]
        assert all(member_q) or not any(member_q), prefix
        assert excluded == (not member_q[0]), f"{prefix}: vLLM says excluded={excluded}"
        checked += 1
    indexed = variant in INDEXED  # one wq_b more per layer
    assert checked == {"glm4_moe": 9}.get(variant, 13 + 2 * indexed) + (
        0 if mode == "drop" else 5 + (variant != "glm4_moe") * (2 + indexed) + (variant == "glm4_moe")
    )
    if mode == "keep":  # vLLM builds the kept MTP unquantized: every module it would build with the config
        assert all(vllm.is_layer_excluded(state, p) for p in built if is_mtp(p + "."))
        assert any(is_mtp(p + ".") for p in built)


# ---- capped memory ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", FAMILIES)
def test_capped_is_the_in_memory_output(
    variant: str,
    tiny_factory: Callable[[str], Path],
    outputs: Callable[..., tuple[Path, ConvertResult]],
    tmp_path: Path,
) -> None:
    reference, _ = outputs(variant, "quantize")
    src = tiny_factory(variant)
    plan, _ = plan_convert(ConvertOptions(src=str(src), out=tmp_path / "unused", dry_run=True, device="cpu"))
    cap = f"cpu={int(plan.memory.model_bytes * 0.8)}"
    out = tmp_path / "capped"
    result = convert(ConvertOptions(src=str(src), out=out, mtp="quantize", max_memory=cap, **CALIB))
    assert result.layerwise and result.placement.get("disk", 0) > 0
    a, b = Checkpoint.open(reference, strict=True), Checkpoint.open(out, strict=True)
    assert sorted(a.tensors) == sorted(b.tensors)
    assert [n for n in a.tensors if raw(a, n) != raw(b, n)] == []
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((reference / name).read_text()) == json.loads((out / name).read_text())


def test_quantize_releases_the_calibrated_mtp_layer_before_the_export(
    outputs: Callable[..., tuple[Path, ConvertResult]],
    tiny_factory: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The appended MTP layer (a whole MoE layer: 4.7 GB at GLM-4.5-Air's size) is not held through the export: the
    layer calibration ran is freed before it, only its amax kept, and the write reads it again: the same bytes."""
    import weakref

    import mtpquant.convert.model as model_mod
    import mtpquant.convert.run as run_mod

    reference, _ = outputs("glm4_moe", "quantize")
    built: list[weakref.ref[Any]] = []
    alive_at_export: list[bool] = []
    load, export = run_mod.load_mtp_layer, model_mod.export_quantized

    def load_mtp_layer(*args: Any, **kwargs: Any) -> Any:
        layer = load(*args, **kwargs)
        built.append(weakref.ref(layer))
        return layer

    def export_quantized(*args: Any, **kwargs: Any) -> Any:
        alive_at_export.extend(ref() is not None for ref in built)
        return export(*args, **kwargs)

    monkeypatch.setattr(run_mod, "load_mtp_layer", load_mtp_layer)
    monkeypatch.setattr(model_mod, "export_quantized", export_quantized)
    out = tmp_path / "out"
    convert(ConvertOptions(src=str(tiny_factory("glm4_moe")), out=out, mtp="quantize", **CALIB))
    assert alive_at_export == [False]  # the one layer calibration ran, already freed when the export starts
    a, b = Checkpoint.open(reference, strict=True), Checkpoint.open(out, strict=True)
    assert sorted(a.tensors) == sorted(b.tensors)
    assert [n for n in a.tensors if raw(a, n) != raw(b, n)] == []


def _mapped_rss(files: set[str]) -> int:
    """kB of this process's RSS in its mappings of ``files`` (``/proc/self/smaps``)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):
            inside = len(fields) >= 6 and fields[5] in files
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1])
    return rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux: reads /proc/self/smaps")
def test_capped_load_gives_back_the_source_pages_it_read(tiny_factory: Callable[[str], Path], tmp_path: Path) -> None:
    """transformers keeps its mappings of SRC's shards while the model lives (the resident weights are views into
    them): every page it read while loading, the offloaded MoE layer's per-expert tensors it fused too, stayed in RSS
    (6.5 GB file-backed at GLM-4.5-Air's size under cpu=8GiB). Under a cap convert pages them out once loaded."""
    from mtpquant.convert.model import load_main_model

    src = tiny_factory("glm4_moe")
    plan, _ = plan_convert(ConvertOptions(src=str(src), out=tmp_path / "unused", dry_run=True, device="cpu"))
    cap = f"cpu={int(plan.memory.model_bytes * 0.8)}"
    plan, ckpt = plan_convert(
        ConvertOptions(src=str(src), out=tmp_path / "unused", dry_run=True, device="cpu", max_memory=cap)
    )
    assert plan.memory.offloaded
    model = load_main_model(src, ckpt, plan.memory, "cpu", tmp_path / "offload")
    shards = {str((src / s).resolve()) for s in ckpt.shards}
    maps = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()]
    assert shards & set(maps)  # still mapped (the main model's shards): the resident weights live in them
    # but (almost) none of their pages resident. Without the page-out 860 of these 1,294 kB stay resident (measured);
    # MADV_PAGEOUT is best effort: it skips pages it cannot isolate at that instant (those still in another CPU's
    # LRU batch), 48 kB once in CI. An eighth of the shards' bytes separates the two.
    total = sum(Path(s).stat().st_size for s in shards)
    assert _mapped_rss(shards) * 1024 <= total // 8
    next(model.parameters())  # (the model is alive while RSS is read)


# ---- validate's built-in path ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_validate_runs_to_a_report_greedy_and_sampled(
    mode: str, variant: str, tiny_factory: Callable[[str], Path], outputs: Callable[..., tuple[Path, ConvertResult]],
    tmp_path: Path,
) -> None:
    """validate's built-in prediction through the family's MTP forward (mtp/nextn.py), greedy and at T = 0.8, to a
    report: keep's MTP drafts exactly as the source's on identical inputs; quantize's is NVFP4 and differs a little.
    The tiny models are random, so the verdict is the broken-MTP one, on both sides alike."""
    from mtpquant.records.validation import REPORT_FILE
    from mtpquant.validate.run import ValidateOptions, validate

    out, _ = outputs(variant, mode)
    opts = ValidateOptions(
        reference=str(tiny_factory(variant)), candidate=str(out), num_prompts=3, max_len=40, k=2, device="cpu",
        progress=False, temperatures=(0.0, 0.8), report_dir=tmp_path / "report",
    )  # fmt: skip
    report = validate(opts).report
    assert report.candidate is not None and report.comparison is not None and report.comparison.mtp is not None
    assert report.reference.family == report.candidate.family == variant
    assert report.candidate.mtp.present and report.candidate.mtp.error is None
    assert [a.sampling.temperature for a in report.candidate.acceptance_by_sampling] == [0.0, 0.8]
    assert all(len(a.by_k) == 2 for a in (*report.reference.acceptance_by_sampling,
                                         *report.candidate.acceptance_by_sampling))  # fmt: skip
    mtp = report.comparison.mtp
    assert mtp.positions > 0 and mtp.kl is not None
    if mode == "keep":
        assert mtp.top1_agreement == 1.0 and mtp.kl.max == 0.0
        assert report.candidate.mtp.precision == {"bf16": {"glm4_moe": 21}.get(variant, 24 + 3 * (variant in INDEXED))}
    else:
        assert 0.9 <= mtp.top1_agreement < 1.0 or mtp.kl.max > 0.0
        assert report.candidate.mtp.precision is not None
        assert report.candidate.mtp.precision["nvfp4"] == len(MTP_QUANTIZED[variant])
    data = json.loads((tmp_path / "report" / REPORT_FILE).read_text())
    assert data["verdict"]["status"] == report.verdict.status and data["candidate"]["family"] == variant
