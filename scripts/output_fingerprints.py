"""sha256 of every file convert and graft write for the tiny models: proof that a refactor changed no byte.

Runs, for the tiny Qwen3.5 dense, Qwen3.5-MoE and Qwen3-Next checkpoints, ``convert`` in each MTP mode
(keep, quantize, extract, drop), ``graft`` of the extract output with its extracted MTP, and
``graft --fix-metadata`` of a keep output whose exclusions were removed, all through the CLI, into
ROOT (fixed paths, so the recorded command lines are the same from run to run). Writes one JSON object
``{"<run>/<file>": sha256}`` to JSON; the provenance file (``PROVENANCE_NAME``) is left out.

    python scripts/output_fingerprints.py ROOT before.json   # on the old tree
    python scripts/output_fingerprints.py ROOT after.json    # on the new tree; then diff the two

``--extra`` fingerprints, instead, the converts the default set leaves out (``EXTRA``: every Qwen4-Exp mode and its
FP8 MTP, the experts-only and weight-only recipes, FP8 MTPs, the compressed-tensors format).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

PROVENANCE_NAME = "mtpquant_provenance.json"
VARIANTS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
CALIB = ["--calib-samples", "4", "--calib-seq-len", "32", "--device", "cpu"]
EXTRA = (  # run name, tiny variant, convert flags
    *((f"qwen4_exp-{m}", "qwen4_exp", ["--mtp", m]) for m in ("keep", "quantize", "extract", "drop")),
    ("qwen4_exp-quantize-fp8", "qwen4_exp", ["--mtp", "quantize", "--mtp-format", "fp8"]),
    ("qwen3_5_moe-experts-keep", "qwen3_5_moe", ["--recipe", "qwen3_5_moe-experts-nvfp4", "--mtp", "keep"]),
    ("qwen3_5_moe-experts-quantize", "qwen3_5_moe", ["--recipe", "qwen3_5_moe-experts-nvfp4", "--mtp", "quantize"]),
    ("qwen3_5-quantize-fp8", "qwen3_5", ["--mtp", "quantize", "--mtp-format", "fp8"]),
    ("qwen3_next-quantize-fp8", "qwen3_next", ["--mtp", "quantize", "--mtp-format", "fp8"]),
    ("qwen3_5-ct-keep", "qwen3_5", ["--mtp", "keep", "--format", "compressed-tensors"]),
    ("qwen3_5-ct-quantize", "qwen3_5", ["--mtp", "quantize", "--format", "compressed-tensors"]),
    ("qwen3_5_moe-ct-quantize", "qwen3_5_moe", ["--mtp", "quantize", "--format", "compressed-tensors"]),
    ("qwen3_5-w4a16-quantize", "qwen3_5", ["--recipe", "nvfp4-w4a16", "--mtp", "quantize"]),
)


def _digests(root: Path, run: str, out: dict[str, str]) -> None:
    for p in sorted((root / run).rglob("*")):
        if p.is_file() and p.name != PROVENANCE_NAME:
            out[f"{run}/{p.relative_to(root / run).as_posix()}"] = hashlib.sha256(p.read_bytes()).hexdigest()


def _extra(root: Path, cli: Callable[[list[str]], int], make: Callable[[Path, str], Path]) -> list[str]:
    sources: dict[str, Path] = {}
    for run, variant, flags in EXTRA:
        if variant not in sources:
            sources[variant] = make(root / "src" / variant, variant)
        if cli(["-q", "convert", str(sources[variant]), str(root / run), *flags, *CALIB]) != 0:
            raise SystemExit(f"convert {run} failed")
    return [run for run, _, _ in EXTRA]


def _default(root: Path, cli: Callable[[list[str]], int], make: Callable[[Path, str], Path]) -> list[str]:
    runs = []
    for variant in VARIANTS:
        src = make(root / "src" / variant, variant)
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
    return runs


def main() -> int:
    from mtpquant.cli import main as cli
    from mtpquant.synth.tiny import make_tiny_checkpoint

    root = Path(sys.argv[1]).absolute()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    digests: dict[str, str] = {}
    extra = sys.argv[3:] == ["--extra"]
    runs = (_extra if extra else _default)(root, cli, make_tiny_checkpoint)
    for run in runs:
        _digests(root, run, digests)
    Path(sys.argv[2]).write_text(json.dumps(dict(sorted(digests.items())), indent=1) + "\n")
    print(f"{len(digests)} files fingerprinted into {sys.argv[2]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
