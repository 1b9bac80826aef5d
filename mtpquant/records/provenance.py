"""Provenance: how a checkpoint directory was made, as data (``mtpquant_provenance.json``).

``convert`` writes one step (the source and the Hub commit it resolved to, the command, the versions of
mtpquant, nvidia-modelopt, transformers and torch, the MTP mode and the recipe); ``graft`` adds its step to
what QUANT already records. ``publish`` reads it for the model card, as typed data. Schema
``mtpquant.records.provenance/1``:

    {"schema": ..., "steps": [{"tool", "created", "command": [...], "mtpquant_version", "versions": {...},
      "source": {"repo_id", "revision", "commit", "path"}, "mode", "recipe", "recipe_file", "base_model",
      "base_model_revision", "license": {"license", "license_name", "license_link"}}, ...]}

A ``heal`` step also records what heal did (``"heal"``: ``HealRecord``: the MTP's precision, the data, the schedule,
the seed, and the held-out AL per k before and after with the paired 95 % interval of the change); the key is absent
from other steps. A heal checked at other sampling settings than the default (greedy) one also records the check
at each (``"checks"``: the sampling settings, the verification rule, the AL per k, better / worse); absent, the
check was greedy. Steps are oldest first; every field but ``tool`` may be null. The file goes to the Hub with the
checkpoint, so it names local directories by their base name only (``mtpquant.public``): ``command`` as run with
each local path shortened, ``source.path`` the source directory's name. ``license`` is the licence the source's own
card declared (its README.md metadata), read when the step ran so the card does not need the source later.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from mtpquant import __version__
from mtpquant.checkpoint.source import CheckpointSource, LocalSource, SourceRef, is_repo_id, read_json, read_text
from mtpquant.errors import BaseModelError, CheckpointError
from mtpquant.net import safejson
from mtpquant.records.record import Record
from mtpquant.records.sampling import SamplingSettings

__all__ = [
    "PROVENANCE_FILE",
    "PROVENANCE_SCHEMA",
    "BaseModelError",
    "HealAl",
    "HealCheck",
    "HealRecord",
    "Provenance",
    "Step",
    "check_base_model",
    "check_replaceable",
    "library_versions",
    "read_provenance",
    "source_license",
    "source_provenance",
]

log = logging.getLogger(__name__)

PROVENANCE_FILE = "mtpquant_provenance.json"
PROVENANCE_SCHEMA: Literal["mtpquant.records.provenance/1"] = "mtpquant.records.provenance/1"
_PROVENANCE_LIMIT = 16 * 1024 * 1024
_LIBRARIES = ("nvidia-modelopt", "transformers", "torch", "huggingface_hub", "safetensors")


def library_versions(names: Sequence[str] = _LIBRARIES) -> dict[str, str]:
    """Installed versions of the libraries that shape an output (absent ones left out)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _rounded(v: float) -> float | None:
    return round(v, 6) if math.isfinite(v) else None


_AL = ("before", "after", "low", "high")


@dataclass(frozen=True)
class HealAl(Record):
    """The held-out AL at one k before and after heal, and the paired 95 % interval of the change; as JSON
    ``{"k", "before", "after", "low", "high"}``, rounded to 6 digits, a non-finite value null."""

    k: int
    before: float
    after: float
    low: float
    high: float

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """Six digits; null where not finite."""
        return {k: _rounded(v) if k in _AL else v for k, v in data.items()}

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A null value reads as NaN."""
        return {k: float("nan") if k in _AL and v is None else v for k, v in data.items()}


@dataclass(frozen=True)
class HealCheck(Record):
    """heal's held-out check at one sampling setting: the settings (``{"temperature", "top_p", "top_k", "seed"}``),
    the rule that verified the drafts, the AL per k before and after, and whether it was better beyond noise (under
    heal's decision rule: at the served k, or every k with --strict) or worse (at some k)."""

    sampling: SamplingSettings
    rule: str
    by_k: tuple[HealAl, ...]
    better: bool
    worse: bool = False


@dataclass(frozen=True)
class HealRecord(Record):
    """What ``mtpquant heal`` did to the MTP: precision, data, schedule, seed, the held-out check."""

    precision: str  # "BF16", "NVFP4 (W4A4)", ...
    data: str  # where the prompts came from
    sequences: int  # sequences the quantized target produced
    tokens: int
    sampled: int  # of the sequences, those sampled at the temperature (the rest greedy)
    temperature: float
    steps: int
    lr: float
    batch_size: int
    chain: int
    seed: int
    check_sequences: int  # held-out sequences of the check
    by_k: tuple[HealAl, ...]  # at the first setting checked (greedy by default)
    better: bool  # better beyond noise under the rule (at served_k, or every k: strict) and worse at no k
    forced: bool = False  # written with --force although the check did not show it better
    checks: tuple[HealCheck, ...] = ()  # the check at each setting, when not the default alone (greedy)
    served_k: int | None = None  # the k the decision was made at (None: a record from before it; every k)
    strict: bool = False  # --strict: better beyond noise at every k was required

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """``checks`` only when the check ran at other settings than the default one (greedy)."""
        return data if self.checks else {k: v for k, v in data.items() if k != "checks"}


# A step's keys, in the order the file has them (``heal`` only in a heal step).
_STEP_KEYS = (
    "tool", "created", "command", "mtpquant_version", "versions", "source", "mode", "recipe", "recipe_file",
    "base_model", "base_model_revision", "license",
)


@dataclass(frozen=True)
class Step(Record):
    """One mtpquant run that produced or changed the directory."""

    tool: str  # "convert" | "graft" | "heal" | "publish"
    command: tuple[str, ...] = ()
    source: SourceRef | None = None  # convert's SRC; graft's SRC (where the MTP came from)
    mode: str | None = None  # the MTP mode (graft: keep)
    recipe: str | None = None  # the recipe's name
    recipe_file: str | None = None  # the resolved recipe written into the directory
    base_model: str | None = None  # a Hub model id the user named (--base-model), or None
    base_model_revision: str | None = None
    license: Mapping[str, str] | None = None  # the source card's licence fields, as declared there
    heal: HealRecord | None = None  # a heal step: what it did
    mtpquant_version: str = __version__
    versions: Mapping[str, str] = field(default_factory=library_versions)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The step's JSON object (an empty licence as null; ``heal`` only in a heal step)."""
        out = {key: data[key] for key in _STEP_KEYS} | {"license": data["license"] or None}
        return out | ({"heal": data["heal"]} if self.heal is not None else {})

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """What a step read does not record is unknown (empty), never this run's versions or time."""
        return {"mtpquant_version": "", "versions": {}, "created": "", **data}


@dataclass(frozen=True)
class Provenance(Record):
    """Every recorded step, oldest first."""

    steps: tuple[Step, ...] = ()
    schema: Literal["mtpquant.records.provenance/1"] = field(default=PROVENANCE_SCHEMA, kw_only=True)

    def then(self, step: Step) -> Provenance:
        """This provenance with one more step. The same command run again (a rerun that completes an
        interrupted one, which may have recorded its step already) replaces the last step instead."""
        last = self.latest
        if last is not None and (last.tool, last.command, last.source, last.mode) == (
            step.tool,
            step.command,
            step.source,
            step.mode,
        ):
            return Provenance((*self.steps[:-1], step))
        return Provenance((*self.steps, step))

    @property
    def origin(self) -> Step | None:
        """The step that made the checkpoint (the first convert), or the first step."""
        return next((s for s in self.steps if s.tool == "convert"), self.steps[0] if self.steps else None)

    @property
    def latest(self) -> Step | None:
        """The last step."""
        return self.steps[-1] if self.steps else None

    @property
    def mode(self) -> str | None:
        """The MTP mode the directory's MTP is in now (the last step that set one)."""
        return next((s.mode for s in reversed(self.steps) if s.mode), None)

    @property
    def base_model(self) -> tuple[str | None, str | None]:
        """The base model a step names explicitly, with its revision."""
        for s in reversed(self.steps):
            if s.base_model:
                return s.base_model, s.base_model_revision
        return None, None

    @property
    def heal(self) -> HealRecord | None:
        """What the last heal did, when the MTP now in the directory is a healed one (no later step replaced it)."""
        for s in reversed(self.steps):
            if s.heal is not None:
                return s.heal
            if s.tool in ("convert", "graft"):
                return None
        return None

    @property
    def license(self) -> Mapping[str, str] | None:
        """The licence the source's card declared (the first step that recorded one)."""
        return next((s.license for s in self.steps if s.license), None)

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The file's JSON: the schema, then the steps."""
        return {"schema": PROVENANCE_SCHEMA, "steps": data["steps"]}

    def to_bytes(self) -> bytes:
        """The file's bytes."""
        return (json.dumps(self.to_json(), indent=2) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, d: Any, where: str = PROVENANCE_FILE) -> Provenance:
        """Read the file's JSON; ``ValueError`` naming the place of the first problem (another schema too)."""
        return super().from_json(d, where)


def source_provenance(source: CheckpointSource) -> Provenance:
    """The provenance a checkpoint records (empty when there is none, or it is unreadable: warned)."""
    if not source.exists(PROVENANCE_FILE):
        return Provenance()
    try:
        return Provenance.from_json(read_json(source, PROVENANCE_FILE))
    except (CheckpointError, ValueError) as exc:
        log.warning("%s: %s is not readable (%s); ignoring it", source.label, PROVENANCE_FILE, exc)
        return Provenance()


def read_provenance(directory: Path) -> Provenance:
    """The provenance recorded in a local directory."""
    return source_provenance(LocalSource(Path(directory)))


def check_replaceable(path: Path) -> None:
    """``--overwrite`` replaces only what mtpquant wrote: an empty directory, or a directory (not a link) holding a
    readable ``mtpquant_provenance.json`` (its own regular file). Anything else is refused (exit 5), naming it."""
    from mtpquant.errors import OutputExistsError

    mine = "--overwrite replaces only a checkpoint mtpquant wrote"
    if path.is_symlink():
        raise OutputExistsError(
            f"{path}: is a symbolic link, not a checkpoint mtpquant wrote; not replacing it ({mine})"
        )
    if not path.is_dir():
        raise OutputExistsError(f"{path}: is a file, not a checkpoint mtpquant wrote; not replacing it ({mine})")
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return
    prov = path / PROVENANCE_FILE
    if prov.is_file() and not prov.is_symlink() and prov.stat().st_size <= _PROVENANCE_LIMIT:
        try:
            Provenance.from_json(safejson.loads(prov.read_bytes()))
            return
        except (OSError, ValueError):
            pass
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    raise OutputExistsError(
        f"{path}: not a checkpoint mtpquant wrote (no readable {PROVENANCE_FILE}; it holds {len(entries)} "
        f"entr{'y' if len(entries) == 1 else 'ies'}: {shown}); not replacing it ({mine}): remove it yourself or "
        "choose another output"
    )


def check_base_model(repo_id: str | None, revision: str | None = None) -> tuple[str | None, str | None]:
    """``--base-model`` / ``--base-model-revision`` as given, or a one-line error for a malformed value."""
    if repo_id is None:
        if revision is not None:
            raise BaseModelError("--base-model-revision needs --base-model")
        return None, None
    if not is_repo_id(repo_id):
        raise BaseModelError(
            f"--base-model {repo_id!r}: not a Hub model id (ORG/NAME, letters, digits, '-', '_' and '.')"
        )
    if revision is not None and (not revision or any(c.isspace() for c in revision)):
        raise BaseModelError(f"--base-model-revision {revision!r}: not a revision (a branch, tag or commit)")
    return repo_id, revision


_LICENSE_FIELDS = ("license", "license_name", "license_link")
_CARD = "README.md"
_CARD_LIMIT = 1024 * 1024


def card_license_fields(text: str) -> dict[str, str] | None:
    """The licence fields (``license``, ``license_name``, ``license_link``) a model card's metadata block declares;
    None without a block, a readable one, or a licence."""
    import yaml
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    m = REGEX_YAML_BLOCK.search(text)
    try:
        data = yaml.safe_load(m.group(2)) if m else None
    except yaml.YAMLError:
        return None
    if not isinstance(data, Mapping):
        return None
    lic = data.get("license")
    if isinstance(lic, list) and len(lic) == 1:
        lic = lic[0]
    if not isinstance(lic, str) or not lic.strip():
        return None
    out = {"license": lic.strip()}
    out |= {k: str(data[k]) for k in _LICENSE_FIELDS[1:] if isinstance(data.get(k), str) and data[k]}
    return out


def source_license(source: CheckpointSource) -> dict[str, str] | None:
    """The licence fields a checkpoint's own card (README.md metadata) declares; None without a card or fields."""
    try:
        if not source.exists(_CARD):
            return None
        text = read_text(source, _CARD, limit=_CARD_LIMIT, what="model card")
    except CheckpointError as exc:
        log.warning("%s: %s not readable (%s); its licence is not recorded", source.label, _CARD, exc)
        return None
    return card_license_fields(text)
