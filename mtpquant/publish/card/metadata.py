"""Card metadata: the Hub's field rules, licences, repo ids, and secret masking.

The metadata is built with huggingface_hub's ``ModelCardData`` (``body.card_data``). Its own check,
``RepoCard.validate``, is an online call to huggingface.co/api/validate-yaml that ignores ``HF_ENDPOINT``,
so the same rules are checked here offline, before anything is sent (``validate_card_metadata``): licence
ids, ``base_model`` ids and relation, list fields, the task id.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mtpquant.checkpoint.source import is_repo_id
from mtpquant.net.http import scrub_credentials

__all__ = [
    "BASE_MODEL_RELATIONS",
    "CARD_NAME",
    "HUB_LICENSES",
    "LicenseInfo",
    "is_repo_id",
    "license_from_mapping",
    "normalize_license",
    "redact",
    "validate_card_metadata",
]

CARD_NAME = "README.md"
# The Hub's license identifiers (https://huggingface.co/docs/hub/repositories-licenses).
HUB_LICENSES = frozenset(
    """
    apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0
    bigcode-openrail-m afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc
    cc0-1.0 cc-by-2.0 cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 cc-by-nc-4.0
    cc-by-nd-4.0 cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0 cdla-sharing-1.0
    cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1 agpl-3.0 gfdl
    gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc lppl-1.3c ms-pl mpl-2.0 odc-by odbl openrail++ osl-3.0
    postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr deepfloyd-if-license llama2 llama3 llama3.1 llama3.2
    llama3.3 gemma unknown other
    """.split()  # noqa: SIM905
)
# https://huggingface.co/docs/hub/model-cards#specifying-a-base-model
BASE_MODEL_RELATIONS = frozenset({"adapter", "merge", "quantized", "finetune"})
# Task ids the card may declare (the subset relevant here; the Hub knows many more).
_PIPELINE_TAGS = frozenset({"text-generation", "image-text-to-text", "any-to-any", "text2text-generation"})
_LIST_OF_STR_FIELDS = ("tags", "datasets", "metrics")
_STR_OR_LIST_FIELDS = ("language", "base_model")
_STR_FIELDS = ("library_name", "license_name", "license_link", "pipeline_tag", "model_name")

# Secret-looking strings that must never reach a card, a log or an error: Hub tokens and `--token X`.
_TOKEN_RE = re.compile(r"\bhf_[A-Za-z0-9]{8,}\b")
_TOKEN_FLAG_RE = re.compile(r"(--(?:hf-)?token[= ]|HF_TOKEN=|HUGGING_FACE_HUB_TOKEN=)(\S+)")


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with the given secrets, anything shaped like a Hub token and ``--token`` values masked, and
    ``user:password@`` removed from URLs."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    text = _TOKEN_FLAG_RE.sub(lambda m: m.group(1) + "***", text)
    return scrub_credentials(_TOKEN_RE.sub("hf_***", text))


@dataclass(frozen=True)
class LicenseInfo:
    """A licence as the Hub's metadata spells it."""

    license: str
    license_name: str | None = None
    license_link: str | None = None
    origin: str = ""  # where it was found, for the card body


def license_from_mapping(data: Mapping[str, Any], origin: str) -> LicenseInfo | None:
    value = data.get("license")
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value.strip():
        return None
    name = data.get("license_name") if isinstance(data.get("license_name"), str) else None
    link = data.get("license_link") if isinstance(data.get("license_link"), str) else None
    return normalize_license(value.strip(), name, link, origin)


def normalize_license(value: str, name: str | None, link: str | None, origin: str) -> LicenseInfo:
    """A licence in the Hub's vocabulary: a known id as is, anything else as ``other`` with its name."""
    lowered = value.lower()
    if lowered in HUB_LICENSES:
        if lowered == "other":
            return LicenseInfo("other", _slug(name) if name else "other", link, origin)
        return LicenseInfo(lowered, None, None, origin)
    return LicenseInfo("other", _slug(name or value), link, origin)


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")
    return slug or "other"


# ---- card metadata validation -----------------------------------------------------------------------------------
def validate_card_metadata(meta: Mapping[str, Any]) -> list[str]:
    """Problems with card metadata by the Hub's field types (empty list: valid).

    Checks what the Hub checks on push for the fields a model card uses: ``license`` is a Hub licence id
    (``other`` needs ``license_name``), ``base_model`` holds model ids, ``base_model_relation`` is one of the
    Hub's relations and comes with a ``base_model``, list fields hold strings, ``pipeline_tag`` is a task id.
    """
    problems: list[str] = []
    if not isinstance(meta, Mapping):
        return ["metadata is not a mapping"]
    for key in meta:
        if not isinstance(key, str):
            problems.append(f"metadata key {key!r} is not a string")
    lic = meta.get("license")
    if lic is not None:
        values = lic if isinstance(lic, list) else [lic]
        for v in values:
            if not isinstance(v, str) or v not in HUB_LICENSES:
                problems.append(f"license {v!r} is not a Hub licence identifier")
        if "other" in values and not (isinstance(meta.get("license_name"), str) and meta["license_name"]):
            problems.append("license 'other' needs a license_name")
    name = meta.get("license_name")
    if name is not None and (not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name)):
        problems.append(f"license_name {name!r} must be lowercase letters, digits, '-' and '.'")
    for key in _STR_FIELDS:
        if key in meta and not (isinstance(meta[key], str) and meta[key]):
            problems.append(f"{key} must be a non-empty string, got {meta[key]!r}")
    for key in _LIST_OF_STR_FIELDS:
        if key in meta and not (isinstance(meta[key], list) and all(isinstance(v, str) and v for v in meta[key])):
            problems.append(f"{key} must be a list of non-empty strings, got {meta[key]!r}")
    for key in _STR_OR_LIST_FIELDS:
        if key not in meta:
            continue
        values = meta[key] if isinstance(meta[key], list) else [meta[key]]
        if not values or not all(isinstance(v, str) and v for v in values):
            problems.append(f"{key} must be a string or a list of strings, got {meta[key]!r}")
    base = meta.get("base_model")
    if base is not None:
        for v in base if isinstance(base, list) else [base]:
            if not is_repo_id(v):
                problems.append(f"base_model {v!r} is not a Hub model id (namespace/name)")
    relation = meta.get("base_model_relation")
    if relation is not None:
        if relation not in BASE_MODEL_RELATIONS:
            problems.append(f"base_model_relation {relation!r} is not one of {sorted(BASE_MODEL_RELATIONS)}")
        if base is None:
            problems.append("base_model_relation without base_model")
    tag = meta.get("pipeline_tag")
    if tag is not None and tag not in _PIPELINE_TAGS:
        problems.append(f"pipeline_tag {tag!r} is not a known task id")
    return problems


