#!/usr/bin/env python3
"""The real serve check of a DeepSeek MTP (appended layer, MLA), for a GPU machine with vLLM >= 0.32 (CUDA).

    python scripts/nextn_serve_check.py --vllm-python /opt/vllm/bin/python [--work DIR] [--checkpoint CKPT ...]

vLLM's CPU build cannot run DeepSeek's MLA (``kv_lora_rank + qk_rope_head_dim`` must be 320, 512 or 576, then
"Unsupported block size: 16"), so what mtpquant says about this family's MTP is checked here against the real engine
(the GLM-4.x one runs in the CPU test suite: tests/test_nextn_vllm.py). For each case the script prints inspect's
vLLM verdict and what vLLM did: started with MTP speculative decoding and answered a greedy completion (with its
draft counters), or failed to start (its error line); they must agree. Cases, all from
``mtpquant tiny --variant deepseek_v3-mla`` (DeepSeek's own MLA dimensions, random weights: a load check):

- ``tiny-bf16``: the BF16 checkpoint, its MTP at ``model.layers.2`` with the head and embedding copies;
- ``mtp-lost``: the MTP's shard gone, still declared: inspect predicts DeepSeekMTP's
  ``MTP speculative decoding layer 2 weights missing from checkpoint``;
- ``mtp-grafted``: that one after ``mtpquant graft --from`` the BF16 checkpoint;
- ``nextn-grafted``: the same from SGLang's standalone NextN form (``mtpquant extract --nextn``: layer 0, no copies),
  the copies taken from the quant's own head and embedding;
- every ``--checkpoint`` given (a real DeepSeek / GLM quant copied onto the machine).

Exit 0 when every vLLM outcome matches inspect's verdict; the table goes into docs/BENCHMARKS.md ("CUDA check").
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen4_exp_serve_check import serve

from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.graft.extract import ExtractOptions, extract_mtp
from mtpquant.graft.run import GraftOptions, graft
from mtpquant.synth.tiny import make_tiny_checkpoint


def _lost(src: Path, out: Path) -> Path:
    shutil.copytree(src, out, copy_function=shutil.copy)
    index = json.loads((out / INDEX_NAME).read_text())
    spec = Checkpoint.open(src).spec
    shards = {s for n, s in index["weight_map"].items() if spec.is_mtp(n)}
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s not in shards}
    for shard in shards:
        (out / shard).unlink()
    (out / INDEX_NAME).write_text(json.dumps(index))
    return out


def cases(work: Path) -> list[tuple[str, Path]]:
    """The checkpoints the check serves, built in ``work``."""
    tiny = make_tiny_checkpoint(work / "tiny-bf16", "deepseek_v3-mla")
    lost = _lost(tiny, work / "mtp-lost")
    graft(GraftOptions(quant=lost, source=tiny, out=work / "mtp-grafted"))
    extract_mtp(ExtractOptions(tiny, work / "nextn", nextn=True))
    graft(GraftOptions(quant=lost, source=work / "nextn", out=work / "nextn-grafted"))
    return [(p.name, p) for p in (tiny, lost, work / "mtp-grafted", work / "nextn-grafted")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True, help="a python with vLLM >= 0.32 (CUDA) installed")
    p.add_argument("--work", type=Path, default=Path("/tmp/mtpquant-nextn-serve"))
    p.add_argument("--checkpoint", type=Path, action="append", default=[], help="a real DeepSeek / GLM checkpoint")
    p.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    p.add_argument("--dry-run", action="store_true", help="build the cases and print inspect's verdicts; serve none")
    args = p.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    rows, agree = [], True
    for name, ckpt in [*cases(args.work), *((c.name, c) for c in args.checkpoint)]:
        verdict = inspect_checkpoint(ckpt).verdicts["vllm"]
        t0 = time.monotonic()
        started, what = (False, "not served (--dry-run)") if args.dry_run else serve(
            args.vllm_python, ckpt, args.work / f"{name}.log", args.k
        )
        ok = args.dry_run or started == verdict.startswith("vLLM: MTP loads")
        agree &= ok
        rows.append({"case": name, "inspect": verdict, "vllm": what, "agree": ok, "s": round(time.monotonic() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'case':<20} {'agree':<6} {'s':>6}  inspect / vLLM")
    for r in rows:
        print(f"{r['case']:<20} {'yes' if r['agree'] else 'NO':<6} {r['s']:>6}  {r['inspect']} / {r['vllm']}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
