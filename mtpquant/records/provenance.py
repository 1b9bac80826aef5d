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
from other steps. Steps are oldest first; every field but ``tool`` may be null. The file goes to the Hub with the
checkpoint, so it names local directories by their base name only (``mtpquant.public``): ``command`` as run with
each local path shortened, ``source.path`` the source directory's name. ``license`` is the licence the source's own
card declared (its README.md metadata), read when the step ran so the card does not need the source later.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from mtpquant import __version__
from mtpquant.checkpoint.source import CheckpointSource, LocalSource, SourceRef, is_repo_id, read_json, read_text
from mtpquant.errors import BaseModelError, CheckpointError
from mtpquant.net import safejson

__all__ = [
    "PROVENANCE_FILE",
    "PROVENANCE_SCHEMA",
    "BaseModelError",
    "HealAl",
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
PROVENANCE_SCHEMA = "mtpquant.records.provenance/1"
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


def _ref_json(ref: SourceRef | None) -> dict[str, Any] | None:
    if ref is None:
        return None
    return {"repo_id": ref.repo_id, "revision": ref.revision, "commit": ref.commit, "path": ref.path}


def _ref_from(value: Any) -> SourceRef | None:
    if not isinstance(value, Mapping):
        return None

    def s(key: str) -> str | None:
        v = value.get(key)
        return v if isinstance(v, str) and v else None

    return SourceRef(repo_id=s("repo_id"), revision=s("revision"), commit=s("commit"), path=s("path"))


def _num(d: Mapping[str, Any], key: str, kind: type = float) -> Any:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"heal record: {key} is not a number")
    return kind(value)


@dataclass(frozen=True)
class HealAl:
    """The held-out AL at one k before and after heal, and the paired 95 % interval of the change."""

    k: int
    before: float
    after: float
    low: float
    high: float

    def to_json(self) -> dict[str, Any]:
        """``{"k", "before", "after", "low", "high"}`` (a non-finite interval end is null)."""

        def num(v: float) -> float | None:
            return round(v, 6) if v == v and abs(v) != float("inf") else None

        return {"k": self.k, "before": num(self.before), "after": num(self.after), "low": num(self.low),
                "high": num(self.high)}

    @classmethod
    def from_json(cls, d: Any) -> HealAl:
        """Read one row; ``ValueError`` when it is not one."""
        if not isinstance(d, Mapping):
            raise ValueError("heal record: a by_k row is not an object")

        def num(key: str) -> float:
            v = d.get(key)
            return float("nan") if v is None else float(_num(d, key))

        return cls(_num(d, "k", int), num("before"), num("after"), num("low"), num("high"))


@dataclass(frozen=True)
class HealRecord:
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
    by_k: tuple[HealAl, ...]
    better: bool  # better beyond noise at every k
    forced: bool = False  # written with --force although the check did not show it better

    def to_json(self) -> dict[str, Any]:
        """The step's ``heal`` object."""
        return {
            "precision": self.precision,
            "data": self.data,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "sampled": self.sampled,
            "temperature": self.temperature,
            "steps": self.steps,
            "lr": self.lr,
            "batch_size": self.batch_size,
            "chain": self.chain,
            "seed": self.seed,
            "check_sequences": self.check_sequences,
            "by_k": [row.to_json() for row in self.by_k],
            "better": self.better,
            "forced": self.forced,
        }

    @classmethod
    def from_json(cls, d: Any) -> HealRecord:
        """Read a ``heal`` object; ``ValueError`` when it is not one."""
        if not isinstance(d, Mapping) or not isinstance(d.get("by_k"), list):
            raise ValueError("heal record: not an object with by_k")
        return cls(
            precision=str(d.get("precision", "")),
            data=str(d.get("data", "")),
            sequences=_num(d, "sequences", int),
            tokens=_num(d, "tokens", int),
            sampled=_num(d, "sampled", int),
            temperature=_num(d, "temperature"),
            steps=_num(d, "steps", int),
            lr=_num(d, "lr"),
            batch_size=_num(d, "batch_size", int),
            chain=_num(d, "chain", int),
            seed=_num(d, "seed", int),
            check_sequences=_num(d, "check_sequences", int),
            by_k=tuple(HealAl.from_json(r) for r in d["by_k"]),
            better=bool(d.get("better")),
            forced=bool(d.get("forced")),
        )


@dataclass(frozen=True)
class Step:
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

    def to_json(self) -> dict[str, Any]:
        """The step's JSON object."""
        return {
            "tool": self.tool,
            "created": self.created,
            "command": list(self.command),
            "mtpquant_version": self.mtpquant_version,
            "versions": dict(self.versions),
            "source": _ref_json(self.source),
            "mode": self.mode,
            "recipe": self.recipe,
            "recipe_file": self.recipe_file,
            "base_model": self.base_model,
            "base_model_revision": self.base_model_revision,
            "license": dict(self.license) if self.license else None,
        } | ({"heal": self.heal.to_json()} if self.heal is not None else {})

    @classmethod
    def from_json(cls, d: Any) -> Step:
        """Read a step; ``ValueError`` when it is not one."""
        if not isinstance(d, Mapping) or not isinstance(d.get("tool"), str):
            raise ValueError("a provenance step needs a 'tool'")

        def s(key: str) -> str | None:
            v = d.get(key)
            return v if isinstance(v, str) and v else None

        command = d.get("command")
        versions = d.get("versions")
        lic = d.get("license")
        heal = d.get("heal")
        return cls(
            tool=str(d["tool"]),
            command=tuple(str(c) for c in command) if isinstance(command, list) else (),
            source=_ref_from(d.get("source")),
            mode=s("mode"),
            recipe=s("recipe"),
            recipe_file=s("recipe_file"),
            base_model=s("base_model"),
            base_model_revision=s("base_model_revision"),
            license={str(k): v for k, v in lic.items() if isinstance(v, str)} if isinstance(lic, Mapping) else None,
            heal=HealRecord.from_json(heal) if heal is not None else None,
            mtpquant_version=s("mtpquant_version") or "",
            versions={str(k): str(v) for k, v in versions.items()} if isinstance(versions, Mapping) else {},
            created=s("created") or "",
        )


@dataclass(frozen=True)
class Provenance:
    """Every recorded step, oldest first."""

    steps: tuple[Step, ...] = ()

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

    def to_json(self) -> dict[str, Any]:
        """The file's JSON."""
        return {"schema": PROVENANCE_SCHEMA, "steps": [s.to_json() for s in self.steps]}

    def to_bytes(self) -> bytes:
        """The file's bytes."""
        return (json.dumps(self.to_json(), indent=2) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, d: Any) -> Provenance:
        """Read the file's JSON; ``ValueError`` for another schema."""
        if not isinstance(d, Mapping) or d.get("schema") != PROVENANCE_SCHEMA or not isinstance(d.get("steps"), list):
            raise ValueError(f"not an {PROVENANCE_SCHEMA} document")
        return cls(tuple(Step.from_json(s) for s in d["steps"]))


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
