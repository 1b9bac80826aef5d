"""transformers' model class for an architecture, with mtpquant's stand-in where transformers names the architecture in
its configs but ships no class for it.

transformers 5.19 reads Step-3.5-Flash's config (``model_type`` ``step3p5``: ``Step3p7TextConfig``) and has its decoder
(``Step3p7TextModel``), but its only model with an LM head is the vision wrapper ``Step3p7ForConditionalGeneration``;
the text-only release's architecture ``Step3p5ForCausalLM`` (vLLM's class of that name, ``model_executor/models/
step3p5.py``) has none. The stand-in is that decoder under ``model.`` and an untied ``lm_head``: the release's own
names, so ``from_pretrained`` loads it as it is (the routed experts stored per expert are fused as transformers fuses
every such family's: ``conversion_mapping`` ``qwen2_moe``'s converters, registered under the class's name).
"""

from __future__ import annotations

from functools import cache
from typing import Any

__all__ = ["model_class"]


def model_class(name: str) -> Any:
    """The transformers model class ``name``, or mtpquant's stand-in for it (``Step3p5ForCausalLM``); AttributeError
    where neither exists."""
    import transformers

    cls = getattr(transformers, name, None)
    if cls is not None:
        return cls
    make = _STAND_INS.get(name)
    if make is None:
        raise AttributeError(f"transformers has no class {name}")
    return make()


@cache
def _step3p5_for_causal_lm() -> Any:
    import torch
    from torch import nn
    from transformers import GenerationMixin
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7PreTrainedModel, Step3p7TextModel

    class Step3p5ForCausalLM(Step3p7PreTrainedModel, GenerationMixin):
        """Step-3.5-Flash's text model: ``Step3p7TextModel`` as ``model``, an untied ``lm_head``."""

        config_class = Step3p7TextConfig
        base_model_prefix = "model"

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = Step3p7TextModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            # the appended MTP layers are not this model's (Step3p7TextModel's own patterns, under model.)
            self._keys_to_ignore_on_load_unexpected = self.model._keys_to_ignore_on_load_unexpected
            self.post_init()

        def get_input_embeddings(self) -> nn.Module:
            return self.model.embed_tokens

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

        def get_decoder(self) -> nn.Module:
            return self.model

        def forward(
            self,
            input_ids: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None,
            past_key_values: Any = None,
            inputs_embeds: torch.Tensor | None = None,
            use_cache: bool | None = None,
            logits_to_keep: int = 0,
            **kwargs: Any,
        ) -> CausalLMOutputWithPast:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
            hidden = out.last_hidden_state
            keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
            logits = self.lm_head(hidden[:, keep])
            return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values)

    # the per-expert bank of the checkpoint fused as transformers fuses every per-expert family's (conversion_mapping:
    # the qwen2_moe entry), keyed by the class name so only this class takes it
    register_checkpoint_conversion_mapping(
        "Step3p5ForCausalLM",
        [
            WeightConverter(
                source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                target_patterns="mlp.experts.gate_up_proj",
                operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
            ),
            WeightConverter(
                source_patterns="mlp.experts.*.down_proj.weight",
                target_patterns="mlp.experts.down_proj",
                operations=[MergeModulelist(dim=0)],
            ),
        ],
        overwrite=True,
    )
    return Step3p5ForCausalLM


_STAND_INS = {"Step3p5ForCausalLM": _step3p5_for_causal_lm}
