"""The precision search's space from headers: the registry's MTP precision groups, the tensors and bytes of each
configuration (exactly what ``quantize_mtp`` writes for it), and which configurations the engines load.

The per-group quantizer is ``quantize_mtp(precision=...)``: with one precision for every group quantize mode
quantizes it writes the very bytes ``--mtp quantize`` writes (its modelopt differential is
``tests/test_convert_mtp_quantize.py``).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mtpquant.checkpoint.dtypes import tensor_bytes
from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.engine.loading import engine_modules, mtp_load_refusal
from mtpquant.families import FAMILIES, family, matches, resolve
from mtpquant.formats.quant_config import QuantMetadata
from mtpquant.mtp.quantize import per_expert_shapes, quantize_mtp
from mtpquant.search.space import Assignment, MtpSpace, engines_of
from mtpquant.synth.train import TINY_MTP_ASSETS

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]
VARIANTS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp")


def _source(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return {e.name: ckpt.read_tensor(e.name) for e in ckpt.mtp_tensors()}


def _amax(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A made-up calibration: every Linear saw inputs of amax 1 + its index / 10 (distinct per module)."""
    modules = linear_modules(per_expert_shapes({n: tuple(t.shape) for n, t in weights.items()}))
    return {m: torch.tensor(1.0 + i / 10) for i, m in enumerate(modules)}


def test_the_families_with_precision_groups() -> None:
    """--mtp auto and tune-mtp search the families whose groups the registry states (the Qwen families, and the
    appended-layer ones mtpquant converts: GLM-4.5, DeepSeek-V3/V3.2, GLM-5); the others are refused at plan time
    (``SearchMode.check``) until theirs are stated."""
    assert sorted(f.key for f in FAMILIES if f.mtp.groups) == [
        "deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa", "nemotron_h", "qwen3_5", "qwen3_5_moe", "qwen3_next",
        "qwen4_exp"]  # fmt: skip
    # MLA stays BF16, as in their main model; Nemotron-H's attention too (NVIDIA's Nemotron-3 NVFP4 releases)
    for key in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "nemotron_h"):
        assert [g.key for g in family(key).mtp.groups] == ["shared_expert", "experts"]
    assert [g.key for g in family("glm4_moe").mtp.groups] == ["attention", "shared_expert", "experts"]


@pytest.mark.parametrize("key", [f.key for f in FAMILIES if f.mtp.groups])
def test_every_quantizable_mtp_linear_is_in_one_group_with_its_packed_partners(key: str) -> None:
    """The registry's groups partition the MTP Linears engines build quantizable (routers and gates in none), and
    each packed or fused group of the engine (q/k/v, gate/up, the routed experts) lies in one precision group."""
    fam = family(key)
    layout = fam.mtp
    text = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "intermediate_size": 96, "num_experts": 4, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "hc_count": 2,
            "hc_lowrank": 8, "indexer_n_heads": 2,
            "indexer_kv_heads": 1, "indexer_head_dim": 32, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_hidden_layers": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "index_n_heads": 2, "index_head_dim": 32,
            "vocab_size": 64}  # fmt: skip
    modules = linear_modules(per_expert_shapes(layout.shapes(text, 1, layout.per_expert)))
    groups = {m: layout.group_of(m) for m in modules}
    for m, g in groups.items():
        hits = [x.key for x in layout.groups if matches(m, x.modules)]
        assert len(hits) <= 1, (m, hits)
        if g is None:  # only what engines never quantize, or what the family keeps BF16 beside the engine's rule
            assert m.endswith((".mlp.gate", ".shared_expert_gate")) or layout.is_unquantized(m), m
        elif layout.appended is not None:  # eh_proj, the router, the norms, an MLA: never in an appended layer's group
            assert not layout.is_unquantized(m), m
    for module in engine_modules(modules, fam.engine):
        assert len({groups[m] for m in module.members}) == 1, module
    # the Qwen families' input projection; an appended layer's eh_proj and Nemotron-H's stay BF16
    if layout.appended is None and key != "nemotron_h":
        assert [g.key for g in layout.groups][:2] == ["input", "attention"]
    assert {g.key for g in layout.groups} >= ({"shared_expert", "experts"} if fam.moe else {"mlp"})


@pytest.mark.parametrize("variant", VARIANTS)
def test_planned_table_is_what_quantize_mtp_writes(tiny_factory: Factory, variant: str) -> None:
    """For a sample of configurations (every group alone in each precision, all NVFP4, all FP8, a mix), the header
    table the space plans is exactly the tensors ``quantize_mtp`` writes plus the source tensors kept, dtype and
    shape, and the bytes are their sum."""
    ckpt = Checkpoint.open(tiny_factory(variant))
    source = _source(ckpt)
    space = MtpSpace(ckpt.spec.family, {e.name: e for e in ckpt.mtp_tensors()}, engines=())
    keys = space.group_keys
    samples = [space.bf16.with_group(g, p) for g in keys for p in ("fp8", "nvfp4")]
    samples += [Assignment.uniform(keys, "nvfp4"), Assignment.uniform(keys, "fp8")]
    samples.append(Assignment(keys, tuple(("nvfp4", "fp8", "bf16")[i % 3] for i in range(len(keys)))))  # type: ignore[arg-type]
    amax = _amax(source)
    for a in samples:
        result = quantize_mtp(source, amax, layout=ckpt.spec.family.mtp, precision=space.module_precision(a))
        written = dict(result.tensors)
        split = {p for pieces in space.split.values() for p in pieces}
        kept_split = [n for n in result.kept_tensors if n in split]
        for fused, pieces in space.split.items():
            if all(p in kept_split for p in pieces):  # BF16 experts stay the source's fused tensors
                written[fused] = source[fused]
        written |= {n: source[n] for n in result.kept_tensors if n in source}
        got = {n: (str(t.dtype), tuple(t.shape)) for n, t in written.items()}
        dtypes = {"torch.uint8": "U8", "torch.float8_e4m3fn": "F8_E4M3", "torch.float32": "F32",
                  "torch.bfloat16": "BF16"}  # fmt: skip
        planned = space.planned_table(a)
        assert {n: (dtypes[d], s) for n, (d, s) in got.items()} == {n: (t.dtype, t.shape) for n, t in planned.items()}
        assert space.nbytes(a) == sum(t.numel() * t.element_size() for t in written.values()), a.label


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_one_precision_for_every_quantized_group_writes_the_quantize_mode_bytes(fmt: str) -> None:
    """The per-group quantizer with the uniform assignment quantize mode makes (the input projection BF16, every
    other group ``fmt``) writes the same tensors, bit for bit, as ``quantize_mtp(fmt=...)``."""
    ckpt = Checkpoint.open(TINY_MTP_ASSETS["qwen3_5"])
    source = _source(ckpt)
    space = MtpSpace(ckpt.spec.family, {e.name: e for e in ckpt.mtp_tensors()})
    amax = _amax(source)
    a = Assignment.uniform(space.group_keys, fmt).with_group("input", "bf16")
    mixed = quantize_mtp(source, amax, layout=ckpt.spec.family.mtp, precision=space.module_precision(a))
    plain = quantize_mtp(source, amax, fmt, layout=ckpt.spec.family.mtp)
    assert mixed.fmt == plain.fmt == fmt and mixed.quantized_modules == plain.quantized_modules
    assert mixed.excluded_modules == plain.excluded_modules == ["mtp.fc"]
    assert sorted(mixed.tensors) == sorted(plain.tensors)
    for name, t in plain.tensors.items():
        assert tensor_bytes(t) == tensor_bytes(mixed.tensors[name]), name


def test_quantize_mtp_refuses_a_precision_it_does_not_know() -> None:
    source = _source(Checkpoint.open(TINY_MTP_ASSETS["qwen3_5"]))
    with pytest.raises(ValueError, match="'int4' is not one of bf16, nvfp4, fp8"):
        quantize_mtp(source, None, activations=False, precision={"mtp.fc": "int4"})
    with pytest.raises(ValueError, match=r"mtp\.nope, which is not an MTP Linear"):
        quantize_mtp(source, None, activations=False, precision={"mtp.nope": "fp8"})


def test_engines_load_what_the_space_declares() -> None:
    """The dense tiny MTP: vLLM loads every configuration (plain where the main model's NVFP4 declares it: the
    input projection BF16, every quantized group NVFP4; else MIXED_PRECISION); SGLang loads a quantized MTP only from
    MIXED_PRECISION and never a quantized ``mtp.fc``; ``any`` is what both load."""
    ckpt = Checkpoint.open(TINY_MTP_ASSETS["qwen3_5"])
    entries = {e.name: e for e in ckpt.mtp_tensors()}
    spaces = {e: MtpSpace(ckpt.spec.family, entries, engines=engines_of(e)) for e in ("vllm", "sglang", "any")}
    combos = itertools.product(("bf16", "fp8", "nvfp4"), repeat=3)
    every = [Assignment(("input", "attention", "mlp"), c) for c in combos]  # type: ignore[arg-type]
    vllm = spaces["vllm"]
    assert len(vllm.configurations()) == 27
    plain = [a.label for a in every if vllm.declaration(a).kind == "plain"]
    assert plain == [
        "input bf16, attention bf16, mlp bf16",
        "input bf16, attention bf16, mlp nvfp4",
        "input bf16, attention nvfp4, mlp bf16",
        "input bf16, attention nvfp4, mlp nvfp4",
    ]
    sglang = {a.label for a in spaces["sglang"].configurations()}
    assert sglang == {a.label for a in every if a["input"] == "bf16"}
    assert {a.label for a in spaces["any"].configurations()} == sglang
    assert spaces["sglang"].declaration(Assignment.uniform(("input", "attention", "mlp"), "bf16")).kind == "plain"
    assert spaces["sglang"].declaration(every[-1]).refusal == (
        "sglang builds mtp.fc unquantized (SGLang builds mtp.fc as a plain Linear), but it is NVFP4 on disk"
    )
    # the configurations come smallest first, and the all-NVFP4 MTP is the smallest vLLM loads
    sizes = [vllm.nbytes(a) for a in vllm.configurations()]
    assert sizes == sorted(sizes) and vllm.configurations()[0] == Assignment.uniform(vllm.group_keys, "nvfp4")


def test_load_rules_under_plain_nvfp4() -> None:
    """``mtp_load_refusal`` under a plain NVFP4 config: an FP8 module cannot be declared (vLLM loads it as NVFP4),
    and SGLang builds the whole MTP BF16, so a quantized module there does not load."""
    rules = family("qwen3_5").engine
    meta = QuantMetadata("modelopt", "NVFP4", 16, None, ("mtp.fc",))
    fp8 = {"mtp.fc": "BF16", "mtp.layers.0.self_attn.o_proj": "FP8"}
    assert mtp_load_refusal("vllm", fp8, meta, rules) == (
        "vllm loads mtp.layers.0.self_attn.o_proj as NVFP4 (not excluded), but it is FP8 on disk"
    )
    nvfp4 = {"mtp.fc": "BF16", "mtp.layers.0.self_attn.o_proj": "NVFP4"}
    assert mtp_load_refusal("vllm", nvfp4, meta, rules) is None
    assert "SGLang builds the MTP of a serialized modelopt_fp4 checkpoint in BF16" in str(
        mtp_load_refusal("sglang", nvfp4, meta, rules)
    )
    split = {"mtp.layers.0.self_attn.q_proj": "NVFP4", "mtp.layers.0.self_attn.k_proj": "BF16",
             "mtp.layers.0.self_attn.v_proj": "NVFP4"}  # fmt: skip
    assert "is one module, its members are stored as BF16, NVFP4" in str(mtp_load_refusal("vllm", split, meta, rules))


def test_full_size_bytes_from_the_config_alone() -> None:
    """The Qwen3-Next-80B-A3B MTP (a config, no weights): BF16 is its source size, NVFP4 everywhere about 0.28x."""
    config = json.loads(
        (Path(__file__).parent / "fixtures/real-layouts/Qwen3-Next-80B-A3B-Instruct_config.json").read_text()
    )
    spec = resolve(config)
    shapes = spec.expected_mtp_shapes()
    space = MtpSpace(spec.family, {n: ("BF16", s) for n, s in shapes.items()})
    bf16 = space.nbytes(space.bf16)
    assert bf16 == sum(2 * math.prod(s) for s in shapes.values())
    assert space.group_keys == ("input", "attention", "shared_expert", "experts")
    ratio = space.nbytes(Assignment.uniform(space.group_keys, "nvfp4")) / bf16
    assert 0.28 < ratio < 0.29  # 4.5 bits a weight (E2M1 + one E4M3 scale per 16) of 16, plus norms and router


def test_a_quantized_shared_expert_needs_its_routed_experts_quantized(tiny_factory: Factory) -> None:
    """Qwen3.5-MoE: vLLM resolves the routed experts of a MIXED_PRECISION config by any quantized_layers key below
    their parent, so a quantized shared expert beside BF16 routed experts builds the experts quantized: no declaration
    loads it (plain: the experts' per-expert exclusions do not exclude the fused module), and the space leaves it
    out; with the routed experts quantized too it loads, declared plain (the attention and input excluded by name)."""
    ckpt = Checkpoint.open(tiny_factory("qwen3_5_moe"))
    space = MtpSpace(ckpt.spec.family, {e.name: e for e in ckpt.mtp_tensors()}, engines=("vllm",))
    alone = space.bf16.with_group("shared_expert", "nvfp4")
    assert space.declaration(alone).kind is None
    assert "mtp.layers.0.mlp.experts" in str(space.declaration(alone).refusal)
    assert space.declaration(alone.with_group("experts", "nvfp4")).kind == "plain"
    assert alone not in space.configurations()


def test_a_group_the_recipe_excludes_stays_bf16(tiny_factory: Factory) -> None:
    """A recipe's ``quantization.exclude`` holds in the search as in ``--mtp quantize``: with the routed experts
    excluded (``*mlp.experts*``, how vLLM's CPU build, without an NVFP4 MoE kernel, is served) every configuration
    keeps the experts group BF16, the refusal names the excluded Linear, and the other groups are still searched."""
    ckpt = Checkpoint.open(tiny_factory("qwen3_5_moe"))
    mtp = {e.name: e for e in ckpt.mtp_tensors()}
    space = MtpSpace(ckpt.spec.family, mtp, engines=("vllm",), precisions=("nvfp4",), exclude=("*mlp.experts*",))
    found = space.configurations()
    assert {a["experts"] for a in found} == {"bf16"}
    assert sorted(a.label for a in found) == sorted(
        a.label for a in MtpSpace(ckpt.spec.family, mtp, engines=("vllm",), precisions=("nvfp4",)).configurations()
        if a["experts"] == "bf16"
    )
    assert len(found) == 4  # input and attention each BF16 / NVFP4; a quantized shared expert needs quantized experts
    assert space.refusal("experts", "nvfp4") == (
        f"{space.members['experts'][0]}: the recipe's quantization.exclude keeps it BF16"
    )
    assert space.refusal("experts", "bf16") is None and space.refusal("attention", "nvfp4") is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_group_bytes_add_up_to_the_mtp(tiny_factory: Factory, variant: str) -> None:
    """Every group's bytes in each precision (the report's and the card's group table) plus the tensors outside any
    group (norms, router, gates) are the MTP's bytes, for every configuration; a group in BF16 counts its source
    tensors, fused 3-D experts included (Qwen3.8-Flash-Next stores its MTP experts fused)."""
    ckpt = Checkpoint.open(tiny_factory(variant))
    space = MtpSpace(ckpt.spec.family, {e.name: e for e in ckpt.mtp_tensors()})
    rest = space.nbytes(space.bf16) - sum(space.group_bytes(g, "bf16") for g in space.group_keys)
    assert all(space.group_bytes(g, "bf16") > 0 for g in space.group_keys) and rest >= 0
    if space.split:  # the fused experts in BF16 are the source's tensors, byte for byte
        experts = next(g for g in space.group_keys if any(space.members[g][0] in p for ps in space.split.values()
                                                          for p in ps))  # fmt: skip
        assert space.group_bytes(experts, "bf16") == sum(ckpt.tensors[n].nbytes for n in space.split)
    for combo in itertools.product(space.precisions, repeat=len(space.group_keys)):
        a = Assignment(space.group_keys, combo)  # type: ignore[arg-type]
        assert space.nbytes(a) == rest + sum(space.group_bytes(g, a[g]) for g in space.group_keys), a.label
