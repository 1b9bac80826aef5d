#!/usr/bin/env python3
"""Write a full-size skeleton checkpoint (real names, shapes, dtypes, shards; sparse data) from a layout table.

    python scripts/make_skeleton_checkpoint.py --layout Qwen3-Next-80B-A3B-Instruct --out /tmp/next
    python scripts/make_skeleton_checkpoint.py --layout Qwen3.5-35B-A3B --out /tmp/35b-quant --quant
    python scripts/make_skeleton_checkpoint.py --list

Layouts are the ``NAME_weights_table.md`` + ``NAME_config*.json`` pairs in ``--layouts``
(default: tests/fixtures/real-layouts, a copy of shared/fixtures/real-layouts); a unique prefix of
NAME is enough. Tensor data are holes (reads return zeros) and cost no disk. ``--quant`` writes the
naive modelopt NVFP4 export of the same model instead (no MTP while config.json declares it).
``--mtp-data random`` gives the MTP tensors real bytes (they then occupy disk: 0.24 GB for
Qwen3.5-4B, 1.7 GB for Qwen3.5-35B-A3B, 3.3 GB for Qwen3-Next-80B-A3B). ``--mtp-data normal`` gives every
tensor random-normal weights and adds a tokenizer: a full-size model that converts (9.3 GB for Qwen3.5-4B).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: tests.support
from tests.support.skeleton import find_layout, list_layouts, make_skeleton

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LAYOUTS = REPO / "tests" / "fixtures" / "real-layouts"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", help="layout name, e.g. Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B-Instruct, Qwen3.5-4B")
    parser.add_argument("--out", type=Path, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--quant", action="store_true", help="write the naive modelopt NVFP4 quant (MTP absent)")
    parser.add_argument(
        "--mtp-data",
        choices=("sparse", "random", "normal"),
        default="sparse",
        help="sparse: holes; random: real bytes in the MTP; normal: every tensor random-normal, plus a tokenizer",
    )
    parser.add_argument("--layouts", type=Path, default=DEFAULT_LAYOUTS, help="directory of layout tables")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--list", action="store_true", help="list the available layouts and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name in list_layouts(args.layouts):
            print(name)
        return 0
    if not args.layout or not args.out:
        parser.error("--layout and --out are required")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        layout = find_layout(args.layout, args.layouts)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = make_skeleton(layout, args.out, quant=args.quant, mtp_data=args.mtp_data, overwrite=args.overwrite)
    if args.json:
        data = asdict(result)
        data["path"] = str(result.path)
        data.pop("exclusions")
        print(json.dumps(data, indent=2))
    else:
        print(
            f"{result.path}: {result.kind} skeleton of {result.layout}: {result.tensors} tensors in "
            f"{len(result.shards)} shards, {result.total_bytes / 1e9:.2f} GB of tensor data, "
            f"{result.disk_bytes / 1e6:.1f} MB on disk, MTP {result.mtp_tensors} tensors "
            f"({result.mtp_bytes / 1e9:.3f} GB), {result.seconds:.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
