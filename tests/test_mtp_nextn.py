"""The appended-layer MTP forward (mtpquant/mtp/nextn.py) against transformers' own MTP classes and vLLM's wiring.

1. transformers 5.19's ``MtpModel`` (``modeling_layers``: its generic DeepSeek-style ``MtpLayer``), loaded from the tiny
   checkpoint by ``MtpModel.from_pretrained`` (its own renaming of ``model.layers.{N}.*``, ``shared_head.norm`` ->
   ``post_norm``) with the target's head: the logits of a teacher-forced pass are exactly equal (the position-0
   embedding zeroed on both sides, as vLLM's NextN layers do).
2. vLLM 0.32's chain: the next draft step reads the pre-norm stream on GLM (``Glm4MoeMTP.forward`` returns it) and the
   normed one on DeepSeek (``DeepSeekMultiTokenPredictorLayer.forward`` returns both, the proposer recycles the
   second); a chained step with the cache equals one causal pass over the rows with that stream appended.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.mtp.build import reference_mtp
from mtpquant.mtp.module import KVCache, MtpLayoutError
from mtpquant.mtp.names import checkpoint_name, module_name

pytestmark = pytest.mark.dev

VARIANTS = ("glm4_moe-copies", "deepseek_v3")


class Reference:
    """A tiny checkpoint's reference MTP with its target (float32)."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.ckpt = Checkpoint.open(path)
        self.tensors = {e.name: self.ckpt.read_tensor(e.name) for e in self.ckpt.mtp_tensors()}
        self.mtp: Any = reference_mtp(self.ckpt.config, self.tensors, dtype=torch.float32)
        cls = getattr(transformers, self.ckpt.spec.family.text_class)
        self.main: Any = cls.from_pretrained(str(path), dtype=torch.float32).eval()
        self.head = self.main.lm_head.weight

    def embed(self, ids: Tensor) -> Tensor:
        return self.main.get_input_embeddings()(ids)

    def inputs(self, rows: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """The target's post-final-norm hidden states h_0..h_{rows-1} and the tokens x_1..x_rows."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 500, (1, rows + 1), generator=g)
        with torch.no_grad():
            hidden = self.main.model(input_ids=ids).last_hidden_state
        return hidden[:, :-1], ids[:, 1:]


class Tiny(Reference):
    """A tiny checkpoint's reference MTP with its target (float32), and transformers' MtpModel of it."""

    def __init__(self, path: Path) -> None:
        from transformers.modeling_layers import MtpModel

        super().__init__(path)
        n = self.main.config.num_hidden_layers
        # transformers finds the MTP by the release's layer number (61, 92); the tiny trunk has n layers
        self.main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
        self.hf: Any = MtpModel.from_pretrained(self.main).eval()
        for module in self.hf.modules():  # the experts' eager loop, as the reference runs them (same sums)
            if hasattr(module, "config"):
                module.config._experts_implementation = "eager"

    def hf_pass(self, hidden: Tensor, embeds: Tensor) -> Tensor:
        """transformers' MtpLayer over the rows (causal), its post-norm output, the embedding zeroed at position 0."""
        rows = hidden.shape[1]
        pos = torch.arange(rows)[None]
        embeds = embeds.clone()
        embeds[:, 0] = 0
        layer = self.hf.layers[0]
        mask = torch.ones(rows, rows, dtype=torch.bool).tril()[None, None]
        pe = self.hf.rotary_emb(embeds, position_ids=pos)
        with torch.no_grad():
            return layer(embeds, hidden, position_embeddings=pe, attention_mask=mask, position_ids=pos,
                         past_key_values=None)


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request: pytest.FixtureRequest, tiny_factory: Callable[[str], Path]) -> Tiny:
    return Tiny(tiny_factory(request.param))


def test_logits_are_transformers_mtp_models(tiny: Tiny) -> None:
    hidden, tokens = tiny.inputs(11)
    with torch.no_grad():
        step = tiny.mtp.step(hidden, tiny.embed(tokens))
        ours = F.linear(step.out, tiny.main.lm_head.weight)
        theirs = tiny.hf._project_to_logits(tiny.hf_pass(hidden, tiny.embed(tokens)))
    assert torch.equal(ours, theirs)
    assert ours.shape == (1, 11, tiny.ckpt.config["vocab_size"])


def test_the_next_step_reads_the_familys_stream(tiny: Tiny) -> None:
    recycle_normed = tiny.ckpt.spec.family.key == "deepseek_v3"
    hidden, tokens = tiny.inputs(9, seed=1)
    T = 8
    with torch.no_grad():
        step0 = tiny.mtp.step(hidden[:, :T], tiny.embed(tokens[:, :T]))
        draft = tiny.embed(tokens[:, T : T + 1])
        step1 = tiny.mtp.step(step0.next_hidden[:, -1:], draft, past=step0.cache, step=1)
        # the same step as one causal pass: the recycled stream as row T's hidden input
        rows = torch.cat((hidden[:, :T], step0.next_hidden[:, -1:]), dim=1)
        whole = tiny.hf_pass(rows, torch.cat((tiny.embed(tokens[:, :T]), draft), dim=1))
    normed = tiny.mtp.layers[0].post_norm
    torch.testing.assert_close(step1.out, whole[:, -1:], rtol=1e-5, atol=1e-6)
    assert torch.equal(step0.next_hidden, step0.out) is recycle_normed
    if not recycle_normed:  # GLM: the pre-norm stream, which the norm turns into out
        torch.testing.assert_close(normed(step0.next_hidden), step0.out)
    assert isinstance(step1.cache, KVCache) and step1.cache.length == T + 1


def test_the_first_positions_embedding_is_masked(tiny: Tiny) -> None:
    hidden, tokens = tiny.inputs(6, seed=2)
    other = tokens.clone()
    other[:, 0] = (tokens[:, 0] + 7) % 500
    with torch.no_grad():
        a = tiny.mtp.step(hidden, tiny.embed(tokens)).out
        b = tiny.mtp.step(hidden, tiny.embed(other)).out
        shifted = tiny.mtp.step(hidden, tiny.embed(other), positions=torch.arange(1, 7)).out
    assert torch.equal(a, b)  # vLLM zeroes the embedding at position 0
    assert not torch.allclose(a, shifted)


def test_names_are_the_checkpoints(tiny: Tiny) -> None:
    spec = tiny.ckpt.spec
    own = {n for n in tiny.tensors if not n.endswith((".shared_head.head.weight", ".embed_tokens.weight"))}
    names = {checkpoint_name(tiny.mtp, n) for n, _ in tiny.mtp.named_parameters()}
    names |= {checkpoint_name(tiny.mtp, n) for n, _ in tiny.mtp.named_buffers() if "rotary" not in n}
    per_expert = {n for n in own if ".mlp.experts." in n}
    fused = {f"{spec.appended_prefix()}layers.{spec.mtp_names.first}.mlp.experts.{p}" for p in ("gate_up_proj",
                                                                                                 "down_proj")}
    assert names == (own - per_expert) | fused
    for name in names:
        assert checkpoint_name(tiny.mtp, module_name(tiny.mtp, name)) == name
    assert module_name(tiny.mtp, f"model.layers.{spec.mtp_names.first}.shared_head.norm.weight") == (
        "layers.0.post_norm.weight"
    )
    missing = {n: t for n, t in tiny.tensors.items() if ".eh_proj." not in n}
    with pytest.raises(MtpLayoutError, match=r"1 missing: model\.layers\.2\.eh_proj\.weight"):
        reference_mtp(tiny.ckpt.config, missing)


def test_draft_rows_are_draft_chains(tiny: Tiny) -> None:
    from mtpquant.mtp.drafting import draft_chain, draft_rows

    hidden, tokens = tiny.inputs(14, seed=3)
    head = tiny.main.lm_head.weight
    with torch.no_grad():
        teacher = tiny.mtp.step(hidden, tiny.embed(tokens))
    rows = range(9, 13)
    got = draft_rows(tiny.mtp, teacher, rows, tiny.embed, head, 3, chunk=3)
    for i, t in enumerate(rows):
        c = teacher.cache
        past = KVCache(c.key[:, :, :t], c.value[:, :, :t])
        want = draft_chain(tiny.mtp, hidden[:, t : t + 1], tokens[:, t : t + 1], tiny.embed, head, 3, past_kv=past)
        assert got[i].tolist() == want.tokens[0].tolist(), f"row {t}"


def test_bf16_matches_float32(tiny: Tiny) -> None:
    bf = reference_mtp(tiny.ckpt.config, tiny.tensors, dtype=torch.bfloat16)
    hidden, tokens = tiny.inputs(8, seed=4)
    with torch.no_grad():
        a = bf.step(hidden.bfloat16(), tiny.embed(tokens).bfloat16())
        b = tiny.mtp.step(hidden, tiny.embed(tokens))
    assert a.out.dtype == torch.bfloat16
    torch.testing.assert_close(a.out.float(), b.out, rtol=0.05, atol=0.05)


# ---- the sparse-attention indexer (DeepSeek-V3.2, GLM-5) --------------------------------------------------------
# transformers 5.19's MtpModel does not build these (their configs have no num_mtp_layers); the block is their own
# DecoderLayer with its indexer, checked here by what the drafting loop relies on, over more rows than the tiny
# index_topk (16) so that the indexer does leave keys out.
INDEXED = ("deepseek_v32", "glm_moe_dsa")


@pytest.fixture(scope="module", params=INDEXED)
def indexed(request: pytest.FixtureRequest, tiny_factory: Callable[[str], Path]) -> Reference:
    """A tiny indexer-family checkpoint's reference MTP (float32) with its target."""
    return Reference(tiny_factory(request.param))


def test_the_indexer_selects_its_top_k_and_caches_its_keys(indexed: Reference) -> None:
    """Row t sees min(t + 1, index_topk) keys; a step over the cache equals the same rows in one causal pass, the
    indexer's keys read from the cache (``IndexedKVCache``), its choice the same; the next step reads the normed
    stream (vLLM's DeepSeekMTP and DeepseekV32MultiTokenPredictorLayer)."""
    from mtpquant.mtp.nextn import IndexedKVCache

    hidden, tokens = indexed.inputs(25, seed=1)
    T, topk = 24, indexed.ckpt.config["index_topk"]
    with torch.no_grad():
        whole = indexed.mtp.step(hidden[:, : T + 1], indexed.embed(tokens[:, : T + 1]))
        first = indexed.mtp.step(hidden[:, :T], indexed.embed(tokens[:, :T]))
        last = indexed.mtp.step(hidden[:, T:], indexed.embed(tokens[:, T:]), past=first.cache)
    assert whole.selection is not None and last.selection is not None
    assert whole.selection.sum(-1)[0, 0].tolist() == [min(t + 1, topk) for t in range(T + 1)]
    assert torch.equal(last.selection, whole.selection[:, :, -1:])
    torch.testing.assert_close(last.out, whole.out[:, -1:], rtol=1e-5, atol=1e-6)
    assert isinstance(last.cache, IndexedKVCache) and last.cache.length == T + 1
    assert last.cache.index_key.shape == (1, T + 1, indexed.ckpt.config["index_head_dim"])
    torch.testing.assert_close(last.cache.index_key, whole.cache.index_key, rtol=1e-5, atol=1e-6)
    assert torch.equal(whole.next_hidden, whole.out)


def test_a_shared_selection_replaces_the_indexers(indexed: Reference) -> None:
    """GLM-5 declares index_share_for_mtp_iteration (steps after the first reuse step 0's choice); a given selection
    is what the attention sees: the step attends to exactly those keys."""
    share = indexed.ckpt.config.get("index_share_for_mtp_iteration", False)
    assert indexed.mtp.index_share is share is (indexed.ckpt.spec.family.key == "glm_moe_dsa")
    hidden, tokens = indexed.inputs(24, seed=2)
    with torch.no_grad():
        own = indexed.mtp.step(hidden, indexed.embed(tokens))
        other = torch.zeros_like(own.selection)
        other[..., :3] = True
        other &= torch.ones_like(other).tril()  # causal: a key no later than the row
        given = indexed.mtp.step(hidden, indexed.embed(tokens), selection=other)
    assert torch.equal(given.selection, other & torch.ones_like(other).tril())
    assert torch.equal(given.out[:, :1], own.out[:, :1])  # row 0 sees key 0 either way
    assert not torch.allclose(given.out[:, 20:], own.out[:, 20:])


def test_indexed_draft_rows_are_draft_chains(indexed: Reference) -> None:
    from mtpquant.mtp.drafting import draft_chain, draft_rows
    from mtpquant.mtp.nextn import IndexedKVCache

    hidden, tokens = indexed.inputs(24, seed=3)
    with torch.no_grad():
        teacher = indexed.mtp.step(hidden, indexed.embed(tokens))
    rows = range(18, 22)
    got = draft_rows(indexed.mtp, teacher, rows, indexed.embed, indexed.head, 3, chunk=3)
    for i, t in enumerate(rows):
        c = teacher.cache
        past = IndexedKVCache(c.key[:, :, :t], c.value[:, :, :t], c.index_key[:, :t])
        want = draft_chain(indexed.mtp, hidden[:, t : t + 1], tokens[:, t : t + 1], indexed.embed, indexed.head, 3,
                           past_kv=past)  # fmt: skip
        assert got[i].tolist() == want.tokens[0].tolist(), f"row {t}"
