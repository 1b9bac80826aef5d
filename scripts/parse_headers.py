#!/usr/bin/env python3
"""The raw header parse of a checkpoint, as a process: read every shard's safetensors header and ``json.loads`` it.

    python scripts/parse_headers.py CHECKPOINT_DIR

The limit ``inspect`` is measured against (docs/BENCHMARKS.md, "#45: inspect vs the raw header parse"): the same
headers inspect reads, parsed and nothing else (no index, no checks, no classification). Prints the tensor count.
Standard library only, so it times the interpreter's start-up and the parse alone.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path


def parse(root: Path) -> int:
    tensors = 0
    for shard in sorted(root.glob("*.safetensors")):
        with shard.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        tensors += len(header) - ("__metadata__" in header)
    return tensors


if __name__ == "__main__":
    sys.stdout.write(f"{parse(Path(sys.argv[1]))} tensors\n")
