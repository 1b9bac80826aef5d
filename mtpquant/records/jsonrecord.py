"""The JSON reading every validation-report record shares: ``JsonRecord`` (a flat record pydantic reads and writes)
and the field readers a hand-written ``from_json`` uses, each a ``ValueError`` naming the place
(``report.reference.acceptance.by_k[0].k: expected int, got str``). Imports nothing heavy (no torch, pydantic on
first use).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

if TYPE_CHECKING:
    from pydantic import TypeAdapter

__all__ = ["JsonRecord", "as_floats", "as_ints", "as_object", "require"]


_R = TypeVar("_R", bound="JsonRecord")


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def _adapter(cls: type) -> TypeAdapter[Any]:
    if cls not in _ADAPTERS:
        from pydantic import TypeAdapter  # on first use: commands that write no report do not import it

        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


class JsonRecord:
    """A record whose JSON object is its fields in order, (de)serialised by pydantic: read strictly as JSON (no
    ``"3"`` for 3, no ``true`` for 1), unknown keys ignored (a report a newer mtpquant wrote still reads), missing
    keys the field's default; the first problem is a ``ValueError`` naming its place (``report.settings.k: ...``)."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {"strict": True, "extra": "ignore"}  # a pydantic.ConfigDict

    def to_json(self) -> dict[str, Any]:
        """The JSON object."""
        return dict(_adapter(type(self)).dump_python(self, mode="json"))

    @classmethod
    def from_json(cls: type[_R], d: Any, where: str) -> _R:
        """Read the JSON object at ``where``."""
        from pydantic import ValidationError

        try:
            return cast(_R, _adapter(cls).validate_json(json.dumps(d)))
        except ValidationError as exc:
            error = exc.errors()[0]
            at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
            raise ValueError(f"{where}{at}: {error['msg'].lower()}") from None
        except (TypeError, ValueError) as exc:  # not JSON at all (a value json cannot write)
            raise ValueError(f"{where}: not a JSON value ({exc})") from None


def require(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = d.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(
            f"{where}.{key}: expected {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}"
        )
    return value


def as_object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected an object")
    return value


def as_floats(value: Any, where: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{where}: expected a list of numbers")
    return tuple(float(v) for v in value)


def as_ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{where}: expected a list of integers")
    return tuple(value)
