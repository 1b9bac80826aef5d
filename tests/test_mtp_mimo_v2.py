"""MiMo-V2-Flash's MTP forward (mtpquant/mtp/mimo_v2.py) against transformers' own MiMoV2Flash layer classes and
vLLM's wiring (``model_executor/models/mimo_v2_mtp.py``).

1. The oracle: transformers 5.19's generic ``modeling_layers.MtpLayer`` built with ``MiMoV2FlashDecoderLayer`` and
   ``MiMoV2FlashRMSNorm`` from a ``MiMoV2FlashConfig`` of one sliding, dense layer (vLLM's ``MiMoV2MTPLayer``: "MTP uses
   the SWA attention configuration", ``MiMoV2MLP``), eager attention with its sinks, its weights read here from the
   checkpoint's safetensors (``pre_mlp_layernorm`` -> the block's ``post_attention_layernorm``,
   ``attention_sink_bias`` -> ``sinks`` as transformers' conversion_mapping renames it, ``final_layernorm`` the
   post-norm), its mask transformers' ``create_sliding_window_causal_mask``: logits through the target's head equal
   ours over more rows than the window.
2. vLLM's chain: every draft step runs layer 0 and reads its normed output (``MiMoV2MTPLayer.forward`` returns
   ``final_layernorm(h)``); the chain of ``draft_rows`` is the engines' loop ``draft_chain`` from every row.
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

pytestmark = pytest.mark.slow

ROWS = 80  # beyond the tiny's sliding window (64)
MTP = "model.mtp.layers.0."


class Mimo:
    """The tiny MiMo-V2-Flash checkpoint's MTP (ours, float32), its trunk, transformers' layer on the same weights."""

    def __init__(self, path: Path) -> None:
        import transformers
        from safetensors.torch import load_file

        self.ckpt = Checkpoint.open(path)
        self.config = dict(self.ckpt.config)
        tensors = {e.name: self.ckpt.read_tensor(e.name) for e in self.ckpt.mtp_tensors()}
        self.mtp: Any = reference_mtp(self.ckpt.config, tensors, dtype=torch.float32)
        cls = transformers.MiMoV2FlashForCausalLM
        self.main: Any = cls.from_pretrained(str(path), dtype=torch.float32).eval()
        self.head = self.main.lm_head.weight
        self.raw: dict[str, Tensor] = {}
        for shard in sorted(path.glob("*.safetensors")):
            self.raw |= load_file(str(shard))

    def embed(self, ids: Tensor) -> Tensor:
        return self.main.get_input_embeddings()(ids)

    def inputs(self, rows: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 500, (1, rows + 1), generator=g)
        with torch.no_grad():
            hidden = self.main.model(input_ids=ids).last_hidden_state
        return hidden[:, :-1], ids[:, 1:]

    def hf_logits(self, hidden: Tensor, embeds: Tensor) -> Tensor:
        from transformers import MiMoV2FlashConfig
        from transformers.masking_utils import create_sliding_window_causal_mask
        from transformers.modeling_layers import MtpLayer
        from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import (
            MiMoV2FlashDecoderLayer,
            MiMoV2FlashRMSNorm,
            MiMoV2FlashRotaryEmbedding,
        )

        text = {k: v for k, v in self.config.items() if k not in ("architectures", "model_type", "dtype")}
        text |= {"num_hidden_layers": 1, "layer_types": ["sliding_attention"], "mlp_layer_types": ["dense"]}
        cfg = MiMoV2FlashConfig(**text)
        cfg._attn_implementation = "eager"
        layer = MtpLayer(cfg, MiMoV2FlashDecoderLayer, MiMoV2FlashRMSNorm, 0, use_post_norm=True)
        state: dict[str, Tensor] = {}
        for name, t in self.raw.items():
            if not name.startswith(MTP):
                continue
            rest = name[len(MTP) :]
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
                state[rest] = t.float()
            elif rest.startswith("final_layernorm."):
                state["post_norm." + rest[len("final_layernorm.") :]] = t.float()
            else:
                rest = rest.replace("pre_mlp_layernorm", "post_attention_layernorm")
                state["mtp_block." + rest.replace("attention_sink_bias", "sinks")] = t.float()
        layer.load_state_dict(state, strict=True)
        pos = torch.arange(hidden.shape[1])[None]
        mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=embeds, attention_mask=None,
                                                 past_key_values=None, position_ids=pos)  # fmt: skip
        pe = MiMoV2FlashRotaryEmbedding(cfg)(embeds, pos, "sliding_attention")
        with torch.no_grad():
            out = layer.eval()(embeds, hidden, position_embeddings=pe, attention_mask=mask, position_ids=pos,
                               past_key_values=None)  # fmt: skip
            return F.linear(out, self.head)


@pytest.fixture(scope="module")
def mimo(tiny_factory: Callable[[str], Path]) -> Mimo:
    return Mimo(tiny_factory("mimo_v2_flash"))


def test_the_tiny_mtp_is_one_sliding_dense_layer_with_its_sink(mimo: Mimo) -> None:
    assert len(mimo.mtp.layers) == 1 and mimo.mtp.config.layer_types == ["sliding_attention"]
    assert mimo.mtp.config.mlp_layer_types == ["dense"] and mimo.mtp.config.sliding_window < ROWS
    assert f"{MTP}self_attn.attention_sink_bias" in mimo.raw


def test_logits_are_transformers_layers_with_the_targets_head(mimo: Mimo) -> None:
    hidden, tokens = mimo.inputs(ROWS)
    embeds = mimo.embed(tokens)
    with torch.no_grad():
        step = mimo.mtp.step(hidden, embeds)
        ours = F.linear(step.out, mimo.head)
    assert step.head is None  # the target's head (vLLM's MiMoV2MTP.lm_head, loaded from the target's lm_head)
    torch.testing.assert_close(ours, mimo.hf_logits(hidden, embeds), rtol=0, atol=1e-5)


def test_every_step_runs_layer_0_and_reads_the_normed_stream(mimo: Mimo) -> None:
    hidden, tokens = mimo.inputs(12)
    embeds = mimo.embed(tokens)
    with torch.no_grad():
        first = mimo.mtp.step(hidden, embeds)
        assert torch.equal(first.next_hidden, first.out)  # final_layernorm's output is recycled
        nxt = mimo.mtp.step(first.out[:, -1:], embeds[:, -1:], torch.tensor([12]), first.cache, step=2)
        alone = mimo.mtp.step(torch.cat((hidden, first.out[:, -1:]), 1), torch.cat((embeds, embeds[:, -1:]), 1))
    torch.testing.assert_close(nxt.out[:, -1], alone.out[:, -1], rtol=0, atol=1e-5)


def test_draft_rows_are_draft_chains(mimo: Mimo) -> None:
    from mtpquant.mtp.drafting import draft_chain, draft_rows

    hidden, tokens = mimo.inputs(16, seed=1)
    with torch.no_grad():
        teacher = mimo.mtp.step(hidden, mimo.embed(tokens))
        rows = draft_rows(mimo.mtp, teacher, range(16), mimo.embed, mimo.head, 3)
        for t in range(16):
            want = draft_chain(mimo.mtp, hidden[:, : t + 1], tokens[:, : t + 1], mimo.embed, mimo.head, 3)
            assert rows[t].tolist() == want.tokens[0].tolist()
