"""What the card says, gathered from OUT as typed data: the inspect report, the provenance file, the resolved
recipe, a validation report (``validate.schema.Report``), the licence. A fact that is not known is left out of
the metadata and said to be unknown in the body; what goes public names local directories by their base name.
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpquant.checkpoint.precision import is_quantized
from mtpquant.checkpoint.source import looks_like_repo_id
from mtpquant.net import safejson
from mtpquant.public import public_args
from mtpquant.public import public_text as _public_text
from mtpquant.publish.card.metadata import CARD_NAME, LicenseInfo, is_repo_id, license_from_mapping, redact
from mtpquant.records.profile import PROFILE_FILE
from mtpquant.records.provenance import Provenance, Step, card_license_fields
from mtpquant.records.validation import MARKDOWN_FILE, REPORT_DIR, REPORT_FILE

if TYPE_CHECKING:
    from mtpquant.diagnose.report import InspectReport
    from mtpquant.records.profile import ProfileHeadline
    from mtpquant.records.validation import Report
    from mtpquant.search.run import SearchResult

__all__ = [
    "VALIDATION_MARKDOWN",
    "VALIDATION_PROFILE",
    "VALIDATION_REPORT",
    "CardFacts",
    "RecipeFile",
    "Validation",
    "base_model",
    "license_line",
    "license_metadata",
    "mtp_mode",
    "public_command",
    "public_text",
    "read_license",
    "read_recipe",
    "read_validation",
    "report_outdated_by",
]

log = logging.getLogger(__name__)

# A validation report inside OUT (written by `mtpquant validate ... --report-dir OUT/validation`).
VALIDATION_REPORT = f"{REPORT_DIR}/{REPORT_FILE}"
VALIDATION_MARKDOWN = f"{REPORT_DIR}/{MARKDOWN_FILE}"
VALIDATION_PROFILE = f"{REPORT_DIR}/{PROFILE_FILE}"
_REPORT_LIMIT = 64 * 1024 * 1024  # a validation report is a few KB
_HF_CACHE_SNAPSHOT = re.compile(r"models--([A-Za-z0-9][\w.-]*)--([\w.-]+)[/\\]snapshots[/\\]")


@dataclass(frozen=True)
class RecipeFile:
    """The resolved recipe file convert wrote into OUT (its name, text and parsed YAML; the recipe itself is
    ``convert.recipes.Recipe``)."""

    file: str
    text: str
    data: Mapping[str, Any]


@dataclass(frozen=True)
class Validation:
    """A validation report found in OUT: the typed report, or None when it is in a shape this card does not read."""

    file: str
    markdown: str | None
    report: Report | None
    profile: ProfileHeadline | None = None  # validation/speculation_profile.json's headline, when there is one


@dataclass(frozen=True)
class CardFacts:
    """Everything the card says, gathered by ``publish`` before it builds the card."""

    repo_id: str
    report: InspectReport
    family_key: str
    config: Mapping[str, Any]
    hf_quant_config: Mapping[str, Any] | None
    provenance: Provenance
    license: LicenseInfo | None
    validation: Validation | None
    recipe: RecipeFile | None = None
    revision: str | None = None
    forced: bool = False
    license_file: str | None = None  # a LICENSE file shipped in OUT (carried over from the source)
    search: SearchResult | None = None  # mtp_search/report.json, while the MTP in OUT is the one the search chose


# ---- reading OUT ---------------------------------------------------------------------------------------------------
def read_recipe(out: Path, provenance: Provenance) -> RecipeFile | None:
    """The resolved recipe the provenance names (``mtpquant_recipe.yaml``), parsed; None when absent."""
    import yaml

    origin = provenance.origin
    name = origin.recipe_file if origin is not None else None
    if not name or not (out / name).is_file():
        return None
    try:
        text = (out / name).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        log.warning("%s: not readable as YAML (%s); the card omits it", name, exc)
        return None
    return RecipeFile(name, text, data if isinstance(data, dict) else {})


def read_validation(out: Path) -> Validation | None:
    """The validation report in OUT (``validation/report.json``), typed; None when there is none."""
    from mtpquant.records.validation import Report

    path = out / VALIDATION_REPORT
    if not path.is_file():
        return None
    md = VALIDATION_MARKDOWN if (out / VALIDATION_MARKDOWN).is_file() else None
    try:
        report: Report | None = Report.from_json(safejson.loads(path.read_bytes(), limit=_REPORT_LIMIT))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        log.warning("%s: not a validation report this card reads (%s)", path, exc)
        report = None
    return Validation(VALIDATION_REPORT, md, report, _profile(out))


def _profile(out: Path) -> ProfileHeadline | None:
    from mtpquant.records.profile import profile_headline

    path = out / VALIDATION_PROFILE
    if not path.is_file():
        return None
    try:
        data = safejson.loads(path.read_bytes(), limit=_REPORT_LIMIT)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        log.warning("%s: not a speculation profile this card reads (%s)", path, exc)
        return None
    return profile_headline(data) if isinstance(data, dict) else None


def report_outdated_by(provenance: Provenance, created: str) -> Step | None:
    """The step that changed the checkpoint after a validation report made at ``created`` (ISO time): its last
    step other than ``publish`` (which changes no weight or metadata), when that came later; None when the report
    is the newer one, or a time is not recorded. Such a report describes the checkpoint as it was before."""
    last = next((s for s in reversed(provenance.steps) if s.tool != "publish"), None)
    if last is None:
        return None
    try:
        return last if datetime.fromisoformat(last.created) > datetime.fromisoformat(created) else None
    except (TypeError, ValueError):  # not recorded, or one time without a zone
        return None


def _license_from_card_text(text: str, origin: str) -> LicenseInfo | None:
    fields = card_license_fields(text)
    return license_from_mapping(fields, origin) if fields else None


def license_metadata(facts: CardFacts) -> dict[str, Any]:
    """The card metadata's licence fields (``ModelCardData`` keyword arguments), None where not known."""
    lic = facts.license
    if lic is None:
        return {"license": None, "license_name": None, "license_link": None}
    link = lic.license_link or (facts.license_file if lic.license == "other" else None)
    return {"license": lic.license, "license_name": lic.license_name, "license_link": link}


def license_line(facts: CardFacts, unknown: str) -> str:
    """The card body's licence sentence; ``unknown`` when no licence is recorded."""
    lic = facts.license
    if lic is None:
        return unknown
    text = lic.license if lic.license != "other" else f"other ({lic.license_name})"
    return f"Licence `{text}`, carried over from {lic.origin}: the licence of the base model applies."


def read_license(provenance: Provenance, config: Mapping[str, Any], existing_card: str | None) -> LicenseInfo | None:
    """The source model's licence: as the source's card declared it (recorded in the provenance when the
    checkpoint was made), else OUT's previous card, else config.json."""
    recorded = provenance.license
    if recorded:
        lic = license_from_mapping(recorded, f"the source card ({CARD_NAME} of SRC)")
        if lic is not None:
            return lic
    if existing_card is not None:
        lic = _license_from_card_text(existing_card, f"the previous {CARD_NAME} in OUT")
        if lic is not None:
            return lic
    return license_from_mapping(config, "config.json")


# ---- derived facts -------------------------------------------------------------------------------------------------
def _repo_from_path(value: str) -> str | None:
    m = _HF_CACHE_SNAPSHOT.search(value)
    return f"{m.group(1)}/{m.group(2)}" if m else None


def base_model(facts: CardFacts) -> tuple[str | None, str | None, str]:
    """(Hub id, revision, where it was found) of the base model, when one is known."""
    explicit, revision = facts.provenance.base_model
    if explicit:
        return explicit, revision, "the provenance file (--base-model)"
    origin = facts.provenance.origin
    src = origin.source if origin is not None else None
    if src is not None and src.repo_id:
        return src.repo_id, src.commit or src.revision, "the provenance file (source)"
    name = facts.config.get("_name_or_path")
    if isinstance(name, str):
        derived = name if is_repo_id(name) and looks_like_repo_id(name) else _repo_from_path(name)
        if derived is not None:
            return derived, None, "config.json (_name_or_path)"
    return None, None, ""


def base_model_link(base: str | None, suffix: str = "") -> str:
    """The card's phrase for the base model: a link to its Hub page, then ``suffix`` (a revision, say)."""
    return f"[`{base}`](https://huggingface.co/{base}){suffix}" if base else "a base model that is not recorded"


def mtp_mode(facts: CardFacts) -> str:
    """The MTP mode: as recorded, else worked out from the checkpoint (a quant other tools made)."""
    recorded = facts.provenance.mode
    if recorded:
        return recorded
    r = facts.report
    if r.mtp_present_tensors == 0:
        return "missing" if r.mtp_declared else "drop"
    return "quantize" if any(is_quantized(m.disk) for m in r.mtp_modules) else "keep"


def public_text(text: str) -> str:
    """Free text fit for a public card: absolute local paths shortened to ``.../<last component>``, tokens masked."""
    return redact(_public_text(text))


def public_command(step: Step) -> str:
    """A step's command line for the public card (local directories by base name, tokens masked)."""
    return redact(shlex.join(public_args(step.command, step.source)))
