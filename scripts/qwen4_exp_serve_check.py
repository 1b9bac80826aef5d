#!/usr/bin/env python3
"""The real serve check of Qwen3.8-Flash-Next (qwen4_exp) with MTP: for a GPU machine with vLLM >= 0.32 (CUDA).

    python scripts/qwen4_exp_serve_check.py --vllm-python /opt/vllm/bin/python [--work DIR] [--checkpoint CKPT ...]

vLLM cannot build this family on CPU (hyper-connection, PLE and QSA ops are Triton-only; QSA needs
FlashAttention), so what mtpquant says about it is checked here against the real engine. For each case the
script prints mtpquant's inspect verdict and what vLLM did: started with MTP speculative decoding and answered a
greedy completion (with its draft-acceptance counters), or failed to start (its error line). Cases:

- ``tiny-bf16``: ``mtpquant tiny --variant qwen4_exp`` (random weights: a load check, acceptance means nothing);
- ``nvidia-mixed``: NVIDIA's published layout (MIXED_PRECISION, FP8 per-block MTP experts, FP8 n-gram table);
- ``nvidia-mixed-refreshed``: its metadata-only refresh (MTP experts relabelled FP8): inspect predicts
  ``Layer mtp.layers.N.mlp.experts has no parameter 'w2_weight_scale_inv'``;
- ``nvidia-mixed-refreshed-fixed``: the same after ``mtpquant graft --fix-metadata``;
- ``nvfp4-mtp-partly-excluded`` and its ``--fix-metadata`` repair (fc_embedding / fc_hidden and the n-gram table);
- every ``--checkpoint`` given (a real quant copied onto the machine: nothing outside it can be reached).

The fixtures come from ``tests/support/qwen4_exp_quants.py`` (run from a repository checkout). Exit 0 when every
vLLM outcome matches inspect's verdict; the table goes into docs/BENCHMARKS.md ("CUDA check").
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.engine.launch import EngineProcess, free_port, server_args
from mtpquant.errors import EngineStartError
from mtpquant.graft.run import fix_metadata
from mtpquant.synth.tiny import make_tiny_checkpoint

FIXTURES = ("nvidia-mixed", "nvidia-mixed-refreshed", "nvfp4-mtp-partly-excluded")


def serve(python: str, ckpt: Path, log: Path, k: int) -> tuple[bool, str]:
    """Start vLLM with MTP on ``ckpt``; (started, what happened)."""
    import requests

    port = free_port()
    extra = ["--max-model-len", "4096", "--enforce-eager", "--gpu-memory-utilization", "0.85"]
    args = server_args("vllm", str(ckpt), port, k=k, extra=extra)
    try:
        with EngineProcess("vllm", python, args, log, port=port, startup_timeout=900) as server:
            body = {"model": str(ckpt), "prompt": [1, 2, 3, 4], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            r = requests.post(server.url + "/v1/completions", json=body, timeout=300)
            metrics = requests.get(server.url + "/metrics", timeout=30).text
            drafts = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_draft")]
            return (
                r.status_code == 200,
                f"HTTP {r.status_code}; {' '.join(d.split()[-1] for d in drafts) or 'no counters'}",
            )
    except EngineStartError as exc:
        return False, str(exc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True, help="a python with vLLM >= 0.32 (CUDA) installed")
    p.add_argument("--work", type=Path, default=Path("/tmp/mtpquant-qwen4-exp-serve"))
    p.add_argument("--checkpoint", type=Path, action="append", default=[], help="a real qwen4_exp checkpoint")
    p.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    args = p.parse_args()
    from tests.support.qwen4_exp_quants import make_qwen4_exp_quant

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    tiny = make_tiny_checkpoint(args.work / "tiny-bf16", "qwen4_exp")
    cases: list[tuple[str, Path]] = [("tiny-bf16", tiny)]
    for kind in FIXTURES:
        q = make_qwen4_exp_quant(tiny, args.work / kind, kind)
        cases.append((kind, q))
        if kind != "nvidia-mixed":
            fixed = args.work / f"{kind}-fixed"
            fix_metadata(q, out=fixed)
            cases.append((f"{kind}-fixed", fixed))
    cases += [(c.name, c) for c in args.checkpoint]
    rows, agree = [], True
    for name, ckpt in cases:
        report = inspect_checkpoint(ckpt)
        t0 = time.monotonic()
        started, what = serve(args.vllm_python, ckpt, args.work / f"{name}.log", args.k)
        ok = started == report.verdicts["vllm"].startswith("vLLM: MTP loads")
        agree &= ok
        rows.append(
            {
                "case": name,
                "inspect": report.verdicts["vllm"],
                "vllm": what,
                "agree": ok,
                "s": round(time.monotonic() - t0, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'case':<34} {'agree':<6} {'s':>6}  inspect / vLLM")
    for r in rows:
        print(f"{r['case']:<34} {'yes' if r['agree'] else 'NO':<6} {r['s']:>6}  {r['inspect']} / {r['vllm']}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
