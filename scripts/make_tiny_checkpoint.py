#!/usr/bin/env python3
"""Write tiny random-weight checkpoints in the exact real layouts (all variants by default).

python scripts/make_tiny_checkpoint.py OUT_DIR [--variant qwen3_5_moe ...]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mtpquant.synth.tiny import TINY_VARIANTS, make_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--variant", action="append", choices=sorted(TINY_VARIANTS))
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for variant in args.variant or sorted(TINY_VARIANTS):
        print(make_tiny_checkpoint(args.out_dir / variant, variant, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
