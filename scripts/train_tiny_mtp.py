#!/usr/bin/env python
"""Train an embedded tiny model with its MTP layer (CPU, seeded) and measure its acceptance.

Usage (the assets in the repository were made with these commands)::

    .venv/bin/python scripts/train_tiny_mtp.py --out mtpquant/assets/tiny-qwen3_5-mtp --overwrite
    .venv/bin/python scripts/train_tiny_mtp.py --family qwen4_exp --seq-len 64 --batch-size 8 --steps 1500 \
        --eval-every 500 --overwrite                 # -> mtpquant/assets/tiny-qwen4_exp-mtp
    .venv/bin/python scripts/train_tiny_mtp.py --family glm4_moe --seq-len 64 --batch-size 8 --steps 1500 \
        --eval-every 500 --overwrite                 # -> mtpquant/assets/tiny-glm4_moe-mtp
    .venv/bin/python scripts/train_tiny_mtp.py --family qwen3_5_moe --seq-len 64 --batch-size 8 --steps 1500 \
        --eval-every 500 --overwrite                 # -> mtpquant/assets/tiny-qwen3_5_moe-mtp
    .venv/bin/python scripts/train_tiny_mtp.py --family deepseek_v3 --seq-len 64 --batch-size 8 --steps 1500 \
        --eval-every 500 --overwrite                 # -> mtpquant/assets/tiny-deepseek_v3-mtp

Trains on the offline corpus minus the held-out documents (``mtpquant.text.prompts``), writes
BF16 safetensors (2 shards, MTP on both), configs, tokenizer and ``training.json``, then runs
``mtpquant validate`` on the result with the default held-out prompts and records the acceptance
in ``training.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from mtpquant.runtime.machine import tune_cpu_runtime

tune_cpu_runtime()  # the CLI's OpenMP settings (a user's own kept), before torch is imported

from mtpquant.synth.train import TrainSpec, train_tiny_mtp  # noqa: E402
from mtpquant.text.prompts import held_out_documents, training_documents  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "mtpquant" / "assets"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: mtpquant/assets/tiny-FAMILY-mtp")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--no-validate", action="store_true", help="skip the acceptance measurement")
    parser.add_argument("--validate-only", action="store_true", help="only measure (and record) an existing --out")
    for field in dataclasses.fields(TrainSpec):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args = parser.parse_args(argv)
    args.out = args.out or ASSETS / f"tiny-{args.family}-mtp"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = args.out
    if not args.validate_only:
        spec = TrainSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSpec)})
        result = train_tiny_mtp(args.out, training_documents(), held_out_documents(), spec, overwrite=args.overwrite)
        print(f"trained in {result.seconds:.0f} s wall, {result.cpu_seconds:.0f} s CPU -> {result.path}")
        print(json.dumps(result.history[-1], indent=2))
        path = result.path
    if args.no_validate:
        return 0
    from mtpquant.checkpoint.filesystem import atomic_write_json
    from mtpquant.validate.run import ValidateOptions, validate

    # The validate defaults: 32 held-out prompts, sequences of 128 tokens, k = 1..3, CPU float32.
    report = validate(ValidateOptions(reference=path, k=3, device="cpu"))
    acc = report.to_json()["reference"]["acceptance"]
    training = json.loads((path / "training.json").read_text())
    training["acceptance"] = acc
    training["acceptance_settings"] = report.to_json()["settings"]
    atomic_write_json(path / "training.json", training)
    for row in acc["by_k"]:
        print(
            f"k={row['k']}: acceptance {100 * row['acceptance_rate']:.1f} %, AL {row['mean_acceptance_length']:.3f}, "
            f"per position {[round(a, 3) for a in row['acceptance_per_position']]}"
        )
    print(f"teacher-forced MTP agreement with the target: {100 * acc['teacher_forced_agreement']:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
