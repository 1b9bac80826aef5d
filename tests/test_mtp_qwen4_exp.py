"""The Qwen4-Exp MTP forward (mtpquant/mtp/qwen4_exp.py) against two independent computations.

1. transformers' own ``Qwen4ExpTextDecoderLayer`` and ``Qwen4ExpTextGatedResidual`` run directly, with transformers'
   ``DynamicCache`` (its indexed layer keeps the indexer's keys) and a small QSA budget, so the indexer's top-k
   selection is exercised: the step's two streams are exactly the layer's output and the mixer's output.
2. A hand-written re-implementation of vLLM 0.32's two-stream step (``vllm/models/qwen4_exp/nvidia/mtp.py``
   ``Qwen4ExpMultiTokenPredictor.forward``, the decoder layer's delayed hyper-connection combine in nvidia/model.py
   288-361, ``GatedResidual`` in nvidia/hyperconnection.py and the torch semantics of nvidia/ops/hc.py), written in
   plain torch ops from those sources, for two chained draft steps, with and without
   ``index_share_for_mtp_iteration``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mtpquant.mtp.qwen4_exp import Qwen4ExpMtp, Qwen4ExpMtpCache

pytestmark = pytest.mark.dev

H, HC, RANK = 128, 4, 32
HEADS, KV, HD = 2, 1, 64
E, TOPK, INTER, SHARED = 4, 2, 64, 64
ROT = 16  # int(64 * 0.25)
THETA = 10_000_000.0
EPS = 1e-6

TEXT: dict[str, Any] = {
    "hidden_size": H,
    "num_hidden_layers": 4,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": HD,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": E,
    "num_experts_per_tok": TOPK,
    "moe_intermediate_size": INTER,
    "shared_expert_intermediate_size": SHARED,
    "vocab_size": 512,
    "hc_count": HC,
    "hc_lowrank": RANK,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 32,
    "indexer_budget": 8192,
    "indexer_compress_ratio": 4,
    "ple_layer_ids": [1],
    "ple_embed_dim": 32,
    "split_ngram_parts": 4,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 97,
    "rms_norm_eps": EPS,
    "hidden_act": "silu",
    "norm_topk_prob": True,
    "eos_token_id": 2,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": THETA,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "mtp_num_hidden_layers": 1,
}
# a budget of 2 blocks of 4 tokens: rows past 8 visible tokens attend to a selection, not to every earlier row
SMALL_BUDGET = {**TEXT, "indexer_budget": 8, "indexer_compress_ratio": 4}


def mtp_tensors(seed: int = 0) -> dict[str, Tensor]:
    """Random float32 ``mtp.*`` tensors in the checkpoint's names and shapes (norm weights non-zero)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen4ExpMtp(TEXT).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        scale = 0.1 if len(shape) == 1 else 1.0 / math.sqrt(shape[-1])
        out["mtp." + name] = torch.randn(shape, generator=g) * scale
    return out


@pytest.fixture(scope="module")
def tensors() -> dict[str, Tensor]:
    return mtp_tensors()


def inputs(batch: int, rows: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, rows, HC * H, generator=g), torch.randn(batch, rows, H, generator=g)


def test_names_are_the_checkpoints(tensors: dict[str, Tensor]) -> None:
    assert len(tensors) == 31  # the released MTP's 31 tensors (fused experts)
    assert {"mtp.fc_embedding.weight", "mtp.fc_hidden.weight", "mtp.pre_fc_norm_hidden.weight"} <= set(tensors)
    assert tuple(tensors["mtp.layers.0.mlp.experts.gate_up_proj"].shape) == (E, 2 * INTER, H)
    assert tuple(tensors["mtp.pre_fc_norm_hidden.weight"].shape) == (HC * H,)
    assert "mtp.hyper_connection_mixer.block_inject_weight.weight" not in tensors  # the mixer has no combine
    with pytest.raises(RuntimeError, match="Missing key"):
        Qwen4ExpMtp.from_state_dict(TEXT, 1, {k: v for k, v in tensors.items() if "o_proj" not in k})


# ---- 1. transformers' own decoder layer, run directly --------------------------------------------------------


def _transformers_reference(text: dict[str, Any], tensors: dict[str, Tensor]) -> tuple[Any, Any, Any, Any]:
    """transformers' decoder layer, final mixer, rotary embedding and a DynamicCache, on the MTP's weights."""
    from transformers import DynamicCache, Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (
        Qwen4ExpTextDecoderLayer,
        Qwen4ExpTextGatedResidual,
        Qwen4ExpTextRotaryEmbedding,
    )

    values = {k: v for k, v in text.items() if k != "mtp_num_hidden_layers"}
    one_layer = {"num_hidden_layers": 1, "layer_types": ["full_attention"], "ple_layer_ids": []}
    cfg = Qwen4ExpTextConfig(**{**values, **one_layer})
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    layer = Qwen4ExpTextDecoderLayer(cfg, 0)
    layer.load_state_dict({k[len("mtp.layers.0.") :]: v for k, v in tensors.items() if k.startswith("mtp.layers.0.")})
    mixer = Qwen4ExpTextGatedResidual(cfg, use_combine=False)
    mixer.load_state_dict(
        {k[len("mtp.hyper_connection_mixer.") :]: v for k, v in tensors.items() if "hyper_connection_mixer" in k}
    )
    return layer.eval(), mixer.eval(), Qwen4ExpTextRotaryEmbedding(cfg), DynamicCache(config=cfg)


def _gemma_norm(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w)


def _layer_input(tensors: dict[str, Tensor], hidden: Tensor, embeds: Tensor) -> Tensor:
    e = F.linear(_gemma_norm(embeds, tensors["mtp.pre_fc_norm_embedding.weight"]), tensors["mtp.fc_embedding.weight"])
    h = _gemma_norm(hidden, tensors["mtp.pre_fc_norm_hidden.weight"]).unflatten(-1, (HC, H))
    return (F.linear(h, tensors["mtp.fc_hidden.weight"]) + e.unsqueeze(-2)).flatten(-2)


@pytest.mark.parametrize("text", [TEXT, SMALL_BUDGET], ids=["all-selected", "indexer-selects"])
def test_step_is_transformers_decoder_layer_and_mixer(text: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    mtp = Qwen4ExpMtp.from_state_dict(text, 1, tensors)
    layer, mixer, rope, cache = _transformers_reference(text, tensors)
    B, T, split = 2, 20, 13
    hidden, embeds = inputs(B, T)
    x = _layer_input(tensors, hidden, embeds)
    positions = torch.arange(T)[None, None].expand(3, B, T)
    with torch.no_grad():
        # two calls through transformers' own cache: rows 0..split-1, then the rest attending to them
        outs = []
        for lo, hi in ((0, split), (split, T)):
            cos, sin = rope(x, positions[..., :hi])
            mask = (torch.arange(hi)[None, :] <= torch.arange(lo, hi)[:, None])[None, None].expand(B, 1, hi - lo, hi)
            outs.append(layer(x[:, lo:hi], position_embeddings=(cos, sin), attention_mask=mask, past_key_values=cache))
        multi = torch.cat(outs, dim=1)
        per_call = [mixer(o) for o in outs]  # the mixer on the same rows the step gets: the same computation
        whole = mixer(multi)  # the mixer on all 20 rows at once: the same arithmetic, blocked differently
        first = mtp(hidden[:, :split], embeds[:, :split])
        second = mtp(hidden[:, split:], embeds[:, split:], past=first.cache)
    assert torch.equal(torch.cat((first.next_hidden, second.next_hidden), 1), multi)
    assert torch.equal(first.out, per_call[0]) and torch.equal(second.out, per_call[1])
    # 20 rows against 13 + 7: float32 matmuls over 20 or 13/7 rows are blocked differently by the CPU's kernels and
    # are not bitwise equal on every CPU (an Intel Xeon here differs in the last bits). Each side's error against a
    # float64 evaluation of the same mixer is <= 1.5e-7 (measured; outputs up to 1.65 in magnitude, mean 0.32), so
    # atol 1e-5 (float32's default in assert_close) leaves 60x that margin while a wrong stream or weight moves
    # outputs by ~0.1.
    torch.testing.assert_close(torch.cat((first.out, second.out), 1), whole, rtol=1.3e-6, atol=1e-5)
    layer_cache = cache.layers[0]
    assert torch.equal(second.cache.key, layer_cache.keys) and torch.equal(second.cache.value, layer_cache.values)
    assert torch.equal(second.cache.index_key, layer_cache.indexer_keys)
    assert second.cache.positions.tolist() == [list(range(T))] * B
    allowed = int(text["indexer_budget"]) + int(text["indexer_compress_ratio"]) - 1
    visible = second.selection.sum(-1).flatten()
    if text is SMALL_BUDGET:  # the indexer kept at most its budget (plus the incomplete tail block) per row
        assert int(visible.max()) <= allowed and int(visible.min()) < split + 1
    else:
        assert visible.tolist() == [split + 1 + i for i in range(T - split)] * B


# ---- 2. vLLM's two-stream step, re-implemented by hand -------------------------------------------------------


def _rope(x: Tensor, pos: Tensor) -> Tensor:
    """Neox RoPE on the first ROT dims of x ``[B, T, heads, HD]`` at positions ``[B, T]`` (text-only M-RoPE)."""
    inv = 1.0 / THETA ** (torch.arange(0, ROT, 2).float() / ROT)
    freqs = pos.float()[..., None] * inv
    cos, sin = torch.cat((freqs, freqs), -1).cos()[:, :, None], torch.cat((freqs, freqs), -1).sin()[:, :, None]
    rot, rest = x[..., :ROT], x[..., ROT:]
    half = torch.cat((-rot[..., ROT // 2 :], rot[..., : ROT // 2]), -1)
    return torch.cat((rot * cos + half * sin, rest), -1)


class VllmStep:
    """vLLM's Qwen4ExpMultiTokenPredictor step written out: attention is the QSA over a selection of cached keys
    (every visible key when the sequence is shorter than the budget), keys/values kept per row."""

    def __init__(self, t: dict[str, Tensor]) -> None:
        self.t = t
        self.keys: list[Tensor] = []  # [B, KV, HD] per cached position (post norm + rope)
        self.values: list[Tensor] = []

    def w(self, name: str) -> Tensor:
        return self.t[f"mtp.{name}"]

    # nvidia/hyperconnection.py GatedResidual + ops/hc.py: grouped Gemma norm, silu(down / hc), sigmoid gate mean
    def combine_and_mix(
        self, prefix: str, hidden: Tensor, block: Tensor, injection: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        streams = hidden.unflatten(-1, (HC, H))
        weight = torch.ones(HC) if injection is None else 2.0 * torch.sigmoid(injection / HC)  # hc.py 317-323
        combined = (streams + block.unsqueeze(-2) * weight.unsqueeze(-1)).flatten(-2)
        grouped = combined.unflatten(-1, (HC, H))
        xn = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + EPS)).flatten(-2)
        xn = xn * (1.0 + self.w(f"{prefix}.hc_norm.weight"))
        lora = F.silu(F.linear(xn, self.w(f"{prefix}.input_mix_weight_down.weight")) / HC)
        inject_name = f"mtp.{prefix}.block_inject_weight.weight"
        new_injection = F.linear(xn, self.t[inject_name]) if inject_name in self.t else None
        gate = F.linear(lora, self.w(f"{prefix}.input_mix_weight_up.weight"))
        block_input = (torch.sigmoid(gate).unflatten(-1, (HC, H)) * xn.unflatten(-1, (HC, H))).mean(-2)
        return combined, block_input, new_injection

    def attention(self, x: Tensor, pos: Tensor, visible: list[list[int]]) -> Tensor:
        """x ``[1, 1, H]`` at ``pos``: appends its key/value, attends to the cached positions ``visible[0]``."""
        p = "layers.0.self_attn"
        qg = F.linear(x, self.w(f"{p}.q_proj.weight")).view(1, 1, HEADS, 2 * HD)
        q, gate = qg[..., :HD], qg[..., HD:].reshape(1, 1, HEADS * HD)
        q = _rope(_gemma_norm(q, self.w(f"{p}.q_norm.weight")), pos)
        k = F.linear(x, self.w(f"{p}.k_proj.weight")).view(1, 1, KV, HD)
        k = _rope(_gemma_norm(k, self.w(f"{p}.k_norm.weight")), pos)
        v = F.linear(x, self.w(f"{p}.v_proj.weight")).view(1, 1, KV, HD)
        self.keys.append(k[0, 0])
        self.values.append(v[0, 0])
        keys = torch.stack([self.keys[j] for j in visible[0]])  # [L, KV, HD]
        values = torch.stack([self.values[j] for j in visible[0]])
        group = HEADS // KV  # query head i reads KV head i // group
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # [L, HEADS, HD]
        probs = (torch.einsum("hd,lhd->hl", q[0, 0], keys) * HD**-0.5).softmax(-1)
        out = torch.einsum("hl,lhd->hd", probs, values)
        out = out.reshape(1, 1, HEADS * HD) * torch.sigmoid(gate)
        return F.linear(out, self.w(f"{p}.o_proj.weight"))

    def moe(self, x: Tensor) -> Tensor:
        p = "layers.0.mlp"
        probs = F.linear(x, self.w(f"{p}.gate.weight")).softmax(-1)
        weights, chosen = probs.topk(TOPK, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)  # renormalize = norm_topk_prob
        out = torch.zeros_like(x)
        for slot in range(TOPK):
            e = int(chosen.flatten()[slot])
            gate_up = F.linear(x, self.w(f"{p}.experts.gate_up_proj")[e])
            act = F.silu(gate_up[..., :INTER]) * gate_up[..., INTER:]
            out = out + F.linear(act, self.w(f"{p}.experts.down_proj")[e]) * weights.flatten()[slot]
        shared = F.linear(
            F.silu(F.linear(x, self.w(f"{p}.shared_expert.gate_proj.weight")))
            * F.linear(x, self.w(f"{p}.shared_expert.up_proj.weight")),
            self.w(f"{p}.shared_expert.down_proj.weight"),
        )
        return out + torch.sigmoid(F.linear(x, self.w(f"{p}.shared_expert_gate.weight"))) * shared

    def __call__(self, hidden: Tensor, embed: Tensor, pos: int, visible: list[int]) -> tuple[Tensor, Tensor]:
        """One token ``[1, 1, *]``: mtp.py 305-380; returns (sample [1,1,H], multi [1,1,HC*H])."""
        e = F.linear(_gemma_norm(embed, self.w("pre_fc_norm_embedding.weight")), self.w("fc_embedding.weight"))
        h = _gemma_norm(hidden, self.w("pre_fc_norm_hidden.weight")).view(1, 1, HC, H)
        h = F.linear(h, self.w("fc_hidden.weight")).flatten(-2)
        # model.py 319-324: a pending block (e) without injection, consumed by the attention hyper-connection
        h, block_input, inj = self.combine_and_mix("layers.0.attn_hyper_connection", h, e, None)
        attn = self.attention(block_input, torch.tensor([[pos]]), [visible])
        h, block_input, inj = self.combine_and_mix("layers.0.mlp_hyper_connection", h, attn, inj)
        mlp = self.moe(block_input)
        multi, sample, _ = self.combine_and_mix("hyper_connection_mixer", h, mlp, inj)  # mtp.py 364-368
        return sample, multi


@pytest.mark.parametrize("share", [False, True], ids=["own-selection", "index-share"])
def test_two_chained_steps_are_vllms(share: bool, tensors: dict[str, Tensor]) -> None:
    mtp = Qwen4ExpMtp.from_state_dict(TEXT, 1, tensors, index_share=share)
    T = 6
    hidden, embeds = inputs(1, T + 1, seed=3)
    vllm = VllmStep(tensors)
    with torch.no_grad():
        # step 0: the target's T rows (multi-stream hidden h_t, embedding of x_{t+1}); causal, all selected
        ref0 = [vllm(hidden[:, t : t + 1], embeds[:, t : t + 1], t, list(range(t + 1))) for t in range(T)]
        step0 = mtp(hidden[:, :T], embeds[:, :T])
        # step 1 from the last row: its multi stream and the next token's embedding, at position T
        draft_embed = embeds[:, T : T + 1]
        visible = list(range(T)) if share else list(range(T + 1))  # shared: step 0's selection for row T - 1
        ref1 = vllm(ref0[-1][1], draft_embed, T, visible)
        reuse = None
        if share:
            last_row = step0.selection[:, :, -1:]
            reuse = torch.cat((last_row, torch.zeros(1, 1, 1, 1, dtype=torch.bool)), dim=-1)
        step1 = mtp(step0.next_hidden[:, -1:], draft_embed, past=step0.cache, step=1, selection=reuse)
    torch.testing.assert_close(step0.out, torch.cat([s for s, _ in ref0], 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step0.next_hidden, torch.cat([m for _, m in ref0], 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step1.out, ref1[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step1.next_hidden, ref1[1], rtol=1e-5, atol=1e-5)
    assert step1.cache.length == T + 1  # the draft row's key is cached either way (the side cache keeps updating)
    assert bool(step1.selection[0, 0, 0, T]) is not share  # shared: the row does not see its own key


def test_the_multi_stream_is_what_the_next_step_reads(tensors: dict[str, Tensor]) -> None:
    # the two streams differ: feeding the collapsed one back (as a Qwen3.5 MTP would) is another computation
    mtp = Qwen4ExpMtp.from_state_dict(TEXT, 1, tensors)
    hidden, embeds = inputs(1, 4)
    with torch.no_grad():
        step = mtp(hidden, embeds)
        assert step.next_hidden.shape == (1, 4, HC * H) and step.out.shape == (1, 4, H)
        mean_stream = step.next_hidden.unflatten(-1, (HC, H)).mean(-2)
        assert not torch.allclose(mean_stream, step.out, atol=1e-3)
        with pytest.raises(ValueError, match=r"must be \[B, T, 512\]"):
            mtp(step.out, embeds)


def test_bf16_matches_float32(tensors: dict[str, Tensor]) -> None:
    bf = Qwen4ExpMtp.from_state_dict(TEXT, 1, tensors, dtype=torch.bfloat16)
    fp = Qwen4ExpMtp.from_state_dict(TEXT, 1, tensors)
    hidden, embeds = inputs(2, 8)
    with torch.no_grad():
        a = bf(hidden.bfloat16(), embeds.bfloat16())
        b = fp(hidden, embeds)
    assert a.out.dtype == torch.bfloat16 and isinstance(a.cache, Qwen4ExpMtpCache)
    torch.testing.assert_close(a.out.float(), b.out, rtol=0.05, atol=0.05)


# ---- drafting: the batched chains are the engines' chain from each row -----------------------------------------


@pytest.mark.parametrize(
    ("text", "share"),
    [(TEXT, False), (TEXT, True), (SMALL_BUDGET, False), (SMALL_BUDGET, True)],
    ids=["own", "shared", "indexer-selects-own", "indexer-selects-shared"],
)
def test_draft_rows_are_draft_chains(text: dict[str, Any], share: bool, tensors: dict[str, Tensor]) -> None:
    from mtpquant.mtp.drafting import draft_chain, draft_rows

    mtp = Qwen4ExpMtp.from_state_dict(text, 1, tensors, index_share=share)
    g = torch.Generator().manual_seed(5)
    vocab = 40
    table, head = torch.randn(vocab, H, generator=g), torch.randn(vocab, H, generator=g) / math.sqrt(H)
    hidden = torch.randn(1, 14, HC * H, generator=g)
    tokens = torch.randint(0, vocab, (1, 14), generator=g)

    def embed(x: Tensor) -> Tensor:
        return F.embedding(x, table)

    with torch.no_grad():
        teacher = mtp.step(hidden, embed(tokens))
    rows = range(9, 13)
    got = draft_rows(mtp, teacher, rows, embed, head, 3, chunk=3)
    for i, t in enumerate(rows):
        past = None
        if t:
            c = teacher.cache
            past = Qwen4ExpMtpCache(c.key[:, :, :t], c.value[:, :, :t], c.index_key[:, :t], c.positions[:, :t])
        want = draft_chain(mtp, hidden[:, t : t + 1], tokens[:, t : t + 1], embed, head, 3, past_kv=past)
        assert got[i].tolist() == want.tokens[0].tolist(), f"row {t}"
    # sharing changes what steps 2..k attend to: the same first step, other logits after it
    other = Qwen4ExpMtp.from_state_dict(text, 1, tensors, index_share=not share)
    a = draft_chain(mtp, hidden, tokens, embed, head, 3)
    b = draft_chain(other, hidden, tokens, embed, head, 3)
    assert torch.equal(a.logits[:, 0], b.logits[:, 0]) and torch.equal(a.tokens[:, :2], b.tokens[:, :2])
    assert not torch.allclose(a.logits[:, 1], b.logits[:, 1], atol=1e-3)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_loop_free_selection_is_transformers_where_every_key_fits(kind: str, tensors: dict[str, Tensor]) -> None:
    """``exact_selections``: where the visible keys fit the token budget, the selection is transformers' own, bit
    for bit (a bool or an additive float mask, rows that see fewer keys than a block included); past the budget it
    is transformers' forward itself."""
    from mtpquant.mtp.qwen4_exp import exact_selections

    for text, fits in ((TEXT, True), (SMALL_BUDGET, False)):
        mtp = Qwen4ExpMtp(text)
        mtp.load_state_dict({k.removeprefix("mtp."): v for k, v in tensors.items()})
        indexer = mtp.layers[0].self_attn.indexer
        B, T = 2, 13
        x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(3))
        cos, sin = mtp.rotary_emb(x, torch.arange(T)[None, None].expand(3, B, -1))
        visible = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T).clone()
        visible[1, :, :, :2] = False  # the second row's first keys masked (padding)
        mask = visible if kind == "bool" else torch.where(visible, 0.0, torch.finfo(torch.float32).min)
        expected = type(indexer).forward(indexer, x, (cos, sin), mask, None)
        assert exact_selections(mtp) == 1
        got = indexer.forward(x, (cos, sin), mask, None)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
        assert torch.equal(got, mask) == fits  # within the budget: every visible key, the mask itself
