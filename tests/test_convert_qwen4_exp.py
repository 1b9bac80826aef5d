"""convert on the tiny Qwen3.8-Flash-Next (qwen4_exp): every MTP mode, bytes carried exactly, and exclusions and
scales checked with vLLM 0.32's own loader code.

vLLM cannot build this family on CPU, so the loader's decisions are taken from its source (the test engine's
installed vLLM, as tests/test_qwen4_exp_vllm_loader.py does): ``packed_modules_mapping`` of ``Qwen4ExpForCausalLM``
and ``Qwen4ExpMTP``, ``is_layer_skipped`` and ``ModelOptQuantConfigBase.is_layer_excluded`` /
``apply_vllm_mapper`` run unchanged, ``_remap_ignored_layers`` for the MTP's engine layer index, and the NVFP4
linear method's one ``weight_scale_2.max()`` / ``input_scale.max()`` per packed module (so the members of a packed
group must share both). The real serve check is in scripts/gpu_check.sh.
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
from mtpquant.families import is_mtp_name
from tests.support.vllm_env import vllm_env_dir

pytestmark = pytest.mark.slow

CALIB = {"calib_samples": 4, "calib_seq_len": 32, "device": "cpu", "progress": False}
TABLE = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding"


@pytest.fixture(scope="module")
def src(tiny_factory: Callable[[str], Path]) -> Path:
    return tiny_factory("qwen4_exp")


def sources(src: Path) -> dict[str, Path]:
    """The tiny random Qwen4-Exp and the trained one (mtpquant/assets/tiny-qwen4_exp-mtp: the same shapes)."""
    from mtpquant.synth.train import TINY_MTP_ASSETS

    return {"random": src, "trained": TINY_MTP_ASSETS["qwen4_exp"]}


@pytest.fixture(scope="module")
def outputs(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., tuple[Path, ConvertResult]]]:
    """convert's output per (MTP mode, source), made once; extract's MTP goes to ``<mode dir>-mtp``."""
    root = tmp_path_factory.mktemp("qwen4_exp")
    done: dict[tuple[str, str], tuple[Path, ConvertResult]] = {}

    def get(mode: str, source: str = "random") -> tuple[Path, ConvertResult]:
        if (mode, source) not in done:
            out = root / source / mode
            extra = {"mtp_out": root / source / "extract-mtp"} if mode == "extract" else {}
            opts = ConvertOptions(src=str(sources(src)[source]), out=out, mtp=mode, **extra, **CALIB)
            done[mode, source] = (out, convert(opts))
        return done[mode, source]

    yield get


def raw(ckpt: Checkpoint, name: str) -> tuple[str, tuple[int, ...], bytes]:
    e = ckpt.tensors[name]
    return e.dtype, tuple(e.shape), ckpt.read_raw(e)


def quantized(ckpt: Checkpoint) -> set[str]:
    return {n[: -len(".weight_scale")] for n in ckpt.tensors if n.endswith(".weight_scale")}


# ---- the modes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["random", "trained"])
@pytest.mark.parametrize("mode", ["keep", "quantize", "extract", "drop"])
def test_every_mtp_mode(mode: str, which: str, src: Path, outputs: Callable[..., tuple[Path, ConvertResult]]) -> None:
    out, result = outputs(mode, which)
    source, ckpt = Checkpoint.open(sources(src)[which], strict=True), Checkpoint.open(out, strict=True)
    mtp_src = sorted(n for n in source.tensors if is_mtp_name(n))
    mtp_out = sorted(n for n in ckpt.tensors if is_mtp_name(n))
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert len(mtp_src) == 31 and result.plan.recipe.name == "qwen4_exp-nvfp4"
    if mode == "keep":
        assert mtp_out == mtp_src and all(raw(ckpt, n) == raw(source, n) for n in mtp_src)
        assert text["mtp_num_hidden_layers"] == 1 and result.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    elif mode in ("extract", "drop"):
        assert mtp_out == [] and text["mtp_num_hidden_layers"] == 0
    if mode == "extract":
        side = Checkpoint.open(out.parent / "extract-mtp", strict=True)
        assert sorted(side.tensors) == mtp_src and all(raw(side, n) == raw(source, n) for n in mtp_src)
    if mode == "quantize":
        # vLLM builds fc_embedding, fc_hidden, o_proj, the shared expert and the routed experts with the draft's
        # quantization config (registry MtpLayout.engine_linears); the experts are written per expert
        q = {m for m in quantized(ckpt) if is_mtp_name(m)}
        p = "mtp.layers.0."
        expected = {"mtp.fc_embedding", "mtp.fc_hidden", p + "self_attn.o_proj"}
        expected |= {f"{p}mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")}
        expected |= {f"{p}mlp.experts.{e}.{x}_proj" for e in range(4) for x in ("gate", "up", "down")}
        assert q == expected
        kept = [n for n in mtp_out if n.rsplit(".", 1)[0] not in q]
        assert kept and all(raw(ckpt, n) == raw(source, n) for n in kept)  # norms, hyper-connections, q/k/v, gates
        assert sorted(set(mtp_src) - set(mtp_out)) == [p + "mlp.experts.down_proj", p + "mlp.experts.gate_up_proj"]
        assert result.verdicts["vllm"] == "vLLM: MTP loads (mixed: BF16, NVFP4)"


def test_quiet_convert_prints_nothing_but_its_summary(src: Path, tmp_path: Path) -> None:
    """`mtpquant -q convert` of this family printed modelopt's "exported tensor names may not match the original HF
    hub checkpoint" warning (its export keeps the routed experts per expert, as vLLM loads them, and convert checks
    the output): -q prints the summary and nothing else; without -q the line is not a warning either."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    calib = ["--calib-samples", "4", "--calib-seq-len", "32", "--device", "cpu"]
    for quiet, out in ((["-q"], tmp_path / "quiet"), ([], tmp_path / "default")):
        proc = subprocess.run(
            [sys.executable, "-m", "mtpquant", *quiet, "convert", str(src), str(out), *calib],
            capture_output=True, text=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"wrote {out} ")
        assert "may not match" not in proc.stderr and (proc.stderr == "" or not quiet), proc.stderr


@pytest.mark.parametrize("which", ["random", "trained"])
def test_extract_then_graft_is_keep(
    which: str, outputs: Callable[..., tuple[Path, ConvertResult]], tmp_path: Path
) -> None:
    from mtpquant.graft.run import GraftOptions, graft

    keep, _ = outputs("keep", which)
    extract, _ = outputs("extract", which)
    grafted = tmp_path / "grafted"
    graft(GraftOptions(quant=str(extract), source=str(extract.parent / "extract-mtp"), out=grafted))
    a, b = Checkpoint.open(keep, strict=True), Checkpoint.open(grafted, strict=True)
    assert sorted(a.tensors) == sorted(b.tensors)
    assert all(raw(a, n) == raw(b, n) for n in a.tensors)
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((keep / name).read_text()) == json.loads((grafted / name).read_text())


@pytest.mark.parametrize("which", ["random", "trained"])
def test_carried_tensors_are_the_sources_bytes(
    which: str, src: Path, outputs: Callable[..., tuple[Path, ConvertResult]]
) -> None:
    out, _ = outputs("keep", which)
    source, ckpt = Checkpoint.open(sources(src)[which], strict=True), Checkpoint.open(out, strict=True)
    q = quantized(ckpt)
    carried = [n for n in ckpt.tensors if n in source.tensors and n.rsplit(".", 1)[0] not in q]
    assert all(raw(ckpt, n) == raw(source, n) for n in carried)
    names = set(ckpt.tensors)
    # the PLE n-gram table: the source's row shards, byte for byte, never one concatenated tensor
    shards = sorted(n for n in source.tensors if n.startswith(TABLE + ".shard_"))
    assert len(shards) == 4 and set(shards) <= names and TABLE + ".weight" not in names
    for buf in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        name = f"model.language_model.layers.0.ple.ple_embedding.{buf}"
        assert ckpt.tensors[name].dtype == "I64" and raw(ckpt, name) == raw(source, name)
    vision = sorted(n for n in source.tensors if n.startswith("model.visual."))
    assert vision and set(vision) <= set(carried)
    a_log = [n for n in carried if n.endswith("linear_attn.A_log")]
    assert a_log and all(ckpt.tensors[n].dtype == "F32" for n in a_log)
    # every source tensor is in the output, quantized or as it was (fused experts: per expert, quantized)
    lost = sorted(
        n for n in set(source.tensors) - names if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    )
    assert lost == []


# ---- vLLM's loader rules ---------------------------------------------------------------------------------------


def _vllm_tree(relative: str) -> ast.Module:
    matches = sorted(vllm_env_dir().glob(f"lib/python3*/site-packages/vllm/{relative}"))
    if not matches:
        pytest.skip(f"the vLLM {relative} of the test engine is not installed (python -m tests.support.vllm_env)")
    return ast.parse(matches[0].read_text(), filename=str(matches[0]))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _assigned(cls: ast.ClassDef, name: str) -> Any:
    node = next(n for n in cls.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name)
    return ast.literal_eval(node.value)


def _compiled(nodes: list[ast.stmt], namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "<vllm>", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    """vLLM 0.32's loader rules from its source: packed mappings, exclusion resolution, MTP layer remap."""
    model = _vllm_tree("models/qwen4_exp/nvidia/model.py")
    mtp = _vllm_tree("models/qwen4_exp/nvidia/mtp.py")
    quant_utils = _vllm_tree("model_executor/layers/quantization/utils/quant_utils.py")
    modelopt = _vllm_tree("model_executor/layers/quantization/modelopt.py")
    ns: dict[str, Any] = {"MappingProxyType": MappingProxyType, "Literal": Literal, "Mapping": Mapping}
    ns["fnmatch"], ns["re"] = fnmatch, re
    skipped = [n for n in quant_utils.body if isinstance(n, ast.FunctionDef) and n.name == "is_layer_skipped"]
    base = _class(modelopt, "ModelOptQuantConfigBase")
    methods = [
        n for n in base.body if isinstance(n, ast.FunctionDef) and n.name in ("is_layer_excluded", "apply_vllm_mapper")
    ]
    remap = [n for n in mtp.body if isinstance(n, ast.FunctionDef) and n.name == "_remap_ignored_layers"]
    _compiled([*skipped, *methods, *remap], ns)
    source = ast.unparse(modelopt)
    # the NVFP4 linear method keeps one global weight scale and one input scale per (packed) module
    assert "layer.weight_scale_2.max()" in source and "layer.input_scale.max()" in source
    return SimpleNamespace(
        main_packed=_assigned(_class(model, "Qwen4ExpForCausalLM"), "packed_modules_mapping"),
        mtp_packed=_assigned(_class(mtp, "Qwen4ExpMTP"), "packed_modules_mapping"),
        is_layer_excluded=ns["is_layer_excluded"],
        apply_vllm_mapper=ns["apply_vllm_mapper"],
        remap=ns["_remap_ignored_layers"],
    )


class _Identity:
    """The checkpoint's names on both sides: vLLM's hf_to_vllm prefix mapping renames modules and exclusions alike."""

    def apply_list(self, values: list[str]) -> list[str]:
        return list(values)


def _engine_modules(modules: set[str], packed: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """vLLM module prefix -> the checkpoint Linears it holds (packed groups where all members exist)."""
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
    return out


def _check(
    ckpt: Checkpoint,
    vllm: SimpleNamespace,
    exclusions: list[str],
    packed: Mapping[str, list[str]],
    engine: Callable[[str], str],
    modules: set[str],
) -> int:
    state = SimpleNamespace(exclude_modules=list(exclusions), packed_modules_mapping=packed)
    vllm.apply_vllm_mapper(state, _Identity())
    q = quantized(ckpt)
    checked = 0
    for prefix, members in _engine_modules(modules, packed).items():
        excluded = vllm.is_layer_excluded(state, engine(prefix))  # raises for a packed group only partly excluded
        member_q = [m in q for m in members]
        assert all(member_q) or not any(member_q), prefix
        assert excluded == (not member_q[0]), f"{prefix}: vLLM says excluded={excluded}"
        if member_q[0] and len(members) > 1:  # one weight_scale_2 / input_scale for the packed module
            for leaf in ("weight_scale_2", "input_scale"):
                assert len({ckpt.read_raw(ckpt.tensors[f"{m}.{leaf}"]) for m in members}) == 1, (prefix, leaf)
        checked += 1
    return checked


def _linears(ckpt: Checkpoint, mtp: bool) -> set[str]:
    return {
        n[: -len(".weight")]
        for n, e in ckpt.tensors.items()
        if n.endswith(".weight")
        and len(e.shape) == 2
        and is_mtp_name(n) == mtp
        and not n.startswith("model.visual.")
        and "embed_tokens" not in n
        and ".shard_" not in n
    }


@pytest.mark.parametrize("which", ["random", "trained"])
@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_exclusions_and_scales_as_vllm_loads_them(
    mode: str, which: str, vllm: SimpleNamespace, outputs: Callable[..., tuple[Path, ConvertResult]]
) -> None:
    out, _ = outputs(mode, which)
    ckpt = Checkpoint.open(out, strict=True)
    hfq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    exclusions = hfq["exclude_modules"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == exclusions
    main = _linears(ckpt, mtp=False)
    n = _check(ckpt, vllm, exclusions, vllm.main_packed, lambda p: p, main)
    assert n >= 20
    state = SimpleNamespace(exclude_modules=list(exclusions), packed_modules_mapping=vllm.main_packed)
    vllm.apply_vllm_mapper(state, _Identity())
    # the PLE n-gram table must match exclude_modules, or vLLM raises (ngram_embedding.py)
    assert vllm.is_layer_excluded(state, TABLE)
    layers = int(json.loads((out / "config.json").read_text())["text_config"]["num_hidden_layers"])
    mtp_modules = _linears(ckpt, mtp=True) | ({"mtp.layers.0.mlp.experts"} if mode == "quantize" else set())
    if mode == "keep":
        assert all(
            vllm.is_layer_excluded(
                SimpleNamespace(exclude_modules=vllm.remap(["mtp*"], layers), packed_modules_mapping=vllm.mtp_packed), m
            )
            for m in mtp_modules
        )
        return
    # quantize: the draft's exclusions remapped as vLLM remaps them (mtp.layers.0 -> mtp.layers.4)
    remapped = vllm.remap([e for e in exclusions if is_mtp_name(e)], layers)
    per_expert = {m for m in quantized(ckpt) if ".mlp.experts." in m}
    modules = (mtp_modules - {"mtp.layers.0.mlp.experts"}) - per_expert

    def engine(prefix: str) -> str:
        return str(vllm.remap([prefix], layers)[0])

    state = SimpleNamespace(exclude_modules=remapped, packed_modules_mapping=vllm.mtp_packed)
    q = quantized(ckpt)
    for prefix, members in _engine_modules(modules, vllm.mtp_packed).items():
        assert vllm.is_layer_excluded(state, engine(prefix)) == (members[0] not in q), prefix
    assert not vllm.is_layer_excluded(state, engine("mtp.layers.0.mlp.experts"))  # FusedMoE: quantized experts


# ---- capped memory ---------------------------------------------------------------------------------------------


def test_capped_is_the_in_memory_output(
    src: Path, outputs: Callable[..., tuple[Path, ConvertResult]], tmp_path: Path
) -> None:
    reference, _ = outputs("quantize")
    plan, _ = plan_convert(ConvertOptions(src=str(src), out=tmp_path / "unused", dry_run=True, device="cpu"))
    cap = f"cpu={int(plan.memory.model_bytes * 0.5)}"
    out = tmp_path / "capped"
    result = convert(ConvertOptions(src=str(src), out=out, mtp="quantize", max_memory=cap, **CALIB))
    assert result.layerwise and result.placement.get("disk", 0) > 0
    assert result.offload_bytes == 0  # the fused experts and the n-gram table are read from SRC, never re-saved
    a, b = Checkpoint.open(reference, strict=True), Checkpoint.open(out, strict=True)
    assert sorted(a.tensors) == sorted(b.tensors)
    assert [n for n in a.tensors if raw(a, n) != raw(b, n)] == []
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((reference / name).read_text()) == json.loads((out / name).read_text())


# ---- validate's built-in path ----------------------------------------------------------------------------------


def test_validate_keep_mtp_agrees_exactly_and_hidden_files_replay(
    src: Path, outputs: Callable[..., tuple[Path, ConvertResult]], tmp_path: Path
) -> None:
    import torch

    from mtpquant.measure.hidden import load_hidden
    from mtpquant.validate.run import ValidateOptions, validate

    keep, _ = outputs("keep")
    hidden = tmp_path / "hidden.safetensors"
    opts = ValidateOptions(
        reference=str(src),
        candidate=str(keep),
        num_prompts=3,
        max_len=40,
        device="cpu",
        progress=False,
        save_hidden=hidden,
    )
    report = validate(opts).report
    assert report.comparison is not None and report.comparison.mtp is not None
    mtp = report.comparison.mtp
    assert mtp.positions > 0 and mtp.top1_agreement == 1.0 and mtp.kl is not None and mtp.kl.max == 0.0
    assert report.comparison.main is not None and report.comparison.main.top1_agreement < 1.0  # NVFP4 target
    # the hidden file holds both streams: the LM head's [T, H] and the MTP's multi-stream [T, hc_count * H]
    runs, _ = load_hidden(hidden)
    seq = runs["ref"].sequences[0]
    assert seq.hidden.shape[-1] == 128 and seq.mtp_input is not None and seq.mtp_input.shape[-1] == 4 * 128
    assert not torch.equal(seq.mtp_input.unflatten(-1, (4, 128)).mean(-2), seq.hidden)
    replay = validate(
        ValidateOptions(reference=str(src), candidate=str(keep), hidden=hidden, device="cpu", progress=False)
    ).report
    assert replay.reference.acceptance == report.reference.acceptance
    assert replay.candidate is not None and report.candidate is not None
    assert replay.candidate.acceptance == report.candidate.acceptance


def test_quantized_mtp_of_the_trained_tiny_still_drafts(
    src: Path, outputs: Callable[..., tuple[Path, ConvertResult]]
) -> None:
    """--mtp quantize calibrated through the Qwen4-Exp MTP forward: on identical inputs the NVFP4 MTP mostly picks the
    BF16 MTP's token (not all: it is quantized), and its drafts are accepted about as often."""
    from mtpquant.validate.run import ValidateOptions, validate

    quant, _ = outputs("quantize", "trained")
    opts = ValidateOptions(
        reference=str(sources(src)["trained"]),
        candidate=str(quant),
        num_prompts=3,
        max_len=40,
        device="cpu",
        progress=False,
    )
    report = validate(opts).report
    assert report.comparison is not None and report.comparison.mtp is not None
    mtp = report.comparison.mtp
    assert mtp.positions > 0 and 0.8 <= mtp.top1_agreement < 1.0 and mtp.kl is not None and 0 < mtp.kl.mean < 0.05
    assert report.reference.acceptance is not None and report.candidate is not None
    assert report.candidate.acceptance is not None
    ref, cand = report.reference.acceptance.by_k[0], report.candidate.acceptance.by_k[0]
    assert ref.acceptance_rate >= 0.4 and abs(cand.acceptance_rate - ref.acceptance_rate) <= 0.15
    assert report.verdict.status != "fail"


def test_a_killed_layerwise_run_resumes_to_the_in_memory_output(
    src: Path, outputs: Callable[..., tuple[Path, ConvertResult]], tmp_path: Path
) -> None:
    """Layer-wise calibration SIGKILLed after layer 2 of 4 (a real process) resumes from layer 3 and writes what the
    one-pass in-memory convert writes, byte for byte (the kill helper is tests/test_convert_scale.py's)."""
    from tests.test_convert_scale import _killed_run, leftovers

    reference, _ = outputs("keep")
    out = tmp_path / "out"
    _killed_run(src, out, 1, "--resume-every", "1")
    result = convert(ConvertOptions(src=str(src), out=out, mtp="keep", layerwise=True, resume_every=1, **CALIB))
    assert result.resumed_from_layer == 2
    a, b = Checkpoint.open(reference, strict=True), Checkpoint.open(out, strict=True)
    assert sorted(a.tensors) == sorted(b.tensors)
    assert [n for n in a.tensors if raw(a, n) != raw(b, n)] == []
    assert json.loads((reference / "hf_quant_config.json").read_text()) == json.loads(
        (out / "hf_quant_config.json").read_text()
    )
    assert leftovers(out) == []
