"""The model card ``publish`` uploads: what was quantized, what stayed BF16, where the MTP is and how to serve it.

Built from facts only (``facts``: the inspect report of OUT, its provenance file, resolved recipe and validation
report, read as typed data), with huggingface_hub's ``ModelCard`` / ``ModelCardData`` (``body``), checked
against the Hub's metadata rules (``metadata``) and sealed so the next publish can tell a generated card from
one a person edited (``marker``).
"""

from __future__ import annotations

from mtpquant.card_marker import card_origin
from mtpquant.publish.card.body import build_card, card_data
from mtpquant.publish.card.facts import CardFacts, read_license, read_recipe, read_validation
from mtpquant.publish.card.metadata import CARD_NAME, is_repo_id, redact, validate_card_metadata
from mtpquant.publish.card.search import read_search

__all__ = [
    "CARD_NAME",
    "CardFacts",
    "build_card",
    "card_data",
    "card_origin",
    "is_repo_id",
    "read_license",
    "read_recipe",
    "read_search",
    "read_validation",
    "redact",
    "validate_card_metadata",
]
