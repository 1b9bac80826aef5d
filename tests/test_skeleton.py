"""Full-size skeleton checkpoints: real layout, sparse data, a faithful naive quant, and graft's O(MTP) bound."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open

from mtpquant.checkpoint.header import tensor_nbytes
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.report import inspect_checkpoint
from tests.support.layouts import expand_layout
from tests.support.skeleton import (
    Layout,
    assign_shards,
    find_layout,
    make_skeleton,
    modelopt_exclusions,
    plan_quant,
)

pytestmark = pytest.mark.dev

MISSING = "MTP declared but missing: speculative decoding will accept nothing"


def _rows(layout: Layout) -> list:
    return expand_layout(layout.table, json.loads(layout.config.read_text()))


def test_source_skeleton_has_real_layout_sparse_data_and_opens_clean(real_layouts: Path, tmp_path: Path) -> None:
    layout = find_layout("Qwen3.5-4B", real_layouts)
    rows = {r.name: r for r in _rows(layout)}
    result = make_skeleton(layout, tmp_path / "src")
    ckpt = Checkpoint.open(result.path, strict=True)  # headers valid, index complete, total_size right
    assert not ckpt.problems
    assert set(ckpt.tensors) == set(rows)  # 738 real names
    for name, entry in ckpt.tensors.items():
        assert (entry.dtype, entry.shape) == (rows[name].dtype, rows[name].shape)
        if rows[name].shard is not None:  # the table's shard wherever it names one (MTP included)
            assert entry.shard == rows[name].shard
    assert len(ckpt.mtp_tensors()) == 15
    assert {e.shard for e in ckpt.mtp_tensors()} == {f"model.safetensors-0000{i}-of-00002.safetensors" for i in (1, 2)}
    index = json.loads((result.path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == ckpt.total_bytes == result.total_bytes > 9 * 10**9
    # sparse: 9.3 GB of logical tensor data, well under a megabyte of allocated blocks
    allocated = sum(p.stat().st_blocks * 512 for p in result.path.iterdir())
    assert allocated < 2 * 10**6 and result.file_bytes > 9 * 10**9
    # the safetensors library itself reads it (holes read as zeros)
    shard = result.path / "model.safetensors-00001-of-00002.safetensors"
    with safe_open(str(shard), "pt") as fh:
        t = fh.get_tensor("mtp.layers.0.mlp.up_proj.weight")
    assert tuple(t.shape) == (9216, 2560) and not t.any()
    report = inspect_checkpoint(result.path)
    assert report.healthy and report.verdicts["vllm"] == "vLLM: MTP loads (BF16)"


@pytest.mark.slow
def test_multi_file_rows_are_balanced_and_mtp_shard_stays_mtp_only(real_layouts: Path) -> None:
    rows = _rows(find_layout("Qwen3-Next-80B-A3B-Instruct", real_layouts))
    tensors = assign_shards(rows)
    assert len(tensors) == 75944 and assign_shards(rows) == tensors  # all of them, deterministic
    sizes: dict[str, int] = defaultdict(int)
    names: dict[str, set[str]] = defaultdict(set)
    for t in tensors:
        sizes[t.shard] += t.nbytes
        names[t.shard].add(t.name)
    assert len(sizes) == 41
    last = "model-00041-of-00041.safetensors"
    assert all(n.startswith("mtp.") for n in names[last]) and len(names[last]) == 1553
    assert "model.embed_tokens.weight" in names["model-00001-of-00041.safetensors"]
    assert "lm_head.weight" in names["model-00040-of-00041.safetensors"]
    others = [s for shard, s in sizes.items() if shard != last]
    mean = sum(others) / len(others)
    assert max(others) - min(others) < 0.05 * mean  # within a few experts of each other
    # layers are laid out in order: a layer's experts sit in one shard or two neighbours
    layer_shards: dict[int, set[int]] = defaultdict(set)
    for t in tensors:
        m = re.match(r"model\.layers\.(\d+)\.", t.name)
        if m:
            layer_shards[int(m.group(1))].add(int(t.shard[6:11]))
    assert all(max(s) - min(s) <= 1 for s in layer_shards.values())


@pytest.mark.slow
def test_quant_plan_exports_fused_experts_per_expert_in_nvfp4(real_layouts: Path) -> None:
    config, hfq, tensors = plan_quant(find_layout("Qwen3.5-35B-A3B", real_layouts))
    t = {x.name: (x.dtype, x.shape) for x in tensors}
    p = "model.language_model.layers.0.mlp."
    assert not any(n.startswith("mtp.") for n in t) and p + "experts.gate_up_proj" not in t
    assert t[p + "experts.255.gate_proj.weight"] == ("U8", (512, 1024))  # [I, H/2] from gate_up_proj [E, 2I, H]
    assert t[p + "experts.255.down_proj.weight"] == ("U8", (2048, 256))  # [H, I/2]
    assert t[p + "experts.0.down_proj.weight_scale"] == ("F8_E4M3", (2048, 32))
    assert t[p + "experts.0.up_proj.weight_scale_2"] == t[p + "experts.0.up_proj.input_scale"] == ("F32", ())
    assert t[p + "gate.weight"][0] == "BF16" and t["model.visual.blocks.0.attn.qkv.weight"][0] == "BF16"
    assert config["text_config"]["mtp_num_hidden_layers"] == 1  # still declared
    assert config["quantization_config"]["ignore"] == hfq["quantization"]["exclude_modules"]
    assert "model.visual*" in hfq["quantization"]["exclude_modules"]
    assert {x.shard for x in tensors} == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}


def test_exclusion_summary_follows_modelopt_prefix_wildcards() -> None:
    unq = ["lm_head", "model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc1", "model.layers.0.mlp.gate"]
    q = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj"]
    # `model.layers.0.mlp.gate*` would also match gate_proj, so the exact name is kept
    assert modelopt_exclusions(unq, q) == ["lm_head", "model.layers.0.mlp.gate", "model.visual*"]
    assert modelopt_exclusions(["a.b.c", "a.b.d"], ["a.x"]) == ["a.b*"]
    # `ab*` would match `abc.d`; modelopt then emits `ab.*` for ab.c and the exact `ab` for ab
    assert modelopt_exclusions(["ab.c", "ab"], ["abc.d"]) == ["ab", "ab.*"]


@pytest.mark.slow
def test_exclusion_summary_equals_modelopt_on_random_module_sets() -> None:
    import random

    from modelopt.torch.export.quant_utils import _prefix_wildcard_summarize_exclude_modules as reference

    rng = random.Random(0)
    parts = ["a", "ab", "b", "mlp", "gate", "gate_proj", "0", "1", "10", "visual"]
    for _ in range(500):
        names = sorted({".".join(rng.choice(parts) for _ in range(rng.randint(1, 4))) for _ in range(8)})
        rng.shuffle(names)
        k = rng.randint(0, len(names))
        assert modelopt_exclusions(names[:k], names[k:]) == sorted(reference(names[:k], names[k:]))


def _layout_table(ckpt: Checkpoint, path: Path) -> Path:
    """A weights table in the real-layouts format, one uncompressed row per tensor of ``ckpt``."""
    names = {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}
    lines = ["| name | shape | dtype | size | file |", "| --- | --- | --- | --- | --- |"]
    for name, e in sorted(ckpt.tensors.items()):
        shape = ", ".join(map(str, e.shape))
        lines.append(f"| `{name}` | `[{shape}]` | `torch.{names[e.dtype]}` | {e.nbytes} B | {e.shard} |")
    path.write_text("\n".join(lines) + "\n")
    return path


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    ckpt = Checkpoint.open(path)
    return {n: (e.dtype, e.shape) for n, e in ckpt.tensors.items()}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5-tied", "qwen3_5_moe", "qwen3_next"])
def test_quant_plan_matches_a_real_modelopt_export(
    tiny_factory: Callable[[str], Path], naive_export_factory: Callable[[str], Path], tmp_path: Path, variant: str
) -> None:
    """Same tensors (names, dtypes, shapes) and metadata as modelopt's own export of the same model."""
    src = tiny_factory(variant)
    ckpt = Checkpoint.open(src)
    table = _layout_table(ckpt, tmp_path / "tiny_weights_table.md")
    config, hfq, tensors = plan_quant(Layout("tiny", table, src / "config.json"))
    real = naive_export_factory(variant)
    real_tensors = _header(real)
    bf16_planned = {t.name: (t.dtype, t.shape) for t in tensors}
    # modelopt casts the whole model to the load dtype; the plan keeps each source tensor's dtype
    assert {n: v[1] for n, v in bf16_planned.items()} == {n: v[1] for n, v in real_tensors.items()}
    assert {n for n, v in bf16_planned.items() if v[0] != real_tensors[n][0]} <= {
        n for n, e in ckpt.tensors.items() if e.dtype != "BF16"
    }
    real_hfq = json.loads((real / "hf_quant_config.json").read_text())
    assert hfq == real_hfq
    real_qc = json.loads((real / "config.json").read_text())["quantization_config"]
    assert config["quantization_config"] == real_qc
    assert json.dumps(config["quantization_config"]) == json.dumps(real_qc)  # key order too


def _io() -> dict[str, int]:
    text = Path("/proc/self/io").read_text()
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
@pytest.mark.parametrize("mode", ["out", "in-place"])
def test_graft_into_skeleton_quant_writes_only_the_mtp(real_layouts: Path, tmp_path: Path, mode: str) -> None:
    """O(MTP): grafting 41 MB of MTP into a 1 GB quant writes the MTP plus metadata, never the rest."""
    from mtpquant.graft import run as graft_mod

    layout = find_layout("Qwen3.5-0.8B-Base", real_layouts)
    src = make_skeleton(layout, tmp_path / "src", mtp_data="random")
    quant = make_skeleton(layout, tmp_path / "quant", quant=True)
    before = {p.name: (p.stat().st_ino, p.stat().st_size) for p in quant.path.iterdir()}
    rest = sum(size for _, size in before.values())
    assert rest > 20 * src.mtp_bytes  # the part graft must not touch dwarfs the MTP
    out = tmp_path / "out"
    opts = (
        graft_mod.GraftOptions(quant=quant.path, source=src.path, out=out)
        if mode == "out"
        else graft_mod.GraftOptions(quant=quant.path, source=src.path, in_place=True)
    )
    io0 = _io()
    result = graft_mod.graft(opts)
    io1 = _io()
    dest = out if mode == "out" else quant.path
    wrote = io1["wchar"] - io0["wchar"]  # every byte this process handed to write(2) during graft
    metadata = sum((dest / n).stat().st_size for n in (INDEX_NAME, "config.json", "hf_quant_config.json"))
    assert src.mtp_bytes <= wrote <= src.mtp_bytes + metadata + 256 * 1024
    assert result.mtp_bytes == src.mtp_bytes and result.bytes_written <= wrote
    # the pre-existing tensor file is the same inode (hard link / untouched), not a copy
    assert (dest / "model.safetensors").stat().st_ino == before["model.safetensors"][0]
    # and it reads no more than the MTP (source + read-back verification) plus headers, not the rest
    assert io1["rchar"] - io0["rchar"] < 3 * src.mtp_bytes + 16 * 10**6
    report = inspect_checkpoint(dest)
    assert report.mtp_present_tensors == 15 and report.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    assert tensor_nbytes("BF16", (1024, 2048)) <= src.largest_mtp_tensor


def test_quant_skeleton_is_the_declared_but_missing_case(real_layouts: Path, tmp_path: Path) -> None:
    layout = find_layout("Qwen3.5-4B", real_layouts)
    result = make_skeleton(layout, tmp_path / "quant", quant=True)
    ckpt = Checkpoint.open(result.path, strict=True)
    assert not ckpt.mtp_tensors() and ckpt.spec.mtp.declared
    assert "lm_head.weight" not in ckpt.tensors  # tied, like the real 4B
    w = ckpt.tensors["model.language_model.layers.3.self_attn.q_proj.weight"]
    assert (w.dtype, w.shape) == ("U8", (8192, 1280))
    assert sum(p.stat().st_blocks * 512 for p in result.path.iterdir()) < 2 * 10**6
    report = inspect_checkpoint(result.path)
    assert report.verdicts == {
        "vllm": f"vLLM: {MISSING}",
        "sglang": f"SGLang: {MISSING}",
        "trtllm": f"TensorRT-LLM: {MISSING}",
    }
    assert [f.category for f in report.failures] == ["declared_missing"]  # exclusions agree with tensors
    assert report.main_model.quantized == 200 and report.main_model.inconsistent_modules == []
    assert report.quantization.algorithm == "NVFP4" and "lm_head" in report.quantization.exclude
    assert os.path.exists(result.path / "hf_quant_config.json")


@pytest.mark.slow
def test_normal_skeleton_is_a_full_size_model_with_real_weights_and_a_tokenizer(
    real_layouts: Path, tmp_path: Path
) -> None:
    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.text.calibration import load_tokenizer

    result = make_skeleton(find_layout("Qwen3.5-0.8B", real_layouts), tmp_path / "src", mtp_data="normal")
    ckpt = Checkpoint.open(result.path, strict=True)
    for shard in result.shards:  # every byte is on disk: no holes
        st = (result.path / shard).stat()
        assert st.st_blocks * 512 >= st.st_size
    layer0 = "model.language_model.layers.0."
    for name in (f"{layer0}mlp.down_proj.weight", f"{layer0}linear_attn.A_log", "mtp.fc.weight"):
        t = ckpt.read_tensor(name).float()
        assert ckpt.tensors[name].dtype == {"A_log": "F32"}.get(name.rsplit(".", 1)[-1], "BF16")
        assert float((t != 0).float().mean()) > 0.999, name  # data, not holes
        if t.numel() > 10_000:  # random-normal, std 0.02
            assert abs(float(t.std()) - 0.02) < 0.0005 and abs(float(t.mean())) < 0.0005, name
    tokenizer = load_tokenizer(result.path)
    ids = tokenizer("def main():\n    return 0")["input_ids"]
    assert 0 < max(ids) < ckpt.spec.text["vocab_size"]
