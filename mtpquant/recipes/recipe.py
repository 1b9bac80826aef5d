"""Convert recipes: validated YAML shipped in ``mtpquant/recipes/``, resolvable by name or path.

A recipe says what the main model becomes (scheme, which Linears, calibration algorithm, extra
exclusions), how it is calibrated, and what happens to the MTP. Unknown keys are errors naming the
key and the file (pydantic checks each file against the typed sections, ``extra="forbid"``, strict leaves);
``--set section.key=value`` overrides any leaf. ``to_modelopt_config`` turns the
quantization section into the ``mtq.quantize`` config dict, starting from modelopt's own entries so
its list of never-quantize modules (routers, conv1d, vision, ``mtp.*``) is kept.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import importlib.resources
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)
from pydantic.dataclasses import dataclass as checked

from mtpquant.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from mtpquant.errors import RecipeError
from mtpquant.families import Family
from mtpquant.units import ByteSize

__all__ = [
    "CALIBRATION_ALGORITHMS",
    "DEFAULT_RECIPES",
    "MODELOPT_NVFP4_DISABLED",
    "MTP_FORMATS",
    "MTP_MODES",
    "RECIPE_FILE",
    "SCHEMES",
    "TARGETS",
    "CalibrationSection",
    "MtpSection",
    "OutputSection",
    "QuantizationSection",
    "Recipe",
    "apply_overrides",
    "builtin_recipe_names",
    "byte_size",
    "default_recipe_name",
    "grafted_recipe",
    "load_recipe",
    "nvfp4_quantizer_cfg",
    "quantizer_enabled",
    "recipe_excludes",
    "recipe_from_mapping",
    "tuned_recipe",
    "with_values",
]

SCHEMA_VERSION = 1
# The resolved recipe convert writes into OUT (a comment header, then the recipe as ``Recipe.to_yaml`` writes it).
RECIPE_FILE = "mtpquant_recipe.yaml"
_Scheme = Literal["nvfp4", "nvfp4_w4a16"]
_Targets = Literal["all", "experts"]
_Algorithm = Literal["max"]
_MtpMode = Literal["auto", "keep", "quantize", "extract", "drop", "search"]
_MtpFormat = Literal["nvfp4", "fp8"]
SCHEMES: tuple[str, ...] = get_args(_Scheme)
TARGETS: tuple[str, ...] = get_args(_Targets)
CALIBRATION_ALGORITHMS: tuple[str, ...] = get_args(_Algorithm)
MTP_MODES: tuple[str, ...] = get_args(_MtpMode)
MTP_FORMATS: tuple[str, ...] = get_args(_MtpFormat)

# The recipe each family converts with when none is named.
DEFAULT_RECIPES = {
    "qwen3_5": "qwen3_5-nvfp4",
    "qwen3_5_moe": "qwen3_5_moe-nvfp4",
    "qwen3_next": "qwen3_next-nvfp4",
    "qwen4_exp": "qwen4_exp-nvfp4",
    "glm4_moe": "glm4_moe-nvfp4",
    "deepseek_v3": "deepseek_v3-nvfp4",
    "deepseek_v32": "deepseek_v32-nvfp4",
    "glm_moe_dsa": "glm_moe_dsa-nvfp4",
    "step3p5": "step3p5-nvfp4",
    "mimo_v2_flash": "mimo_v2_flash-nvfp4",
    "nemotron_h": "nemotron_h-nvfp4",
}

# Routed-expert Linears as modelopt names their quantizers (fused 3-D and per-expert experts);
# mirrors the enable patterns of modelopt's NVFP4_EXPERTS_ONLY_CFG.
_EXPERT_QUANTIZER_PATTERNS = ("*.experts.*", "*block_sparse_moe*")


# A recipe file's rules, checked by pydantic: unknown keys refused; leaves strict (YAML's 1 is not "1", nor "yes" true)
_RULES = ConfigDict(extra="forbid")
_Positive = Annotated[StrictInt, Field(gt=0)]
_Names = Annotated[tuple[StrictStr, ...], BeforeValidator(lambda v: (v,) if isinstance(v, str) else v)]  # or one


def _nvfp4_block(size: int) -> int:
    if size != 16:
        raise ValueError(f"must be 16 (NVFP4 blocks are 16 elements), got {size!r}")
    return size


@checked(frozen=True, config=_RULES)
class QuantizationSection:
    """What the main model becomes."""

    scheme: _Scheme = "nvfp4"  # nvfp4 (W4A4) | nvfp4_w4a16 (weights only)
    targets: _Targets = "all"  # all Linears | routed experts only
    algorithm: _Algorithm = "max"
    group_size: Annotated[StrictInt, AfterValidator(_nvfp4_block)] = 16
    exclude: _Names = ()  # extra module-name patterns (fnmatch) left in BF16

    @property
    def activations(self) -> bool:
        """Whether activations are quantized too (W4A4)."""
        return self.scheme == "nvfp4"

    @property
    def quant_algo(self) -> str:
        """The ``quant_algo`` modelopt writes for this scheme."""
        return "NVFP4" if self.activations else "W4A16_NVFP4"


@checked(frozen=True, config=_RULES)
class CalibrationSection:
    """Calibration data: where from, how much."""

    data: StrictStr = "offline"  # offline | a .txt/.jsonl path | a `datasets` name
    samples: _Positive = 128
    seq_len: _Positive = 512
    batch_size: _Positive = 1
    chat_template: Annotated[bool, Strict()] = True  # render samples with the tokenizer's chat template when it has one


@checked(frozen=True, config=_RULES)
class MtpSection:
    """What happens to the MTP layer."""

    mode: _MtpMode = "auto"  # auto: keep when the source has an MTP, else drop; search: convert --mtp auto
    format: _MtpFormat = "nvfp4"  # quantize mode: nvfp4 | fp8
    # search: the precision it chose per MTP group (recorded in OUT's recipe; written only when there is one)
    precision: Mapping[StrictStr, Literal["bf16", "fp8", "nvfp4"]] = Field(default_factory=dict)
    # search with --heal: the chosen MTP was healed (heal's quantization-aware training) before the choice (written
    # only when it was)
    healed: StrictBool = False


def byte_size(value: Any, where: str) -> ByteSize:
    """``value`` read as a size (GB = 10^9, GiB = 2^30, as huggingface_hub; ``units.ByteSize``); a one-line
    ``RecipeError`` naming ``where`` (the flag, or the file and key) when it is not one or is not positive."""
    try:
        return ByteSize.of(value)
    except ValueError as exc:
        raise RecipeError(f"{where}: {exc}") from None


@checked(frozen=True, config=_RULES)
class OutputSection:
    """Output layout."""

    max_shard_size: Annotated[ByteSize, PlainValidator(ByteSize.of)] = ByteSize("5GB", DEFAULT_MAX_SHARD_BYTES)


def _known_families(families: tuple[str, ...]) -> tuple[str, ...]:
    from mtpquant.families import FAMILIES

    known = {f.key for f in FAMILIES}
    unknown = next((f for f in families if f not in known), None)
    if unknown is not None:
        raise ValueError(f"unknown family {unknown!r} (known: {', '.join(sorted(known))})")
    return families


@checked(frozen=True, config=_RULES)
class Recipe:
    """A validated recipe."""

    name: Annotated[StrictStr, Field(min_length=1)]
    description: StrictStr = ""
    families: Annotated[_Names, AfterValidator(_known_families)] = ()  # empty: every family
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
    mtp: MtpSection = Field(default_factory=MtpSection)
    output: OutputSection = Field(default_factory=OutputSection)
    source: str = dataclasses.field(default="<built>", compare=False)

    # ---- serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the YAML schema (without ``source``; a size as it was written)."""
        data = _plain(self)
        data.pop("source")
        return data

    def to_yaml(self, header: str = "") -> str:
        """The recipe as YAML, with an optional comment header."""
        import yaml

        body = yaml.safe_dump({"schema": SCHEMA_VERSION, **self.to_dict()}, sort_keys=False)
        lines = [f"# {line}" if line else "#" for line in header.splitlines()]
        return ("\n".join(lines) + "\n" if lines else "") + body

    # ---- checks ---------------------------------------------------------------------------------
    def check_family(self, family: Family) -> None:
        """Refuse a recipe written for other families."""
        if self.families and family.key not in self.families:
            raise RecipeError(
                f"recipe {self.name!r} is for {', '.join(self.families)}, but the source is {family.key} "
                f"(use --recipe {DEFAULT_RECIPES.get(family.key, 'nvfp4-w4a16')})"
            )
        if self.quantization.targets == "experts" and not family.moe:
            raise RecipeError(f"recipe {self.name!r} quantizes only MoE experts, but {family.display} is dense")

    # ---- modelopt -------------------------------------------------------------------------------
    def to_modelopt_config(self, family: Family) -> dict[str, Any]:
        """The ``mtq.quantize`` config: modelopt's NVFP4 entries, the family's and recipe's exclusions."""
        kinds = ("weight", "input") if self.quantization.activations else ("weight",)
        entries: list[dict[str, Any]] = [{"quantizer_name": "*", "enable": False}]
        prefixes = ("*",) if self.quantization.targets == "all" else _EXPERT_QUANTIZER_PATTERNS
        for prefix in prefixes:
            for kind in kinds:
                entries.append({"quantizer_name": f"{prefix}{kind}_quantizer", "cfg": nvfp4_quantizer_cfg()})
        # modelopt's own never-quantize list (routers, conv1d, lm_head, vision, mtp.*, BatchNorm...).
        entries += copy.deepcopy(MODELOPT_NVFP4_DISABLED)
        for pattern in (*family.unquantized, *self.quantization.exclude):
            entries.append({"quantizer_name": _module_to_quantizer_pattern(pattern), "enable": False})
        return {"quant_cfg": entries, "algorithm": self.quantization.algorithm}


def nvfp4_quantizer_cfg() -> dict[str, Any]:
    """modelopt's NVFP4 quantizer attributes (E2M1 values, dynamic 16-element blocks, E4M3 scales)."""
    return {"num_bits": (2, 1), "effective_bits": 4.5, "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


# The `enable: False` entries of modelopt 0.47's `mtq.NVFP4_DEFAULT_CFG`, copied so that planning
# (``--dry-run``) needs no modelopt import; tests/test_recipes.py fails if modelopt's list changes.
MODELOPT_NVFP4_DISABLED: list[dict[str, Any]] = [
    {"quantizer_name": "*block_sparse_moe.gate*", "enable": False},
    {"quantizer_name": "*linear_attn.conv1d*", "enable": False},
    {"quantizer_name": "*self_attention.conv1d*", "enable": False},
    {"quantizer_name": "*linear_attn.in_proj_a*", "enable": False},
    {"quantizer_name": "*linear_attn.in_proj_b*", "enable": False},
    {"quantizer_name": "*lm_head*", "enable": False},
    {"quantizer_name": "*mixer.conv1d*", "enable": False},
    {"quantizer_name": "*mlp.gate.*", "enable": False},
    {"quantizer_name": "*mlp.shared_expert_gate.*", "enable": False},
    {"quantizer_name": "*output_layer*", "enable": False},
    {"quantizer_name": "*proj_out.*", "enable": False},
    {"quantizer_name": "*router*", "enable": False},
    {"quantizer_name": "mtp.*", "enable": False},
    {"quantizer_name": "output.*", "enable": False},
    {"quantizer_name": "*embed_vision*", "enable": False},
    {"quantizer_name": "*vision_tower*", "enable": False},
    {"quantizer_name": "*visual*", "enable": False},
    {"quantizer_name": "*vision_model*", "enable": False},
    {"quantizer_name": "*multi_modal_projector*", "enable": False},
    {"quantizer_name": "*", "parent_class": "nn.BatchNorm1d", "enable": False},
    {"quantizer_name": "*", "parent_class": "nn.BatchNorm2d", "enable": False},
    {"quantizer_name": "*", "parent_class": "nn.BatchNorm3d", "enable": False},
    {"quantizer_name": "*", "parent_class": "nn.LeakyReLU", "enable": False},
    {"quantizer_name": "*", "parent_class": "nn.Embedding", "enable": False},
]


def _module_to_quantizer_pattern(pattern: str) -> str:
    """Module-name pattern -> quantizer-name pattern (``*.mlp.gate`` -> ``*.mlp.gate.*``)."""
    return pattern if pattern.endswith(".*") else pattern + ".*"


def recipe_excludes(patterns: Sequence[str], module: str) -> bool:
    """Whether ``quantization.exclude`` ``patterns`` keep the Linear ``module`` unquantized, matched as modelopt matches
    the entries ``to_modelopt_config`` writes for them (``<module>.weight_quantizer``): the one rule for the MTP's
    Linears too, which ``--mtp quantize`` quantizes itself (``mtp.quantize``)."""
    name = f"{module}.weight_quantizer"
    return any(fnmatch.fnmatchcase(name, _module_to_quantizer_pattern(p)) for p in patterns)


def quantizer_enabled(quantizer_name: str, quant_cfg: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a modelopt quant_cfg enables a quantizer (entries in order, the last match wins).

    Entries restricted to a ``parent_class`` are skipped: they address BatchNorm/Embedding/LeakyReLU
    modules, never the Linear weights this is used to plan.
    """
    enabled = False
    for entry in quant_cfg:
        if "parent_class" in entry:
            continue
        if not fnmatch.fnmatchcase(quantizer_name, str(entry.get("quantizer_name", ""))):
            continue
        if "enable" in entry:
            enabled = bool(entry["enable"])
        elif "cfg" in entry:
            cfg = entry["cfg"]
            enabled = bool(cfg.get("enable", True)) if isinstance(cfg, Mapping) else True
    return enabled


def _plain(obj: Any) -> Any:
    """A recipe (or a section, a value of one) as YAML's plain data: mappings, lists, scalars."""
    if isinstance(obj, ByteSize):
        return obj.text
    if dataclasses.is_dataclass(obj):
        fields = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, MtpSection) and not obj.precision:  # recorded by a search only: recipes stay as they were
            fields.pop("precision")
        if isinstance(obj, MtpSection) and not obj.healed:
            fields.pop("healed")
        return fields
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


# ---- parsing and validation --------------------------------------------------------------------
_SECTIONS: dict[str, type] = {
    "quantization": QuantizationSection,
    "calibration": CalibrationSection,
    "mtp": MtpSection,
    "output": OutputSection,
}


def _fields(recipe: Recipe) -> dict[str, Any]:
    """A recipe's keys and typed values (sections as mappings): what a recipe is validated from again, so a value
    already checked (a parsed size) is not parsed twice."""
    top = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe) if f.name != "source"}
    return top | {s: {f.name: getattr(top[s], f.name) for f in dataclasses.fields(top[s])} for s in _SECTIONS}


def with_values(recipe: Recipe, values: Mapping[tuple[str, str], Any], where: str) -> Recipe:
    """``recipe`` with typed leaves set (``(section, key) -> value``, e.g. the CLI's --calib-samples), each checked
    by the same rules as a recipe file; no round trip through YAML text."""
    if not values:
        return recipe
    data = _fields(recipe)
    for (section, key), value in values.items():
        data[section][key] = value
    return recipe_from_mapping(data, f"{recipe.source} + {where}")


def _refusal(exc: ValidationError, source: str) -> RecipeError:
    """pydantic's first finding as one line naming the file (``source``) and the key."""
    err = exc.errors(include_url=False)[0]
    path = [p for p in err["loc"] if isinstance(p, str)]
    key = ".".join(path) + "".join(f"[{p}]" for p in err["loc"] if isinstance(p, int))  # exclude[0]
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        section = _SECTIONS.get(path[0]) if len(path) > 1 else None
        allowed = [f"{path[0]}.{f.name}" for f in dataclasses.fields(section)] if section else _TOP_KEYS
        return RecipeError(f"{source}: unknown key {key!r} (allowed: {', '.join(allowed)})")
    if err["type"] in ("missing", "missing_argument"):
        return RecipeError(f"{source}: {key!r} is required")
    if err["type"] == "value_error":  # our own validators' messages name the value
        return RecipeError(f"{source}: {key}: {err['ctx']['error']}")
    if err["type"] == "dataclass_type":  # a section that is not a mapping
        return RecipeError(f"{source}: {key}: must be a mapping, got {err['input']!r}")
    return RecipeError(f"{source}: {key}: {err['msg'][0].lower()}{err['msg'][1:]}, got {err['input']!r}")


_TOP_KEYS = sorted({f.name for f in dataclasses.fields(Recipe)} - {"source"} | {"schema"})


def recipe_from_mapping(raw: Any, source: str) -> Recipe:
    """Validate a parsed YAML mapping into a Recipe; unknown keys are one-line errors naming the key."""
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{source}: a recipe must be a YAML mapping")
    unknown = next((k for k in raw if k not in _TOP_KEYS), None)
    if unknown is not None:  # "source" too: where a recipe came from is not the file's to say
        raise RecipeError(f"{source}: unknown key {unknown!r} (allowed: {', '.join(_TOP_KEYS)})")
    schema = raw.get("schema", SCHEMA_VERSION)
    if schema != SCHEMA_VERSION:
        raise RecipeError(f"{source}: schema {schema!r} is not supported (this mtpquant reads schema {SCHEMA_VERSION})")
    data = {k: v for k, v in raw.items() if k != "schema" and not (k in _SECTIONS and v is None)}  # empty: defaults
    try:
        return Recipe(source=source, **data)
    except ValidationError as exc:
        raise _refusal(exc, source) from None


def _parse_yaml(text: str, source: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise RecipeError(f"{source}: not valid YAML{where}") from None


def _header_and_recipe(text: str, source: str) -> tuple[list[str], Recipe]:
    """A resolved recipe file's comment header (its lines) and the recipe."""
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line[2:] if line.startswith("# ") else line[1:])
    return header, recipe_from_mapping(_parse_yaml(text, source), source)


def tuned_recipe(text: str, source: str, precision: Mapping[str, str], what: str, *, healed: bool = False) -> str:
    """A resolved recipe file's text once ``tune-mtp`` has re-quantized its checkpoint's MTP: ``mtp.mode`` is
    ``search`` with the ``precision`` it chose per group (``healed``: and healed, ``--heal``), and the comment header
    adds ``what`` was done and the mode before it. ``RecipeError`` when ``text`` is not a recipe."""
    header, recipe = _header_and_recipe(text, source)
    header.append(f"{what}: mtp.mode was {recipe.mtp.mode}, now search.")
    chosen: Any = dict(precision)  # checked against the section's choices when the recipe is made
    tuned = dataclasses.replace(recipe, mtp=dataclasses.replace(recipe.mtp, mode="search", precision=chosen,
                                                                 healed=healed))
    return tuned.to_yaml("\n".join(header))


def grafted_recipe(text: str, source: str, mtp_from: str) -> str:
    """A resolved recipe file's text (``RECIPE_FILE``, as ``source`` names it) once graft has put ``mtp_from``'s MTP
    into its checkpoint: ``mtp.mode`` is ``keep`` (the MTP as SRC has it, which convert's keep mode writes), and
    the comment header keeps what it said and adds what graft did and the mode before it. The body is written as
    convert writes it. ``RecipeError`` when ``text`` is not a recipe."""
    from mtpquant import __version__

    header, recipe = _header_and_recipe(text, source)
    header.append(
        f"MTP grafted from {mtp_from} by mtpquant {__version__} graft: mtp.mode was {recipe.mtp.mode}, now keep."
    )
    grafted = dataclasses.replace(recipe, mtp=dataclasses.replace(recipe.mtp, mode="keep"))
    return grafted.to_yaml("\n".join(header))


def _builtin_dir() -> Any:
    return importlib.resources.files("mtpquant") / "recipes"


def builtin_recipe_names() -> list[str]:
    """Names of the recipes shipped with the package."""
    return sorted(p.name[: -len(".yaml")] for p in _builtin_dir().iterdir() if p.name.endswith(".yaml"))


def load_recipe(ref: str | Path) -> Recipe:
    """A recipe by built-in name or by path to a YAML file."""
    text: str
    ref_s = str(ref)
    path = Path(ref_s).expanduser()
    if path.is_file():
        source = str(path)
        text = path.read_text(encoding="utf-8")
    elif ref_s.endswith((".yaml", ".yml")) or "/" in ref_s:
        raise RecipeError(f"{ref_s}: recipe file does not exist")
    else:
        resource = _builtin_dir() / f"{ref_s}.yaml"
        if not resource.is_file():
            raise RecipeError(f"unknown recipe {ref_s!r}; built-in recipes: {', '.join(builtin_recipe_names())}")
        source = f"mtpquant/recipes/{ref_s}.yaml"
        text = resource.read_text(encoding="utf-8")
    return recipe_from_mapping(_parse_yaml(text, source), source)


def apply_overrides(recipe: Recipe, overrides: Iterable[str], where: str = "--set") -> Recipe:
    """Apply ``section.key=value`` overrides (values parsed as YAML scalars/lists)."""
    import yaml

    data = _fields(recipe)
    applied = False
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(f"{where} {item!r}: expected key=value (for example calibration.samples=64)")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = value
        parts = key.split(".")
        label = f"{where} {key}" if where == "--set" else where
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node, dict) or part not in node or not isinstance(node[part], dict):
                raise RecipeError(f"{label}: unknown key {'.'.join(parts[: i + 1])!r}")
            node = node[part]
        leaf = parts[-1]
        if not isinstance(node, dict) or leaf not in node:
            raise RecipeError(f"{label}: unknown key {key!r}")
        node[leaf] = parsed
        applied = True
    if not applied:
        return recipe
    return recipe_from_mapping(data, f"{recipe.source} + {where}")


def default_recipe_name(family: Family) -> str:
    """The recipe a family converts with when none is named."""
    return DEFAULT_RECIPES.get(family.key, "nvfp4-w4a16")
