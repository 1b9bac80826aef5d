"""One way to read, write and check a record: ``Record``, a frozen dataclass whose fields pydantic reads, writes and
checks, by their declared types (strict: no ``"3"`` for 3, no ``true`` for 1) and constraints (``annotated_types``:
``Ge(1)``, ``Gt(0)``, ``Literal`` choices). Every record mtpquant writes into a checkpoint or reads back (the
validation report, the speculation profile, the provenance) and every command's options are one.

A record's JSON form is its fields in order, unless the record says otherwise with pydantic's own serializer and
validator hooks (a key left out when empty, a nested object); reading one refuses the first problem as a
``ValueError`` naming its place (``report.reference.acceptance.by_k[0].k: input should be a valid integer``). An
options record's ``check_fields`` refuses the first field its type refuses, in the words of the flag that sets it
(``--steps must be >= 1, got 0``). Imports nothing heavy: pydantic on first use.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

if TYPE_CHECKING:
    from pydantic import TypeAdapter

__all__ = ["FLAG", "Options", "Record", "field_choices", "field_default", "finite_or_none"]

_R = TypeVar("_R", bound="Record")

# ``dataclasses.field(metadata={FLAG: "--max-shard-size"})``: the flag that sets an options field, where it is not the
# field's name spelled as a flag (``max_shard_bytes``); ``None``: no flag sets it (an API-only field).
FLAG = "flag"

_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def _adapter(cls: type) -> TypeAdapter[Any]:
    if cls not in _ADAPTERS:
        from pydantic import TypeAdapter  # on first use: commands that write no record do not import it

        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


# pydantic's names of the members of a union (``int | float``), which it puts in an error's place
_UNION_MEMBER = re.compile(r"^(int|float|str|bool|none|[a-z-]+\[.*\])$")


def _place(loc: tuple[str | int, ...]) -> str:
    kept = (p for p in loc if isinstance(p, int) or not _UNION_MEMBER.match(p))
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in kept)


class Record:
    """A frozen dataclass read, written and checked by pydantic: strict, unknown keys ignored (a report a newer
    mtpquant wrote still reads), missing keys the field's default.

    A record whose JSON form is not its fields in order says so with two hooks, plain Python: ``json_out`` (the
    object pydantic wrote -> the object written: keys left out, reordered, a nested object) and ``json_in`` (the
    object read -> the object pydantic reads); both apply wherever the record stands in another one."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {"strict": True, "extra": "ignore"}  # a pydantic.ConfigDict

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The JSON object written, from the one pydantic made of the fields (by default: that one)."""
        return data

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The object pydantic reads the fields from, given the JSON object read (by default: that one)."""
        return data

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """pydantic's schema of the dataclass, written through ``json_out`` where the record has one."""
        schema = handler(source)
        if cls.json_out is Record.json_out:
            return schema
        from pydantic_core import core_schema

        def write(value: Record, fields: Any) -> Any:
            return value.json_out(fields(value))

        return {
            **schema,
            "serialization": core_schema.wrap_serializer_function_ser_schema(write, schema=schema, when_used="json"),
        }

    def to_json(self) -> dict[str, Any]:
        """The JSON object."""
        return dict(_adapter(type(self)).dump_python(self, mode="json"))

    @classmethod
    def from_json(cls: type[_R], d: Any, where: str) -> _R:
        """Read the JSON object at ``where``; ``ValueError`` naming the first problem's place."""
        from pydantic import ValidationError

        try:
            text = json.dumps(_prepare(cls, d))
        except (TypeError, ValueError) as exc:  # not JSON at all (a value json cannot write)
            raise ValueError(f"{where}: not a JSON value ({exc})") from None
        try:
            return cast(_R, _adapter(cls).validate_json(text))
        except ValidationError as exc:
            error = exc.errors()[0]
            raise ValueError(f"{where}{_place(error['loc'])}: {error['msg'].lower()}") from None


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _prepare(tp: Any, value: Any) -> Any:
    """``value`` (JSON) with every record's ``json_in`` applied where the type ``tp`` holds the record."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if isinstance(value, dict) and isinstance(arg, type) and issubclass(arg, Record):
                return _prepare(arg, value)
            if isinstance(value, list) and typing.get_origin(arg) in (tuple, list):
                return _prepare(arg, value)
        return value
    if origin in (tuple, list) and isinstance(value, list):
        item = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        return [_prepare(item, v) for v in value]
    if isinstance(tp, type) and issubclass(tp, Record) and isinstance(value, dict):
        value = tp.json_in(value)
        hints = _hints(tp)
        return {k: _prepare(hints[k], v) if k in hints else v for k, v in value.items()}
    return value


class Options(Record):
    """A command's options: a ``Record`` whose ``check_fields`` checks the values it was made with."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {
        "strict": True,
        "revalidate_instances": "always",  # check_fields checks the instance itself
        "arbitrary_types_allowed": True,
    }

    def check_fields(self, error: type[Exception]) -> None:
        """Refuse (``error``, one line) the first field whose value its declared type or constraint refuses, named
        by the flag that sets it (``--steps must be >= 1, got 0``), or else by its place (``sizes.prompt_len``)."""
        from pydantic import ValidationError

        try:
            _adapter(type(self)).validate_python(self)
        except ValidationError as exc:
            e = exc.errors()[0]
            name = _name(type(self), e["loc"])
            raise error(_refusal(name, e["type"], e["msg"], e.get("ctx") or {}, e["input"])) from None


def _name(cls: type, loc: tuple[str | int, ...]) -> str:
    """How a refusal names the field at ``loc``: its flag (a top-level field), else its place."""
    if len(loc) == 1 and isinstance(loc[0], str):
        f = next((f for f in dataclasses.fields(cls) if f.name == loc[0]), None)
        if f is not None and f.metadata.get(FLAG, "") is not None:
            return str(f.metadata.get(FLAG) or "--" + f.name.replace("_", "-"))
    return _place(loc).lstrip(".")


def _refusal(name: str, kind: str, msg: str, ctx: dict[str, Any], value: Any) -> str:
    if kind == "greater_than_equal":
        return f"{name} must be >= {ctx['ge']}, got {value}"
    if kind == "greater_than":
        bound = "positive" if ctx["gt"] == 0 else f"> {ctx['gt']}"
        return f"{name} must be {bound}, got {value}"
    if kind == "less_than_equal":
        return f"{name} must be <= {ctx['le']}, got {value}"
    if kind == "less_than":
        return f"{name} must be < {ctx['lt']}, got {value}"
    if kind == "literal_error":
        return f"{name} must be {str(ctx['expected']).replace(chr(39), '')}, got {value!r}"
    return f"{name}: {msg[0].lower()}{msg[1:]}, got {value!r}"


def field_default(cls: type, name: str) -> Any:
    """The default of ``cls``'s field ``name`` (what a flag that is not given leaves): the one place a default is
    written, which the CLI's help quotes."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


def field_choices(cls: type, name: str) -> tuple[str, ...]:
    """The values ``cls``'s field ``name`` may take (its ``Literal`` types', in order, ``None`` aside): the one place
    the choices are written, which the CLI's ``choices`` take."""
    tp = _hints(cls)[name]
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return tuple(v for m in members if typing.get_origin(m) is typing.Literal for v in typing.get_args(m))


def finite_or_none(v: float) -> float | None:
    """``v``, or None when it is not finite (strict JSON has no NaN)."""
    return v if math.isfinite(v) else None
