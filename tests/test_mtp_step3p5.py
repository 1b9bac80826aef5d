"""Step-3.5's MTP forward (mtpquant/mtp/step3p5.py) against transformers' own Step3p7 layer classes and vLLM's wiring.

1. The oracle: per MTP layer, transformers 5.19's generic ``modeling_layers.MtpLayer`` built with
   ``Step3p7DecoderLayer`` and ``Step3p7RMSNorm`` from transformers' own MTP config
   (``Step3p7TextConfig.get_mtp_config()``: the layers' kinds split off the release's padded per-layer lists by
   transformers), its weights read here from the checkpoint's
   safetensors by vLLM's renaming (``Step3p5MTP._rewrite_spec_layer_name``: the glue kept, the rest under
   ``mtp_block.``; ``shared_head.norm`` is the post-norm), its RoPE ``Step3p7RotaryEmbedding`` for the layer's kind, its
   mask transformers' ``create_sliding_window_causal_mask``, the logits through the layer's own ``shared_head.output``
   (vLLM's ``Step3p5AMultiTokenPredictor.compute_logits``): equal to ours over more rows than the sliding window.
2. vLLM's chain: draft step i runs layer N + i (``spec_step_idx % num_mtp_layers``) with its own head; the next step
   reads the block's output (pre-norm); the chain of ``draft_rows`` is the engines' loop ``draft_chain`` from every row.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.mtp.build import reference_mtp

pytestmark = pytest.mark.slow

ROWS = 80  # beyond the tiny's sliding window (64): the window is exercised


class Step:
    """The tiny Step-3.5 checkpoint's MTP (ours, float32), its trunk and transformers' layers on the same weights."""

    def __init__(self, path: Path) -> None:
        from safetensors.torch import load_file

        from mtpquant.runtime.hf_classes import model_class

        self.path = path
        self.ckpt = Checkpoint.open(path)
        self.config = json.loads((path / "config.json").read_text())
        self.n = self.config["num_hidden_layers"]
        self.depth = self.config["num_nextn_predict_layers"]
        self.tensors = {e.name: self.ckpt.read_tensor(e.name) for e in self.ckpt.mtp_tensors()}
        self.mtp: Any = reference_mtp(self.ckpt.config, self.tensors, dtype=torch.float32)
        self.main: Any = model_class("Step3p5ForCausalLM").from_pretrained(str(path), dtype=torch.float32).eval()
        self.raw: dict[str, Tensor] = {}
        for shard in sorted(path.glob("*.safetensors")):
            self.raw |= load_file(str(shard))

    def embed(self, ids: Tensor) -> Tensor:
        return self.main.get_input_embeddings()(ids)

    def inputs(self, rows: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """The target's post-final-norm hidden states h_0..h_{rows-1} and the tokens x_1..x_rows."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 500, (1, rows + 1), generator=g)
        with torch.no_grad():
            hidden = self.main.model(input_ids=ids).last_hidden_state
        return hidden[:, :-1], ids[:, 1:]

    def hf_layer(self, i: int) -> tuple[Any, Any, Tensor]:
        """transformers' MtpLayer i (float32) with the checkpoint's weights, its config and its own head."""
        from transformers import Step3p7TextConfig
        from transformers.modeling_layers import MtpLayer
        from transformers.models.step3p7.modeling_step3p7 import Step3p7DecoderLayer, Step3p7RMSNorm

        text = {k: v for k, v in self.config.items() if k not in ("architectures", "model_type", "dtype")}
        cfg = Step3p7TextConfig(**text).get_mtp_config()
        cfg._attn_implementation = "sdpa"
        if cfg.per_layer_config is None:  # transformers' MTP config drops it; rebuilt for the MTP layers' own kinds
            heads = {"num_attention_heads": cfg.num_sliding_attention_heads}
            cfg.per_layer_config = {j: heads for j, kind in enumerate(cfg.layer_types) if kind == "sliding_attention"}
        layer = MtpLayer(cfg, Step3p7DecoderLayer, Step3p7RMSNorm, i, use_post_norm=True)
        prefix = f"model.layers.{self.n + i}."
        state: dict[str, Tensor] = {}
        for name, t in self.raw.items():
            if not name.startswith(prefix) or name.endswith("shared_head.output.weight"):
                continue
            rest = name[len(prefix) :]
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
                state[rest] = t.float()
            elif rest.startswith("shared_head.norm."):
                state["post_norm." + rest[len("shared_head.norm.") :]] = t.float()
            else:
                state["mtp_block." + rest] = t.float()
        layer.load_state_dict(state, strict=True)
        return layer.eval(), cfg, self.raw[prefix + "shared_head.output.weight"].float()

    def hf_logits(self, i: int, hidden: Tensor, embeds: Tensor) -> Tensor:
        """transformers' layer i over the rows (causal, its own sliding window), through its own head."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        from transformers.models.step3p7.modeling_step3p7 import Step3p7RotaryEmbedding

        layer, cfg, head = self.hf_layer(i)
        kind = cfg.layer_types[i]
        pos = torch.arange(hidden.shape[1])[None]
        make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        mask = make(config=cfg, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=pos)
        pe = Step3p7RotaryEmbedding(cfg)(embeds, pos, kind)
        with torch.no_grad():
            out = layer(embeds, hidden, position_embeddings=pe, attention_mask=mask, position_ids=pos,
                        past_key_values=None)  # fmt: skip
            return F.linear(out, head)


@pytest.fixture(scope="module")
def step(tiny_factory: Callable[[str], Path]) -> Step:
    return Step(tiny_factory("step3p5"))


def test_the_tiny_mtp_layers_are_sliding_and_dense_as_the_release_lists_them(step: Step) -> None:
    assert step.depth == 3 and step.mtp.config.layer_types == ["sliding_attention"] * 3
    assert step.mtp.config.mlp_layer_types == ["dense"] * 3 and step.mtp.config.sliding_window < ROWS


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_each_layers_logits_are_transformers_layers_with_its_own_head(step: Step, layer: int) -> None:
    hidden, tokens = step.inputs(ROWS)
    embeds = step.embed(tokens)
    with torch.no_grad():
        ours = step.mtp.step(hidden, embeds, step=layer)  # step i on layer i: every row teacher-forced through it
        logits = F.linear(ours.out, ours.head)
    theirs = step.hf_logits(layer, hidden, embeds)
    assert torch.equal(ours.head, step.raw[f"model.layers.{step.n + layer}.shared_head.output.weight"].float())
    torch.testing.assert_close(logits, theirs, rtol=0, atol=1e-5)  # the same float32 ops, up to SDPA's mask path
    assert logits.shape == (1, ROWS, step.config["vocab_size"])


def test_the_window_matters_beyond_its_length(step: Step) -> None:
    """Rows past the sliding window differ from a full-attention pass (the window is applied), rows inside do not."""
    hidden, tokens = step.inputs(ROWS)
    embeds = step.embed(tokens)
    window = step.mtp.config.sliding_window
    with torch.no_grad():
        ours = step.mtp.step(hidden, embeds).out
        step.mtp.config.sliding_window = None
        try:
            full = step.mtp.step(hidden, embeds).out
        finally:
            step.mtp.config.sliding_window = window
    assert torch.equal(ours[:, :window], full[:, :window])
    assert not torch.allclose(ours[:, window:], full[:, window:])


def test_draft_step_i_runs_layer_i_and_reads_the_pre_norm_stream(step: Step) -> None:
    """A chained step j continues from step j-1's block output (not its normed output) on layer j % depth."""
    hidden, tokens = step.inputs(12)
    embeds = step.embed(tokens)
    with torch.no_grad():
        first = step.mtp.step(hidden, embeds)
        assert torch.equal(first.head, step.mtp.layers[0].own_head)
        assert not torch.equal(first.next_hidden, first.out)  # the pre-norm stream is the next step's
        nxt = step.mtp.step(first.next_hidden[:, -1:], embeds[:, -1:], torch.tensor([12]), first.cache, step=1)
        assert torch.equal(nxt.head, step.mtp.layers[1].own_head)
        # layer 1 alone over the 12 rows then the chained row: its cache holds its own keys for every earlier row
        alone = step.mtp.step(torch.cat((hidden, first.next_hidden[:, -1:]), 1), torch.cat((embeds, embeds[:, -1:]), 1),
                              step=1)  # fmt: skip
    torch.testing.assert_close(nxt.out[:, -1], alone.out[:, -1], rtol=0, atol=1e-5)
    assert step.mtp.step(hidden, embeds, step=4).head is step.mtp.layers[1].own_head  # 4 % 3


def test_draft_rows_are_draft_chains(step: Step) -> None:
    from mtpquant.mtp.drafting import draft_chain, draft_rows

    hidden, tokens = step.inputs(16, seed=1)
    head = step.main.lm_head.weight
    with torch.no_grad():
        teacher = step.mtp.step(hidden, step.embed(tokens))
        rows = draft_rows(step.mtp, teacher, range(16), step.embed, head, 4)
        for t in range(16):
            past = teacher.cache.last(teacher.cache.length)  # the whole cache: rows 0..15
            past = type(past)(*(tuple(x[:, :, :t] for x in past.keys), tuple(x[:, :, :t] for x in past.values),
                                past.valid[:, :, :t], past.positions[:, :t]))  # fmt: skip
            want = draft_chain(step.mtp, hidden[:, t : t + 1], tokens[:, t : t + 1], step.embed, head, 4,
                               past_kv=past if t else None)  # fmt: skip
            assert rows[t].tolist() == want.tokens[0].tolist()
