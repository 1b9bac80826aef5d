#!/usr/bin/env python3
"""Write the corpus of hostile checkpoints (tests/fixtures/bad by default) with expected.json.

python scripts/make_bad_checkpoints.py [OUT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: tests.support
from tests.support.bad import make_bad_corpus

if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "bad"
    for name, message in make_bad_corpus(out).items():
        print(f"{name}: {message}")
