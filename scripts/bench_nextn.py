"""Benchmark convert and validate on the GLM-4.5 layout (glm4_moe): the full-size plan, the tiny converts, validate.

1. The full-size zai-org/GLM-4.5 release as a header-only skeleton (``tests/support/nextn_skeleton.py``: 92 layers
   and the MTP at layer 92 with its head and embedding copies, 160 experts), ``convert --dry-run`` per MTP mode,
   uncapped and with ``--max-memory``: wall and peak RSS of the whole command, in a fresh process.
2. The trained tiny GLM-4.5-layout model (``mtpquant/assets/tiny-glm4_moe-mtp``) converted in every MTP mode, and
   quantize again under a memory cap (disk offload, layer-wise calibration): wall, convert's own time split, peak RSS;
   the trained tiny Qwen3.5 (the same hidden size) converted with the same flags as the peer.
3. validate (built-in, 32 held-out prompts, k = 1..3) of the keep and quantize outputs against the source, and with
   ``--engine`` the real vLLM CPU engine's AL beside validate's prediction (48 prompts, k = 2, T = 0 and 0.8) for the
   source and the keep and quantize outputs with their routed experts BF16 (the CPU build has no NVFP4 MoE kernel).

    .venv/bin/python scripts/bench_nextn.py --write-doc [--engine]

``--full-convert WORK`` measures instead the bounded-memory convert with real bytes: a GLM-4.5-Air-dimension
checkpoint cut to its first dense and first MoE layer plus the MTP layer (with its head and embedding copies), every
tensor random-normal (``tests/support/nextn_skeleton.py`` ``make_nextn_normal``, ~15 GB, built in WORK and deleted
after unless ``--keep-source``), converted by the CLI as users run it (``mtpquant convert SRC OUT --mtp quantize
--max-memory CAP``) in a fresh process: wall, peak RSS (VmHWM) against the cap + 2 GB, the output inspected; its own
section of docs/BENCHMARKS.md with ``--write-doc``.

    .venv/bin/python scripts/bench_nextn.py --full-convert /tmp/bench-glm --full-cap cpu=9.1GiB --write-doc
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _benchlib import BENCHMARKS as DOC
from _benchlib import REPO, command_line, machine, machine_line, run_python, write_section

HEADING = "## convert and validate on the GLM-4.5 layout (glm4_moe): the full-size plan, the tiny model, the engine"
ASSET = REPO / "mtpquant" / "assets" / "tiny-glm4_moe-mtp"
PEER = REPO / "mtpquant" / "assets" / "tiny-qwen3_5-mtp"
CALIB = ["--calib-samples", "16", "--calib-seq-len", "128", "--device", "cpu"]
CPU_MOE = 'quantization.exclude=["*mlp.experts*"]'  # vLLM's CPU build has no NVFP4 MoE kernel


def dry_runs(root: Path, cap: str) -> tuple[list[dict[str, Any]], int]:
    from tests.support.nextn_skeleton import make_nextn_skeleton

    src = make_nextn_skeleton("glm-4.5", root / "src")
    size = sum(p.stat().st_size for p in src.iterdir())
    rows = []
    for mode in ("keep", "quantize"):
        for flags in ([], ["--max-memory", cap]):
            out = root / f"out-{mode}"
            run = run_python(["-m", "mtpquant", "convert", str(src), str(out), "--mtp", mode, "--dry-run", "--device",
                              "cpu", *flags])  # fmt: skip
            rows.append({"mode": mode, "flags": " ".join(flags) or "(none)", "wall": run.wall, "rss": run.max_rss,
                         "rc": run.returncode})  # fmt: skip
            print(f"dry-run {mode} {flags}: {run.wall:.2f}s {run.max_rss / 2**20:.0f} MiB exit {run.returncode}")
    return rows, size


def _tiny(src: Path, out: Path, mode: str, flags: list[str]) -> dict[str, Any]:
    extra = ["--mtp-out", str(out) + "-mtp"] if mode == "extract" else []
    run = run_python(["-m", "mtpquant", "convert", str(src), str(out), "--mtp", mode, "--json", *CALIB, *flags, *extra])
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-3000:])
        raise SystemExit(f"convert {src.name} {mode} {flags} failed")
    t = run.output["timings"]
    print(f"{src.name} {mode} {flags}: wall {run.wall:.1f}s convert {t['total']:.1f}s {run.max_rss / 2**20:.0f} MiB")
    return {"mode": mode, "flags": " ".join(flags) or "(none)", "wall": run.wall, "rss": run.max_rss, "t": t,
            "source": run.output["plan"]["source"]["bytes"], "output": run.output["output_bytes"]}  # fmt: skip


def tiny_converts(root: Path, cap: str) -> list[dict[str, Any]]:
    rows = []
    cases: list[tuple[str, list[str]]] = [(m, []) for m in ("keep", "quantize", "extract", "drop")]
    for mode, flags in [*cases, ("quantize", ["--max-memory", cap])]:
        tag = f"{mode}{'-capped' if flags else ''}"
        row = _tiny(ASSET, root / f"glm-{tag}", mode, flags)
        row["peer"] = _tiny(PEER, root / f"peer-{tag}", mode, flags)
        rows.append(row)
    return rows


def validations(root: Path, engine: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from mtpquant.validate.run import ValidateOptions, validate

    rows = []
    for mode in ("keep", "quantize"):
        t0 = time.perf_counter()
        report = validate(ValidateOptions(reference=str(ASSET), candidate=str(root / f"glm-{mode}"), device="cpu",
                                          progress=False)).report  # fmt: skip
        assert report.candidate is not None and report.candidate.acceptance is not None
        assert report.reference.acceptance is not None and report.comparison is not None
        mtp = report.comparison.mtp
        rows.append({"mode": mode, "seconds": time.perf_counter() - t0, "ref": report.reference.acceptance.al,
                     "cand": report.candidate.acceptance.al, "agree": mtp.top1_agreement if mtp else None,
                     "verdict": report.verdict.status})  # fmt: skip
        print(rows[-1])
    measured: list[dict[str, Any]] = []
    if engine:
        from mtpquant.convert.run import ConvertOptions, convert
        from tests.support.engine import CONCURRENCY, CPU_ENV
        from tests.support.vllm_env import vllm_python

        # the CPU build has no NVFP4 MoE kernel: the keep and quantize outputs served here keep their routed experts
        # BF16 (the quantize output's MTP too: attention and shared expert NVFP4 W4A4)
        served = {"source": ASSET}
        for mode in ("keep", "quantize"):
            served[f"{mode}, experts BF16"] = root / f"glm-{mode}-cpu"
            convert(ConvertOptions(src=str(ASSET), out=root / f"glm-{mode}-cpu", mtp=mode, calib_samples=8,
                                   calib_seq_len=128, device="cpu", progress=False, overrides=(CPU_MOE,)))  # fmt: skip
        for which, path in served.items():
            opts = ValidateOptions(path, num_prompts=48, max_len=160, ks=(2,), device="cpu", engine="vllm",
                                   activations="off" if which == "source" else "emulate", vllm_python=vllm_python(),
                                   env=CPU_ENV, concurrency=CONCURRENCY, compare_reference=True,
                                   temperatures=(0.0, 0.8), progress=False)  # fmt: skip
            predicted = validate(opts).report.predicted
            assert predicted is not None
            for r in predicted.to_json()["reference"]:
                measured.append({"which": which, **r})
                print(which, r["label"], r["predicted_al"], r["engine_al"])
    return rows, measured


def markdown(dry: list[dict[str, Any]], size: int, tiny: list[dict[str, Any]], val: list[dict[str, Any]],
             engine: list[dict[str, Any]], facts: dict[str, Any], cap: str, tiny_cap: str) -> str:  # fmt: skip
    from mtpquant.runtime.memory import parse_max_memory

    limit = sum(n for _, n in parse_max_memory(cap).caps)
    lines = [HEADING, "", f"Command: `{command_line('bench_nextn.py')}`", "", machine_line(facts), ""]
    lines += [
        f"Full-size GLM-4.5 `--dry-run` (headers only; {size / 1e9:.0f} GB of sparse files). Each row is one fresh "
        "`mtpquant convert` process. Uncapped, the plan refuses a machine that cannot hold the model's largest block "
        "and the calibration buffers (exit 22); with the cap it plans layer-wise calibration with the rest on disk "
        f"(peak RSS against the cap + 2 GB: {(limit + 2e9) / 2**30:.1f} GiB). A full calibration of the 355B model "
        "on 2 CPU cores is out of reach; the capped path's output equals the in-memory one byte for byte on the "
        "tiny models (tests/test_convert_nextn.py).",
        "",
        "| MTP mode | flags | wall s | peak RSS MiB | under cap + 2 GB | exit |",
        "|---|---|---:|---:|---|---:|",
    ]
    lines += [f"| {r['mode']} | {r['flags']} | {r['wall']:.2f} | {r['rss'] / 2**20:.0f} | "
              f"{'yes' if r['rss'] <= limit + 2e9 else 'no'} | {r['rc']} |" for r in dry]  # fmt: skip
    lines += [
        "",
        f"Tiny converts of the trained tiny GLM-4.5-layout model ({tiny[0]['source'] / 2**20:.2f} MiB; "
        f"`{' '.join(CALIB)}`); the capped row forces disk offload and layer-wise calibration "
        f"(`--max-memory {tiny_cap}`). Peer: the trained tiny Qwen3.5 ({tiny[0]['peer']['source'] / 2**20:.2f} MiB), "
        "the same flags right after each row; ratio = GLM convert s / Qwen3.5 convert s.",
        "",
        "| MTP mode | flags | process wall s | convert s | imports s | calibrate s | mtp s | peak RSS MiB | output MiB "
        "| Qwen3.5 convert s | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in tiny:
        t, p = r["t"], r["peer"]["t"]
        lines.append(f"| {r['mode']} | {r['flags']} | {r['wall']:.1f} | {t['total']:.1f} | {t.get('imports', 0):.1f} | "
                     f"{t.get('calibrate', 0):.1f} | {t.get('mtp', 0):.1f} | {r['rss'] / 2**20:.0f} | "
                     f"{r['output'] / 2**20:.2f} | {p['total']:.1f} | {t['total'] / p['total']:.2f} |")  # fmt: skip
    lines += [
        "",
        "validate (built-in, the defaults: 32 held-out prompts, 128 tokens, k = 1..3, CPU float32) of the outputs "
        "against the source; MTP agreement is top-1 on identical inputs.",
        "",
        "| output | seconds | source AL k=1/2/3 | output AL k=1/2/3 | MTP agreement | verdict |",
        "|---|---:|---|---|---:|---|",
    ]
    for r in val:
        fmt = " / ".join(f"{a:.3f}" for a in r["ref"]), " / ".join(f"{a:.3f}" for a in r["cand"])
        lines.append(f"| {r['mode']} | {r['seconds']:.0f} | {fmt[0]} | {fmt[1]} | {100 * r['agree']:.2f} % | "
                     f"{r['verdict']} |")  # fmt: skip
    if engine:
        lines += [
            "",
            "The real vLLM 0.32 CPU engine (`Glm4MoeMTPModel`, 48 prompts, k = 2, its counters) beside validate's "
            "prediction on the same prompts and seeds; k = 1 is position 1. The CPU build has no NVFP4 MoE kernel: "
            "the keep and quantize outputs served are converted with the routed experts BF16 (attention, dense and "
            "shared MLPs NVFP4 W4A4, the quantize output's MTP too, `--activations emulate`); the all-NVFP4 quantize "
            "output is served by `scripts/gpu_check.sh`.",
            "",
            "| checkpoint | setting | predicted AL k=2 | engine AL k=2 | difference | predicted pos. 1 | engine pos. 1 "
            "| engine steps |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [f"| {r['which']} | {r['label']} | {r['predicted_al']:.3f} | {r['engine_al']:.3f} | "
                  f"{r['difference']:+.3f} | {r['predicted_per_position'][0]:.3f} | {r['engine_per_position'][0]:.3f} "
                  f"| {r['engine_steps']} |" for r in engine]  # fmt: skip
    return "\n".join(lines) + "\n"


FULL_HEADING = "## bounded-memory convert of a GLM-4.5-Air-dimension checkpoint (glm4_moe, real bytes, --max-memory)"
FULL_CALIB = ["--calib-samples", "4", "--calib-seq-len", "64", "--device", "cpu"]


def full_convert(work: Path, cap: str, keep_source: bool) -> dict[str, Any]:
    """The capped ``--mtp quantize`` convert of the GLM-4.5-Air-dimension checkpoint (real bytes), through the CLI, in
    a child sampled from outside as the Qwen3.5-4B one (``bench_convert_scale.run_convert``)."""
    import shutil

    from bench_convert_scale import run_convert

    from tests.support.nextn_skeleton import make_nextn_normal

    src, out = work / "glm-4.5-air-2-layers", work / "glm-4.5-air-2-layers-nvfp4"
    row: dict[str, Any] = {"cap": cap, "build_s": None}
    if not (src / "config.json").exists():
        t0 = time.perf_counter()
        make_nextn_normal("GLM-4.5-Air", src, layers=2, overwrite=True)
        row["build_s"] = time.perf_counter() - t0
    log = work / "convert.log"
    row |= run_convert(src, out, ["--max-memory", cap, *FULL_CALIB[:-2], "--json"], log, ("--mtp", "quantize"))
    lines = log.read_text().splitlines()  # the child's timestamped log, its --json object, the RSS timeline
    first = lines.index("{")
    result = json.loads("\n".join(lines[first : lines.index("}", first) + 1]))
    inspected = run_python(["-m", "mtpquant", "inspect", str(out), "--json"])
    row |= {"result": result, "inspect_rc": inspected.returncode, "healthy": inspected.output.get("healthy"),
            "vllm": inspected.output.get("verdicts", {}).get("vllm"),
            "source_bytes": sum(p.stat().st_size for p in src.glob("*.safetensors"))}  # fmt: skip
    print(f"wall {row['wall_s']:.0f}s peak RSS {row['peak_rss'] / 1e9:.2f} GB (anon {row['peak_anon'] / 1e9:.2f}, file "
          f"{row['peak_file'] / 1e9:.2f}) healthy {row['healthy']}", flush=True)  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    if not keep_source:
        shutil.rmtree(src, ignore_errors=True)
    return row


def full_markdown(row: dict[str, Any], facts: dict[str, Any]) -> str:
    from mtpquant.runtime.memory import parse_max_memory

    cap = sum(n for _, n in parse_max_memory(row["cap"]).caps)
    limit = cap + 2e9
    r, t = row["result"], row["result"]["timings"]
    phases = ", ".join(f"{k} {v:.0f}" for k, v in t.items() if k != "total" and v >= 0.5)
    memory = r["plan"]["memory"]
    placement = ", ".join([*(f"{d} {n / 1e9:.2f} GB" for d, n in memory["resident"].items()),
                           f"disk {memory['disk_bytes'] / 1e9:.2f} GB"])  # fmt: skip
    built = f", built in {row['build_s']:.0f} s" if row["build_s"] else ""
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    return "\n".join([
        FULL_HEADING, "",
        f"Command: `{command_line('bench_nextn.py')}`", "", machine_line(facts), "",
        "The source has GLM-4.5-Air's dimensions (hidden 4096, 96 heads, 128 routed experts of 1408, vocabulary "
        "151,552) with only its first dense and first MoE layer, then the MTP layer (a full MoE layer with `eh_proj` "
        "and its head and embedding copies), every tensor random-normal in its dtype "
        f"(`tests/support/nextn_skeleton.py` `make_nextn_normal`): {gb(row['source_bytes'])} of real bytes{built}. "
        "The convert is one child process running the CLI, sampled every 0.2 s from outside as the Qwen3.5-4B one "
        "(`scripts/bench_convert_scale.py` `run_convert`): peak RSS is the kernel's `ru_maxrss` (anonymous and "
        "file-backed pages together), peak anonymous and peak file-backed the largest sampled `RssAnon` / "
        "`RssFile` (file-backed: the source shards' pages read in place, which the kernel drops under pressure).",
        "", f"`{row['command']}`", "",
        "| | measured | against the cap + 2 GB (" + gb(limit) + ") | against the cap (" + gb(cap) + ") |",
        "|---|---:|---:|---:|",
        f"| peak RSS | {gb(row['peak_rss'])} | {row['peak_rss'] / limit:.2f}x | {row['peak_rss'] / cap:.2f}x |",
        f"| peak anonymous | {gb(row['peak_anon'])} | {row['peak_anon'] / limit:.2f}x | "
        f"{row['peak_anon'] / cap:.2f}x |",
        f"| peak file-backed | {gb(row['peak_file'])} | | |",
        f"| wall | {row['wall_s']:.0f} s | | |",
        f"| placement (plan) | {placement}; {'layer-wise' if r['layerwise'] else 'one pass'} | | |",
        f"| output | {gb(row['output_bytes'])}; written {row['bytes_written'] / row['output_bytes']:.2f}x; peak extra "
        f"disk {gb(row['peak_extra_disk'])} | | |",
        f"| inspect | {'healthy' if row['healthy'] else 'NOT healthy'}: {row['vllm']} | | |",
        "", f"convert's own phases (s): {phases}; total {t['total']:.0f}.", "",
        "What bounds it (the child's RSS timeline, in the script's WORK/convert.log): the plan estimates "
        f"~{gb(memory['peak']['cpu'])} for this cap (resident {gb(sum(memory['resident'].values()))} + the runtime + "
        f"the calibration's MoE layer read from disk beside the MTP layer as large, twice {gb(memory['largest_block'])}"
        "; the export's layer, its packed copy and one output shard hold less), within the cap + 2 GB, and gives "
        f"accelerate cpu={gb((memory['caps'] or {}).get('cpu', 0))} to place weights in; a cap under which even the "
        "first weights alone would pass the cap + 2 GB is refused before anything runs, naming the smallest that does "
        "not. The MTP layer is freed after its calibration and read again to be "
        "quantized; the source pages transformers read through its mappings are paged out after each fused offload "
        "and after loading.",
    ]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", default="cpu=16GiB", help="--max-memory of the full-size plan (default cpu=16GiB)")
    parser.add_argument("--tiny-cap", default="cpu=1.5MB", help="--max-memory of the capped tiny convert")
    parser.add_argument("--engine", action="store_true", help="also measure with the vLLM CPU test engine")
    parser.add_argument("--write-doc", action="store_true", help="replace this script's section of docs/BENCHMARKS.md")
    parser.add_argument("--full-convert", type=Path, metavar="WORK",
                        help="instead: the capped convert of a GLM-4.5-Air-size checkpoint with real bytes in WORK")
    parser.add_argument("--full-cap", default="cpu=9.1GiB",
                        help="--max-memory of --full-convert (default cpu=9.1GiB: the smallest convert accepts)")
    parser.add_argument("--keep-source", action="store_true", help="--full-convert: keep the ~15 GB source in WORK")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.full_convert is not None:
        args.full_convert.mkdir(parents=True, exist_ok=True)
        row = full_convert(args.full_convert, args.full_cap, args.keep_source)
        if args.write_doc:
            write_section(FULL_HEADING, full_markdown(row, machine(args.full_convert)))
            print(f"updated {DOC}")
        return
    with tempfile.TemporaryDirectory(prefix="bench-nextn-") as tmp:
        dry, size = dry_runs(Path(tmp) / "full", args.cap)
        tiny = tiny_converts(Path(tmp) / "tiny", args.tiny_cap)
        val, engine = validations(Path(tmp) / "tiny", args.engine)
        facts = machine(Path(tmp))
    if args.write_doc:
        write_section(HEADING, markdown(dry, size, tiny, val, engine, facts, args.cap, args.tiny_cap))
        print(f"updated {DOC}")


if __name__ == "__main__":
    main()
