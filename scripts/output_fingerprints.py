"""sha256 of every file convert and graft write for the tiny models: proof that a refactor changed no byte.

Runs, for the tiny Qwen3.5 dense, Qwen3.5-MoE and Qwen3-Next checkpoints, ``convert`` in each MTP mode
(keep, quantize, extract, drop), ``graft`` of the extract output with its extracted MTP, and
``graft --fix-metadata`` of a keep output whose exclusions were removed, all through the CLI, into
ROOT (fixed paths, so the recorded command lines are the same from run to run). Writes one JSON object
``{"<run>/<file>": sha256}`` to JSON; the provenance file (``PROVENANCE_NAME``) is left out.

    python scripts/output_fingerprints.py ROOT before.json   # on the old tree
    python scripts/output_fingerprints.py ROOT after.json    # on the new tree; then diff the two
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

PROVENANCE_NAME = "mtpquant_provenance.json"
VARIANTS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
CALIB = ["--calib-samples", "4", "--calib-seq-len", "32", "--device", "cpu"]


def _digests(root: Path, run: str, out: dict[str, str]) -> None:
    for p in sorted((root / run).rglob("*")):
        if p.is_file() and p.name != PROVENANCE_NAME:
            out[f"{run}/{p.relative_to(root / run).as_posix()}"] = hashlib.sha256(p.read_bytes()).hexdigest()


def main() -> int:
    from mtpquant.cli import main as cli
    from mtpquant.synth.tiny import make_tiny_checkpoint

    root = Path(sys.argv[1]).absolute()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    digests: dict[str, str] = {}
    for variant in VARIANTS:
        src = make_tiny_checkpoint(root / "src" / variant, variant)
        runs = []
        for mode in ("keep", "quantize", "extract", "drop"):
            out = f"{variant}-{mode}"
            argv = ["-q", "convert", str(src), str(root / out), "--mtp", mode]
            if mode == "extract":  # right after --mtp: the recipe's header records the command line in this order
                argv += ["--mtp-out", str(root / f"{out}-mtp")]
                runs.append(f"{out}-mtp")
            argv += CALIB
            if cli(argv) != 0:
                raise SystemExit(f"convert {variant} --mtp {mode} failed")
            runs.append(out)
        grafted = f"{variant}-extract-grafted"
        argv = ["-q", "graft", str(root / f"{variant}-extract"), "--from", str(root / f"{variant}-extract-mtp")]
        if cli([*argv, "--out", str(root / grafted)]) != 0:
            raise SystemExit(f"graft {variant} failed")
        runs.append(grafted)
        broken = root / f"{variant}-keep-unexcluded"
        shutil.copytree(root / f"{variant}-keep", broken)
        for name in ("config.json", "hf_quant_config.json"):
            text = (broken / name).read_text().replace('"mtp*"', '"lm_head"')
            (broken / name).write_text(text)
        fixed = f"{variant}-fixed"
        if cli(["-q", "graft", str(broken), "--fix-metadata", "--out", str(root / fixed)]) != 0:
            raise SystemExit(f"graft --fix-metadata {variant} failed")
        runs.append(fixed)
        for run in runs:
            _digests(root, run, digests)
    Path(sys.argv[2]).write_text(json.dumps(dict(sorted(digests.items())), indent=1) + "\n")
    print(f"{len(digests)} files fingerprinted into {sys.argv[2]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
