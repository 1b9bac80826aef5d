"""Read the real-layout weight tables (shared/fixtures/real-layouts/*_weights_table.md).

Rows are compressed (``layers.0-30`` x24, ``layers.3,7,...,43,47``, ``experts.0-255``); expansion
uses the row's own count and, where a range covers more layers than the count, the config's
layer types (linear-attention rows are the linear layers, self-attention rows the full ones).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LayoutRow", "expand_layout", "parse_table"]

_ROW = re.compile(
    r"^\| `(?P<name>[^`]+)`(?P<counts>[^|]*)\| `\[(?P<shape>[^\]]*)\]` "
    r"\| `torch\.(?P<dtype>\w+)` \|[^|]*\| (?P<file>[^|]+) \|"
)
_COUNT = re.compile(r"×(\d+) (layers|experts|blocks)")
_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16", "uint8": "U8", "float8_e4m3fn": "F8_E4M3"}


@dataclass(frozen=True)
class LayoutRow:
    """One expanded tensor of a real checkpoint."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    shard: str | None  # None where the table says "Multi Files"


def _expand_spec(spec: str) -> list[int]:
    parts = spec.split(",")
    out: list[int] = []
    for i, part in enumerate(parts):
        if part == "...":
            a, b = out[-1], out[-2]
            step = a - b
            stop = int(parts[i + 1].split("-")[0])
            out.extend(range(a + step, stop, step))
        elif "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def parse_table(path: Path) -> list[tuple[str, tuple[int, ...], str, str | None, dict[str, int]]]:
    """Raw rows: (compressed name, shape, dtype, shard or None, {"layers": n, "experts": m})."""
    rows = []
    for line in path.read_text().splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        shape = tuple(int(x) for x in m["shape"].split(",") if x.strip())
        counts = {kind: int(n) for n, kind in _COUNT.findall(m["counts"])}
        file = m["file"].strip()
        rows.append((m["name"], shape, _DTYPES[m["dtype"]], None if file == "Multi Files" else file, counts))
    return rows


def expand_layout(path: Path, config: Mapping[str, Any]) -> list[LayoutRow]:
    """Every tensor of a layout table, with compressed ranges expanded."""
    text = config.get("text_config", config)
    n_layers = int(text["num_hidden_layers"])
    interval = int(text.get("full_attention_interval", 4))
    kinds = text.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    ]
    out: list[LayoutRow] = []
    for name, shape, dtype, shard, counts in parse_table(path):
        names = [name]
        for kind, key in (("layers", "layers."), ("experts", "experts."), ("blocks", "blocks.")):
            expanded: list[str] = []
            for n in names:
                m = re.search(re.escape(key) + r"([0-9][0-9,\-.]*[0-9])(?=\.)", n)
                if not m:
                    expanded.append(n)
                    continue
                idx = _expand_spec(m.group(1))
                want = counts.get(kind)
                if kind == "layers" and want is not None and len(idx) != want:
                    typ = "linear_attention" if ".linear_attn." in n else "full_attention"
                    idx = [i for i in idx if kinds[i] == typ]
                expanded += [n[: m.start(1)] + str(i) + n[m.end(1) :] for i in idx]
            names = expanded
        out += [LayoutRow(n, shape, dtype, shard) for n in names]
    return out
