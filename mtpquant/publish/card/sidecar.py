"""The card of an MTP sidecar repo: the MTP layer of a base model alone (``convert --mtp extract``'s MTP
directory), published once per base model and grafted into any quant of it that lost its MTP.
"""

from __future__ import annotations

from typing import Any

from mtpquant import __version__
from mtpquant.card_marker import card_head
from mtpquant.publish.card.facts import (
    CardFacts,
    base_model,
    base_model_link,
    license_line,
    license_metadata,
    public_command,
)
from mtpquant.units import format_bytes

__all__ = ["SIDECAR_RELATION", "sidecar_body", "sidecar_data"]

# The Hub's relations are adapter, merge, quantized and finetune: an MTP sidecar is an add-on module of its base
# model (used with it, or with any quant of it), so it joins the base model's tree as an adapter.
SIDECAR_RELATION = "adapter"
N = 3  # draft tokens in the example commands


def sidecar_data(facts: CardFacts) -> dict[str, Any]:
    """The sidecar card's metadata (``ModelCardData`` fields), only with what is known."""
    from huggingface_hub import ModelCardData

    base, _, _ = base_model(facts)
    data = ModelCardData(
        base_model=base,
        base_model_relation=SIDECAR_RELATION if base else None,
        **license_metadata(facts),
        tags=["mtp", "mtp-sidecar", "speculative-decoding", facts.family_key, "mtpquant"],
    )
    return dict(data.to_dict())


def sidecar_body(facts: CardFacts) -> list[str]:
    """The sidecar card's Markdown lines (the metadata block and the seal are added by ``build_card``)."""
    r = facts.report
    repo = facts.repo_id
    base, revision, origin = base_model(facts)
    at = f" at revision `{revision}`" if revision else ""
    of = base_model_link(base, at)
    shards = ", ".join(f"`{s}`" for s in r.mtp_shards)
    rev = f" --revision {facts.revision}" if facts.revision and facts.revision != "main" else ""
    lines = [
        *card_head(repo.split("/")[-1]),
        f"The Multi-Token-Prediction (MTP) layer of {of} alone ({r.family}, `{r.architecture}`): an **MTP sidecar**. "
        "It holds no model to serve; it puts the MTP back into a quant of that base model that lost it (most "
        "load-quantize-save pipelines drop it), so speculative decoding works again.",
        "",
        "## Contents",
        "",
        "| | |",
        "|---|---|",
        f"| Base model | {f'`{base}`{at}' if base else 'not recorded'} |",
        f"| Tensors | {r.mtp_present_tensors} `mtp.*` tensors ({format_bytes(r.mtp_bytes)}) in {shards} |",
        f"| Precision | {r.mtp_precision} |",
        f"| Declared by `config.json` | {r.mtp_declaration} (the base model's config, as it was) |",
        "",
        "The tensors are the base model's own bytes, under their original names, with an index. `config.json` is the "
        "base model's: `mtpquant graft` checks a quant's lineage against it before it writes anything.",
        "",
        "## Use",
        "",
        "Put it into a quant of the base model (mtpquant fetches only the MTP's bytes, by ranged reads; "
        "tested by mtpquant, locally and through the Hub):",
        "",
        "```bash",
        f"mtpquant graft QUANT --from {repo}{rev} --out QUANT-with-mtp",
        "mtpquant inspect QUANT-with-mtp",
        "```",
        "",
        "QUANT is a directory or a Hub repo id; `--in-place` instead of `--out` changes a local QUANT. The MTP goes in "
        "as it is here (excluded from quantization), and `mtpquant inspect` says whether vLLM and SGLang will load it.",
        "",
        "As a separate draft model, without grafting (**not tested by mtpquant**; the engines accept a separate draft "
        "model path for MTP, but whether they load this layout from it is not verified here):",
        "",
        "```bash",
        f'vllm serve QUANT --speculative-config \'{{"method":"mtp","model":"{repo}","num_speculative_tokens":{N}}}\'',
        f"python -m sglang.launch_server --model-path QUANT --speculative-algorithm NEXTN "
        f"--speculative-draft-model-path {repo} --speculative-num-steps {N} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {N + 1}",
        "```",
        "",
        "## Provenance",
        "",
    ]
    for step in facts.provenance.steps:
        if step.command:
            lines += [f"`{step.tool}` by mtpquant {step.mtpquant_version or '(version not recorded)'}:", ""]
            lines += ["```bash", public_command(step), "```", ""]
    if base:
        lines.append(f"Base model `{base}`{at} from {origin}.")
    else:
        lines.append(
            "Base model: unknown (`mtpquant publish OUT --repo ID --base-model ORG/NAME` names it), so the card's "
            "metadata names none."
        )
    lines += ["", license_line(facts, "Licence: the licence of the base model applies.")]
    lines += ["", f"Card generated and published by mtpquant {__version__} (`mtpquant publish`)."]
    return lines
