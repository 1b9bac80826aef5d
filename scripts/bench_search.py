#!/usr/bin/env python3
"""The MTP precision search (#38): (a) its cost on the trained tiny models, as a multiple of one validate; (b) the
bytes each configuration would save on full-size MTPs, from headers.

    python scripts/bench_search.py --work /tmp/bench-search --write            # both
    python scripts/bench_search.py --work /tmp/bench-search --skip-tiny        # (b) only (seconds)

(a) runs the ``mtpquant`` command as users run it, each step in a fresh process (the calling shell's OpenMP settings
removed: the CLI chooses its own), on the trained tiny Qwen3.5, Qwen3.5-MoE and Qwen3.8-Flash-Next (16 x 128 calibration
tokens): ``convert --keep-mtp``, ``convert --mtp auto`` (the default search: budget 0.05 AL, 64 held-out prompts, k =
1..3, greedy, vLLM), ``tune-mtp`` of the keep convert, and one ``validate SRC KEEP`` with the search's measurement
settings (64 prompts, max_len 128, k = 3, activations emulated). The search's cost is the wall time ``--mtp auto`` adds
to the keep convert, and tune-mtp's whole wall time, each divided by the validate's.

(b) builds the sparse full-size skeletons of the BF16 sources (``tests/support/skeleton.py``: Qwen3-Next-80B-A3B and
Qwen3.5-35B-A3B from their real layout tables; ``tests/support/qwen4_exp_skeleton.py``: Qwen3.8-Flash-Next) and reads
their MTP from the headers; Qwen3.5-397B-A17B has no layout table here, so its MTP is the one its config implies
(the Qwen3.5-35B-A3B config with the 397B's published dimensions: hidden 4096, 32 query / 2 KV heads of 256, 512
experts of intermediate 1024, a shared expert of 1024), the same shapes ``inspect`` expects of its checkpoint. For each:
the BF16 MTP's bytes, every group's bytes per precision, and every configuration vLLM loads (and those every engine
loads) with its bytes and what it saves.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _benchlib import LAYOUTS, command_line, machine, machine_line, run_python, today, write_section  # noqa: E402

from mtpquant.units import format_bytes  # noqa: E402

os.environ.setdefault("TQDM_DISABLE", "1")
for _name in [k for k in os.environ if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))]:
    del os.environ[_name]

TINY_HEADING = "## MTP precision search: cost on the trained tiny models"
FULL_HEADING = "## MTP precision search: bytes per configuration on full-size MTPs"
CALIB = ["--calib-samples", "16", "--calib-seq-len", "128"]
# Qwen3.5-397B-A17B's published dimensions (its model card), over the Qwen3.5-35B-A3B config
QWEN35_397B = {"hidden_size": 4096, "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 2,
               "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 1024,
               "shared_expert_intermediate_size": 1024}  # fmt: skip


def _cli(*args: str, ok: tuple[int, ...] = (0,)) -> tuple[float, dict[str, Any]]:
    run = run_python(["-m", "mtpquant", "-q", *args])
    if run.returncode not in ok:
        raise SystemExit(f"mtpquant {' '.join(args)} failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return run.wall, run.output


def tiny(work: Path, only: list[str] | None = None) -> str:
    """(a): the search's cost on each trained tiny model (``only``: those), through the CLI."""
    from mtpquant.synth.train import TINY_MTP_ASSETS

    names = {"qwen3_5": "Qwen3.5 (dense MTP)", "qwen3_5_moe": "Qwen3.5-MoE (MoE MTP)",
             "qwen4_exp": "Qwen3.8-Flash-Next (MoE MTP)"}  # fmt: skip
    rows = []
    for key in only or names:
        src = TINY_MTP_ASSETS[key]
        d = work / key
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        keep, _ = _cli("convert", str(src), str(d / "keep"), "--keep-mtp", "--device", "cpu", *CALIB)
        auto, _ = _cli("convert", str(src), str(d / "auto"), "--mtp", "auto", "--device", "cpu", *CALIB)
        tune, _ = _cli("tune-mtp", str(d / "keep"), "--from", str(src), "--out", str(d / "tuned"), "--device", "cpu")
        val, _ = _cli("validate", str(src), str(d / "keep"), "--num-prompts", "64", "--max-len", "128", "--k", "3",
                      "--activations", "emulate", "--device", "cpu", "--json", ok=(0, 17, 23))  # fmt: skip
        report = json.loads((d / "auto" / "mtp_search" / "report.json").read_text())
        tuned = json.loads((d / "tuned" / "mtp_search" / "report.json").read_text())
        chosen = report["evaluated"][report["chosen"]]
        same = tuned["evaluated"][tuned["chosen"]]["assignment"] == chosen["assignment"]
        label = ", ".join(f"{g} {p}" for g, p in chosen["assignment"].items())
        secs = report["seconds"]
        rows.append(
            f"| {names[key]} | {len(report['evaluated'])} of {report['configurations']} | {label} | "
            f"{format_bytes(chosen['nbytes'])} of {format_bytes(report['bf16_bytes'])} "
            f"({chosen['nbytes'] / report['bf16_bytes']:.2f}x) | {keep:.1f} | {auto:.1f} | "
            f"{secs['target']:.1f} / {secs['sensitivity']:.1f} / {secs['confirm']:.1f} | {tune:.1f} | {val:.1f} | "
            f"{(auto - keep) / val:.2f}x | {tune / val:.2f}x | {'yes' if same else 'NO'} |"
        )
        print(rows[-1], flush=True)
    m = machine(work)
    return "\n".join([
        TINY_HEADING,
        "",
        f"`{command_line('bench_search.py')}` on {today()}: each step `python -m mtpquant ...` in a fresh process on "
        "the trained tiny models (16 x 128 calibration tokens, CPU): `convert --keep-mtp`, `convert --mtp auto` (the "
        "default search: budget 0.05 AL at k = 1..3, greedy, 64 held-out prompts, vLLM's loading rules), `tune-mtp` "
        "of the keep convert, and one `validate SRC KEEP --num-prompts 64 --max-len 128 --k 3 --activations emulate` "
        "(the search's measurement settings; validate runs the reference's and the candidate's targets). Search "
        "cost = the wall time `--mtp auto` adds to the keep convert, and tune-mtp's whole wall time, each over the "
        "validate's. The search's own phases (report.json `seconds`): the quantized target run once (its hidden "
        "states and the MTP's calibration), every group alone in every precision, the combinations confirmed.",
        "",
        "| model | configurations measured (of loadable) | chosen | MTP bytes | convert keep s | convert auto s | "
        "search: target / sensitivity / confirm s | tune-mtp s | validate s | search / validate | tune-mtp / "
        "validate | tune-mtp chose the same |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        machine_line(m),
        "",
    ])


def _sources(work: Path) -> list[tuple[str, str, dict[str, tuple[str, tuple[int, ...]]], Any]]:
    """(name, where the shapes come from, every MTP tensor -> (dtype, shape), family) per full-size model."""
    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.families import resolve
    from tests.support.qwen4_exp_skeleton import make_qwen4_exp_skeleton
    from tests.support.skeleton import find_layout, make_skeleton

    out = []
    for name in ("Qwen3.5-35B-A3B", "Qwen3-Next-80B-A3B-Instruct"):
        path = work / "skeletons" / name
        make_skeleton(find_layout(name, LAYOUTS), path, overwrite=True)
        ckpt = Checkpoint.open(path)
        out.append((name, "skeleton headers", {e.name: (e.dtype, tuple(e.shape)) for e in ckpt.mtp_tensors()},
                    ckpt.spec.family))  # fmt: skip
    path = work / "skeletons" / "Qwen3.8-Flash-Next"
    make_qwen4_exp_skeleton(path, "source", overwrite=True)
    ckpt = Checkpoint.open(path)
    out.append(("Qwen3.8-Flash-Next", "skeleton headers", {e.name: (e.dtype, tuple(e.shape))
                                                          for e in ckpt.mtp_tensors()}, ckpt.spec.family))  # fmt: skip
    config = copy.deepcopy(json.loads(next(LAYOUTS.glob("Qwen3.5-35B-A3B_config*.json")).read_text()))
    config["text_config"].update(QWEN35_397B)
    spec = resolve(config)
    shapes = {n: ("BF16", tuple(s)) for n, s in spec.expected_mtp_shapes().items()}
    out.insert(0, ("Qwen3.5-397B-A17B", "config (no layout table)", shapes, spec.family))
    shutil.rmtree(work / "skeletons", ignore_errors=True)
    return out


def full_size(work: Path) -> str:
    """(b): bytes per configuration on full-size MTPs, from headers."""
    from mtpquant.search.space import MtpSpace

    summary = []
    details = []
    t0 = time.perf_counter()
    for name, origin, tensors, family in _sources(work):
        vllm = MtpSpace(family, tensors, engines=("vllm",))
        every = MtpSpace(family, tensors, engines=("vllm", "sglang"))
        bf16 = vllm.nbytes(vllm.bf16)
        loads_vllm = vllm.configurations()
        loads_all = set(every.configurations())
        groups = ", ".join(
            f"{g.key} {format_bytes(vllm.group_bytes(g.key, 'bf16'))} / {format_bytes(vllm.group_bytes(g.key, 'fp8'))}"
            f" / {format_bytes(vllm.group_bytes(g.key, 'nvfp4'))}"
            for g in vllm.groups
        )
        small_v, small_a = loads_vllm[0], min(loads_all, key=vllm.nbytes)
        summary.append(
            f"| {name} | {origin} | {len(tensors)} | {format_bytes(bf16)} | {groups} | {len(loads_vllm)} | "
            f"{small_v.label}: {format_bytes(vllm.nbytes(small_v))}, saves {format_bytes(bf16 - vllm.nbytes(small_v))}"
            f" | {len(loads_all)} | {small_a.label}: {format_bytes(vllm.nbytes(small_a))}, saves "
            f"{format_bytes(bf16 - vllm.nbytes(small_a))} |"
        )
        details += [f"<details><summary>{name}: every configuration vLLM loads ({len(loads_vllm)})</summary>", "",
                    "| configuration | bytes | x BF16 | saved | declared | every engine loads it |",
                    "|---|---:|---:|---:|---|---|"]  # fmt: skip
        for a in loads_vllm:
            n = vllm.nbytes(a)
            details.append(f"| {a.label} | {format_bytes(n)} | {n / bf16:.3f} | {format_bytes(bf16 - n)} | "
                           f"{vllm.declaration(a).kind} | {'yes' if a in loads_all else 'no'} |")  # fmt: skip
        details += ["", "</details>", ""]
        print(summary[-1], flush=True)
    seconds = time.perf_counter() - t0
    return "\n".join([
        FULL_HEADING,
        "",
        f"`{command_line('bench_search.py')}` on {today()}: the MTP of each full-size model read from the headers "
        "of its sparse skeleton (`tests/support/skeleton.py`, `tests/support/qwen4_exp_skeleton.py`; Qwen3.5-397B-"
        "A17B has no layout table, so its MTP is the one its config implies: the Qwen3.5-35B-A3B config with the "
        "397B's published dimensions, hidden 4096, 32 / 2 heads of 256, 512 experts and a shared expert of "
        "intermediate 1024), and the search's space over it (`search.space.MtpSpace`: the tensors and bytes each "
        "configuration writes, exactly what `quantize_mtp` writes; whether vLLM, and every engine (vLLM and "
        "SGLang), load it, plain or MIXED_PRECISION). Group bytes are BF16 / FP8 / NVFP4 (scales included). "
        f"{seconds:.0f} s in all, skeletons included.",
        "",
        "| model | MTP from | tensors | BF16 MTP | groups (BF16 / FP8 / NVFP4) | vLLM loads | smallest vLLM loads | "
        "every engine loads | smallest every engine loads |",
        "|---|---|---:|---:|---|---:|---|---:|---|",
        *summary,
        "",
        "The search picks among these by measured acceptance; which one it takes on a full-size model depends on "
        "that model's MTP, not measured here (no full-size weights on this machine).",
        "",
        *details,
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (converts, skeletons)")
    ap.add_argument("--skip-tiny", action="store_true", help="only (b)")
    ap.add_argument("--skip-full", action="store_true", help="only (a)")
    ap.add_argument("--write", action="store_true", help="rewrite the sections of docs/BENCHMARKS.md")
    ap.add_argument("--family", action="append", choices=("qwen3_5", "qwen3_5_moe", "qwen4_exp"),
                    help="(a) on this trained tiny model only (repeatable; printed, never written)")  # fmt: skip
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.skip_full:
        section = full_size(args.work)
        if args.write:
            write_section(FULL_HEADING, section)
        else:
            print(section)
    if not args.skip_tiny:
        section = tiny(args.work, args.family)
        if args.write and not args.family:
            write_section(TINY_HEADING, section)
        else:
            print(section)


if __name__ == "__main__":
    main()
