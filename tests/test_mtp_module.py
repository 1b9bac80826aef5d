"""MtpLayer against an independent, loop-by-loop implementation of the MTP spec (and transformers)."""

from __future__ import annotations

import math

import pytest
import torch

from mtpquant.mtp import (
    KVCache,
    MtpConfig,
    MtpLayer,
    MtpLayoutError,
    draft_chain,
    draft_rows,
    mtp_logits,
    mtp_tensor_shapes,
    teacher_forced,
)
from mtpquant.mtp.step import MtpStep

pytestmark = pytest.mark.dev

# --------------------------------------------------------------------------------------------
# Independent reference: plain float32, per token / per head loops, checkpoint names, no shared code.
# --------------------------------------------------------------------------------------------


def ref_norm(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean() + eps) * (1.0 + w)


def ref_rope(vec, pos, rot, theta):
    """Rotate pairs (i, i + rot/2) of the first rot dims by angle pos * theta^(-2i/rot)."""
    half = rot // 2
    angle = float(pos) * theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / rot)
    cos, sin = torch.cos(angle).float(), torch.sin(angle).float()
    a, b = vec[:half], vec[half:rot]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, vec[rot:]])


def ref_mlp(W, prefix, x):
    g = W[prefix + "gate_proj.weight"] @ x
    u = W[prefix + "up_proj.weight"] @ x
    return W[prefix + "down_proj.weight"] @ (g * torch.sigmoid(g) * u)


def ref_mtp(W, c, hidden, emb, positions):
    """hidden, emb [B, T, H]; positions: list of T ints. Returns post-mtp.norm output [B, T, H]."""
    L = "mtp.layers.0."
    nh, nkv, hd, eps = c["heads"], c["kv_heads"], c["head_dim"], c["eps"]
    rot, theta = c["rot"], c["theta"]
    B, T, H = hidden.shape
    out = torch.zeros(B, T, H)
    for b in range(B):
        z, qs, gs, ks, vs = [], [], [], [], []
        for t in range(T):
            e = ref_norm(emb[b, t], W["mtp.pre_fc_norm_embedding.weight"], eps)
            h = ref_norm(hidden[b, t], W["mtp.pre_fc_norm_hidden.weight"], eps)
            zt = W["mtp.fc.weight"] @ torch.cat([e, h])
            z.append(zt)
            x = ref_norm(zt, W[L + "input_layernorm.weight"], eps)
            qg = W[L + "self_attn.q_proj.weight"] @ x
            kk = W[L + "self_attn.k_proj.weight"] @ x
            vv = W[L + "self_attn.v_proj.weight"] @ x
            q_heads, g_heads, k_heads, v_heads = [], [], [], []
            for head in range(nh):
                block = qg[head * 2 * hd : (head + 1) * 2 * hd]
                q = ref_norm(block[:hd], W[L + "self_attn.q_norm.weight"], eps)
                q_heads.append(ref_rope(q, positions[t], rot, theta))
                g_heads.append(block[hd:])
            for g in range(nkv):
                k = ref_norm(kk[g * hd : (g + 1) * hd], W[L + "self_attn.k_norm.weight"], eps)
                k_heads.append(ref_rope(k, positions[t], rot, theta))
                v_heads.append(vv[g * hd : (g + 1) * hd])
            qs.append(q_heads)
            gs.append(g_heads)
            ks.append(k_heads)
            vs.append(v_heads)
        for t in range(T):
            heads_out = []
            for head in range(nh):
                g = head // (nh // nkv)
                scores = torch.stack([qs[t][head] @ ks[j][g] / math.sqrt(hd) for j in range(t + 1)])
                p = torch.exp(scores - scores.max())
                p = p / p.sum()
                o = sum(p[j] * vs[j][g] for j in range(t + 1))
                heads_out.append(o * torch.sigmoid(gs[t][head]))
            r = z[t] + W[L + "self_attn.o_proj.weight"] @ torch.cat(heads_out)
            y = ref_norm(r, W[L + "post_attention_layernorm.weight"], eps)
            if "experts" in c:
                logits = W[L + "mlp.gate.weight"] @ y
                probs = torch.exp(logits - logits.max())
                probs = probs / probs.sum()
                order = sorted(range(c["experts"]), key=lambda i: -float(probs[i]))[: c["top_k"]]
                total = sum(float(probs[i]) for i in order)
                m = torch.zeros(H)
                for i in order:
                    m = m + (probs[i] / total) * ref_mlp(W, f"{L}mlp.experts.{i}.", y)
                sg = W[L + "mlp.shared_expert_gate.weight"] @ y
                m = m + torch.sigmoid(sg) * ref_mlp(W, L + "mlp.shared_expert.", y)
            else:
                m = ref_mlp(W, L + "mlp.", y)
            out[b, t] = ref_norm(r + m, W["mtp.norm.weight"], eps)
    return out


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------

DENSE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 96,
    "vocab_size": 50,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25},
}
MOE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "vocab_size": 50,
    "rms_norm_eps": 1e-6,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "norm_topk_prob": True,
}


def ref_cfg(raw):
    c = {"heads": 4, "kv_heads": 2, "head_dim": 256, "eps": 1e-6, "rot": 64, "theta": 10000.0}
    if "num_experts" in raw:
        c.update(experts=raw["num_experts"], top_k=raw["num_experts_per_tok"])
    return c


def random_weights(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in mtp_tensor_shapes(cfg).items():
        if len(shape) == 1:
            weights[name] = torch.randn(shape, generator=gen) * 0.1
        else:
            weights[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    return weights


def inputs(B, T, H, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, generator=gen), torch.randn(B, T, H, generator=gen)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.fixture(params=["dense", "moe"])
def case(request):
    raw = DENSE if request.param == "dense" else MOE
    cfg = MtpConfig.from_text_config(raw)
    weights = random_weights(cfg, seed=1 if request.param == "dense" else 2)
    return raw, cfg, weights, MtpLayer.from_state_dict(cfg, weights)


# --------------------------------------------------------------------------------------------
# Forward equality
# --------------------------------------------------------------------------------------------


def test_forward_matches_independent_reference(case):
    raw, _cfg, weights, layer = case
    hidden, emb = inputs(2, 7, 64, seed=3)
    positions = [5 + 37 * t for t in range(7)]  # large, uneven positions exercise RoPE
    out, cache = layer(hidden, emb, torch.tensor(positions))
    close(out, ref_mtp(weights, ref_cfg(raw), hidden, emb, positions))
    assert cache.length == 7
    assert cache.key.shape == (2, 2, 7, 256)


def test_moe_routes_to_several_experts():
    cfg = MtpConfig.from_text_config(MOE)
    layer = MtpLayer.from_state_dict(cfg, random_weights(cfg, 2))
    hidden, emb = inputs(2, 7, 64, seed=3)
    seen = set()
    for e, expert in enumerate(layer.layers[0].mlp.experts):
        expert.register_forward_hook(lambda *_, e=e: seen.add(e))
    layer(hidden, emb)
    assert len(seen) >= 3  # the test above compares real routing, not one expert
    # modelopt's moe_calib_experts_ratio raises gate.top_k during calibration: forward obeys it.
    gate = layer.layers[0].mlp.gate
    assert (gate.top_k, gate.num_experts) == (2, 6)
    seen.clear()
    gate.top_k = 6
    layer(hidden[:, :1], emb[:, :1])
    assert seen == set(range(6))


def test_positions_default_and_shapes(case):
    _, _, _, layer = case
    hidden, emb = inputs(2, 5, 64, seed=4)
    a, _ = layer(hidden, emb)
    b, _ = layer(hidden, emb, torch.arange(5))
    c, _ = layer(hidden, emb, torch.arange(5)[None].expand(2, 5))
    close(a, b, 0)
    close(a, c, 0)
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        layer(hidden, emb[:, :4])


def test_kv_cache_incremental_equals_full(case):
    _, _, _, layer = case
    hidden, emb = inputs(2, 8, 64, seed=5)
    full, full_cache = layer(hidden, emb)
    parts = []
    out, cache = layer(hidden[:, :3], emb[:, :3])
    parts.append(out)
    out, cache = layer(hidden[:, 3:5], emb[:, 3:5], past_kv=cache)  # two rows over a prefix
    parts.append(out)
    for t in range(5, 8):
        out, cache = layer(hidden[:, t : t + 1], emb[:, t : t + 1], past_kv=cache)
        parts.append(out)
    close(torch.cat(parts, dim=1), full)
    close(cache.key, full_cache.key)
    close(cache.value, full_cache.value)


def test_cache_is_not_modified():
    cfg = MtpConfig.from_text_config(DENSE)
    layer = MtpLayer.from_state_dict(cfg, random_weights(cfg, 1))
    hidden, emb = inputs(1, 4, 64, seed=6)
    _, cache = layer(hidden[:, :3], emb[:, :3])
    key = cache.key.clone()
    layer(hidden[:, 3:], emb[:, 3:], past_kv=cache)
    assert torch.equal(cache.key, key)
    assert isinstance(cache, KVCache)


# --------------------------------------------------------------------------------------------
# Teacher-forced and chained drafting
# --------------------------------------------------------------------------------------------


def test_teacher_forced_logits(case):
    raw, _cfg, weights, layer = case
    gen = torch.Generator().manual_seed(7)
    embed = torch.nn.Embedding(50, 64)
    embed.weight.data = torch.randn(50, 64, generator=gen)
    lm_head = torch.randn(50, 64, generator=gen)
    hidden = torch.randn(2, 6, 64, generator=gen)
    tokens = torch.randint(0, 50, (2, 6), generator=gen)
    result = teacher_forced(layer, hidden, tokens, embed, lm_head)
    expected_m = ref_mtp(weights, ref_cfg(raw), hidden, embed(tokens).detach(), list(range(6)))
    close(result.mtp_out, expected_m)
    close(result.logits, expected_m @ lm_head.T, 1e-4)
    assert result.step.cache.length == 6


def _drafting_inputs(seed, batch, length):
    """An embedding function over a random 50-token table, a random head, hidden states and tokens."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(50, 64, generator=gen)
    lm_head = torch.randn(50, 64, generator=gen)
    hidden = torch.randn(batch, length, 64, generator=gen)
    tokens = torch.randint(0, 50, (batch, length), generator=gen)

    def embed(ids):
        return table[ids]

    return embed, lm_head, hidden, tokens


def test_draft_chain_feeds_own_output_and_argmax(case):
    raw, _cfg, weights, layer = case
    embed, lm_head, hidden, tokens = _drafting_inputs(8, 2, 4)

    seen_hidden, seen_embeds = [], []
    layer.pre_fc_norm_hidden.register_forward_pre_hook(lambda _m, a: seen_hidden.append(a[0].clone()))
    layer.pre_fc_norm_embedding.register_forward_pre_hook(lambda _m, a: seen_embeds.append(a[0].clone()))

    # A prefix of 3 rows already in the cache, then the newest row drafts 3 tokens.
    _, cache = layer(hidden[:, :3], embed(tokens[:, :3]))
    result = draft_chain(layer, hidden[:, 3:], tokens[:, 3:], embed, lm_head, k=3, past_kv=cache)
    assert result.tokens.shape == (2, 3)
    assert result.logits.shape == (2, 3, 50)
    assert result.past_kv.length == 6

    # Hand-built chain with the independent reference: each step appends (m_j, argmax_j) as a row.
    rc = ref_cfg(raw)
    seq_h, seq_x = hidden, tokens
    for j in range(3):
        n = seq_h.shape[1]
        m = ref_mtp(weights, rc, seq_h, embed(seq_x), list(range(n)))[:, -1:]
        logits = m @ lm_head.T
        close(result.mtp_out[:, j : j + 1], m)
        close(result.logits[:, j : j + 1], logits, 1e-4)
        token = logits.argmax(-1)
        assert torch.equal(result.tokens[:, j : j + 1], token)
        seq_h, seq_x = torch.cat([seq_h, m], 1), torch.cat([seq_x, token], 1)

    # Step 2's inputs are step 1's post-norm output and the embedding of its argmax.
    step_hidden, step_embeds = seen_hidden[1:], seen_embeds[1:]  # [0] is the prefix pass
    assert torch.equal(step_hidden[1], result.mtp_out[:, 0:1])
    assert torch.equal(step_embeds[1], embed(result.tokens[:, 0:1]))
    assert torch.equal(step_hidden[2], result.mtp_out[:, 1:2])


@pytest.mark.parametrize("chunk", [4, 64])
def test_draft_rows_are_the_chains_from_each_row(case, chunk):
    """Batched over rows (own prefix and chain by mask, chunked), the drafts are draft_chain's from each row."""
    _raw, _cfg, _weights, layer = case
    embed, lm_head, hidden, tokens = _drafting_inputs(9, 1, 12)
    with torch.no_grad():
        teacher = layer.step(hidden, embed(tokens))
    rows = range(2, 11)
    got = draft_rows(layer, teacher, rows, embed, lm_head, 3, chunk=chunk)
    assert got.shape == (len(rows), 3)
    cache = teacher.cache
    for i, t in enumerate(rows):
        past = KVCache(cache.key[:, :, :t], cache.value[:, :, :t]) if t else None
        want = draft_chain(layer, hidden[:, t : t + 1], tokens[:, t : t + 1], embed, lm_head, 3, past_kv=past)
        assert got[i].tolist() == want.tokens[0].tolist(), f"row {t}"
    assert draft_rows(layer, teacher, range(0), embed, lm_head, 3).shape == (0, 3)
    with pytest.raises(ValueError, match="batch 1"):
        draft_rows(layer, MtpStep(*(x.expand(2, -1, -1) for x in (teacher.out, teacher.next_hidden)), cache), rows,
                   embed, lm_head, 3)


def test_draft_chain_rejects_k0():
    cfg = MtpConfig.from_text_config(DENSE)
    layer = MtpLayer.from_state_dict(cfg, random_weights(cfg, 1))
    with pytest.raises(ValueError, match="k must be"):
        draft_chain(
            layer,
            torch.zeros(1, 1, 64),
            torch.zeros(1, 1, dtype=torch.long),
            torch.zeros,
            torch.zeros(50, 64),
            0,
        )


def test_mtp_logits_uses_head_dtype():
    m = torch.randn(2, 3, 8)
    w = torch.randn(5, 8)
    close(mtp_logits(m, w), m @ w.T)
    assert mtp_logits(m, w.bfloat16()).dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# bfloat16
# --------------------------------------------------------------------------------------------


def test_bfloat16_weights(case):
    _, cfg, weights, layer32 = case
    layer16 = MtpLayer.from_state_dict(cfg, weights, dtype=torch.bfloat16)
    hidden, emb = inputs(2, 5, 64, seed=9)
    out16, cache = layer16(hidden, emb)  # float32 inputs are normalised, then cast
    out32, _ = layer32(hidden, emb)
    assert out16.dtype == torch.bfloat16 and cache.key.dtype == torch.bfloat16
    assert (out16.float() - out32).abs().max() < 0.1
    out16b, _ = layer16(hidden.bfloat16(), emb.bfloat16())
    assert out16b.dtype == torch.bfloat16


def test_norm_computed_in_float32():
    cfg = MtpConfig.from_text_config(DENSE)
    layer = MtpLayer.from_state_dict(cfg, random_weights(cfg, 1), dtype=torch.bfloat16)
    x = torch.randn(3, 64).bfloat16() * 50
    w = layer.norm.weight
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.float())).bfloat16()
    assert torch.equal(layer.norm(x), expected)


# --------------------------------------------------------------------------------------------
# Names, shapes, config
# --------------------------------------------------------------------------------------------

# Qwen3.5-0.8B-Base, from its published weights table.
QWEN35_08B_MTP = {
    "mtp.fc.weight": (1024, 2048),
    "mtp.layers.0.input_layernorm.weight": (1024,),
    "mtp.layers.0.mlp.down_proj.weight": (1024, 3584),
    "mtp.layers.0.mlp.gate_proj.weight": (3584, 1024),
    "mtp.layers.0.mlp.up_proj.weight": (3584, 1024),
    "mtp.layers.0.post_attention_layernorm.weight": (1024,),
    "mtp.layers.0.self_attn.k_norm.weight": (256,),
    "mtp.layers.0.self_attn.k_proj.weight": (512, 1024),
    "mtp.layers.0.self_attn.o_proj.weight": (1024, 2048),
    "mtp.layers.0.self_attn.q_norm.weight": (256,),
    "mtp.layers.0.self_attn.q_proj.weight": (4096, 1024),
    "mtp.layers.0.self_attn.v_proj.weight": (512, 1024),
    "mtp.norm.weight": (1024,),
    "mtp.pre_fc_norm_embedding.weight": (1024,),
    "mtp.pre_fc_norm_hidden.weight": (1024,),
}
QWEN35_08B_TEXT = {
    "model_type": "qwen3_5_text",
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 3584,
    "vocab_size": 248320,
    "rms_norm_eps": 1e-06,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
}
QWEN35_35B = {
    "model_type": "qwen3_5_moe",
    "text_config": {
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "vocab_size": 248320,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
}
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "head_dim": 256,
    "intermediate_size": 5120,
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512,
    "vocab_size": 151936,
}


def test_dense_names_and_shapes_match_real_checkpoint():
    cfg = MtpConfig.from_text_config(QWEN35_08B_TEXT)
    assert mtp_tensor_shapes(cfg) == QWEN35_08B_MTP
    with torch.device("meta"):
        layer = MtpLayer(cfg)
    assert {"mtp." + k: tuple(v.shape) for k, v in layer.state_dict().items()} == QWEN35_08B_MTP
    assert len(QWEN35_08B_MTP) == 15


@pytest.mark.parametrize(("raw", "experts"), [(QWEN35_35B, 256), (QWEN3_NEXT, 512)])
def test_moe_names_and_shapes(raw, experts):
    cfg = MtpConfig.from_text_config(raw)
    shapes = mtp_tensor_shapes(cfg)
    assert len(shapes) == 17 + 3 * experts
    assert shapes["mtp.layers.0.mlp.gate.weight"] == (experts, 2048)
    assert shapes[f"mtp.layers.0.mlp.experts.{experts - 1}.down_proj.weight"] == (2048, 512)
    assert shapes["mtp.layers.0.mlp.experts.0.gate_proj.weight"] == (512, 2048)
    assert shapes["mtp.layers.0.mlp.shared_expert.up_proj.weight"] == (512, 2048)
    assert shapes["mtp.layers.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert shapes["mtp.layers.0.self_attn.q_proj.weight"] == (8192, 2048)
    assert shapes["mtp.layers.0.self_attn.o_proj.weight"] == (2048, 4096)
    assert "mtp.layers.0.mlp.gate_proj.weight" not in shapes
    with torch.device("meta"):
        layer = MtpLayer(cfg)
    assert {"mtp." + k: tuple(v.shape) for k, v in layer.state_dict().items()} == shapes
    linears = [n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.bias is None for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert len(linears) == 1 + 4 + 1 + 3 * experts + 3 + 1


def test_config_readers():
    c = MtpConfig.from_text_config(QWEN35_35B)
    assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == (256, 8, True)
    assert (c.rope_theta, c.rotary_dim, c.intermediate_size) == (1e7, 64, None)
    n = MtpConfig.from_text_config(QWEN3_NEXT)
    assert (n.num_experts, n.num_experts_per_tok, n.rope_theta, n.rotary_dim) == (512, 10, 1e7, 64)
    d = MtpConfig.from_text_config({"text_config": QWEN35_08B_TEXT})
    assert (d.is_moe, d.intermediate_size, d.rms_norm_eps) == (False, 3584, 1e-6)
    bare = MtpConfig.from_text_config(
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 8,
            "vocab_size": 9,
        }
    )
    assert (bare.head_dim, bare.partial_rotary_factor, bare.rope_theta) == (256, 0.25, 10000.0)
    with pytest.raises(ValueError, match="intermediate_size"):
        MtpConfig.from_text_config({**QWEN35_08B_TEXT, "intermediate_size": None})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        MtpConfig.from_text_config({**QWEN3_NEXT, "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        MtpConfig.from_text_config({**QWEN3_NEXT, "moe_intermediate_size": None})


def test_from_state_dict_errors_name_the_tensor():
    cfg = MtpConfig.from_text_config(DENSE)
    weights = random_weights(cfg, 1)
    missing = {k: v for k, v in weights.items() if k != "mtp.norm.weight"}
    with pytest.raises(MtpLayoutError, match=r"1 missing: mtp\.norm\.weight"):
        MtpLayer.from_state_dict(cfg, missing)
    extra = {**weights, "mtp.layers.0.self_attn.q_proj.weight_scale": torch.zeros(1)}
    with pytest.raises(MtpLayoutError, match=r"unexpected: mtp\.layers\.0\.self_attn\.q_proj\.weight_scale"):
        MtpLayer.from_state_dict(cfg, extra)
    bad = {**weights, "mtp.fc.weight": torch.zeros(64, 64)}
    with pytest.raises(MtpLayoutError, match=r"misshapen: mtp\.fc\.weight \(64, 64\) \(expected \(64, 128\)\)"):
        MtpLayer.from_state_dict(cfg, bad)
    unprefixed = {k.removeprefix("mtp."): v for k, v in weights.items()}
    with pytest.raises(MtpLayoutError, match="15 missing"):
        MtpLayer.from_state_dict(cfg, unprefixed)


def test_from_state_dict_adopts_tensors():
    cfg = MtpConfig.from_text_config(DENSE)
    weights = random_weights(cfg, 1)
    layer = MtpLayer.from_state_dict(cfg, weights)
    assert layer.fc.weight.data_ptr() == weights["mtp.fc.weight"].data_ptr()
    assert not any(p.requires_grad for p in layer.parameters())
    assert not layer.training


# --------------------------------------------------------------------------------------------
# Differential check of the building blocks against transformers' Qwen3.5 classes
# --------------------------------------------------------------------------------------------


def test_blocks_match_transformers():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35moe
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    cfg = MtpConfig.from_text_config(DENSE)
    ours = MtpLayer.from_state_dict(cfg, random_weights(cfg, 1))
    hf_cfg = Qwen3_5TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=256,
        intermediate_size=96,
        num_hidden_layers=4,
        vocab_size=50,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    hf_cfg._attn_implementation = "eager"
    hf_layer = q35.Qwen3_5DecoderLayer(hf_cfg, layer_idx=3)  # a full_attention layer
    assert hf_layer.block_type == "full_attention"
    missing, unexpected = hf_layer.load_state_dict(ours.layers[0].state_dict(), strict=False)
    assert not unexpected and not missing
    rotary = q35.Qwen3_5TextRotaryEmbedding(hf_cfg)
    x = torch.randn(2, 6, 64)
    positions = torch.arange(6)[None].expand(2, 6) * 11 + 3
    cos, sin = rotary(x, positions)  # 2-D ids: text-only M-RoPE
    causal = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = hf_layer(x, position_embeddings=(cos, sin), attention_mask=causal)
        got, _ = ours.layers[0](x, positions, None)
    close(got, expected)

    norm = q35.Qwen3_5RMSNorm(64, eps=1e-6)
    norm.weight.data = ours.norm.weight.clone()
    for xn in (torch.randn(3, 64) * 30, torch.randn(3, 64).bfloat16()):
        assert torch.equal(ours.norm(xn), norm(xn))

    moe_cfg = MtpConfig.from_text_config(MOE)
    ours_moe = MtpLayer.from_state_dict(moe_cfg, random_weights(moe_cfg, 2)).layers[0].mlp
    hf_moe_cfg = Qwen3_5MoeTextConfig(
        hidden_size=64,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    hf_moe = q35moe.Qwen3_5MoeSparseMoeBlock(hf_moe_cfg)
    with torch.no_grad():
        hf_moe.gate.weight.copy_(ours_moe.gate.weight)
        for e, expert in enumerate(ours_moe.experts):
            gate_up = torch.cat([expert.gate_proj.weight, expert.up_proj.weight])
            hf_moe.experts.gate_up_proj[e].copy_(gate_up)
            hf_moe.experts.down_proj[e].copy_(expert.down_proj.weight)
        hf_moe.shared_expert.load_state_dict(ours_moe.shared_expert.state_dict())
        hf_moe.shared_expert_gate.weight.copy_(ours_moe.shared_expert_gate.weight)
        y = torch.randn(2, 5, 64)
        close(ours_moe(y), hf_moe(y))
