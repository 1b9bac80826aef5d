"""How long a vLLM CPU server takes to be ready, per environment the tests start it with (issue 42).

The trained tiny Qwen3.5 (``mtpquant/assets/tiny-qwen3_5-mtp``) served by vLLM 0.32 CPU at k = 2 through mtpquant's
own launcher, started as the test pool starts it (``tests.support.engine.pool_server``), under each environment of
``--env`` (default: both), ``--repeat`` times each, alternating:

- ``mp``: vLLM's default CPU executor (API server, engine core, a worker process; OpenMP threads bound to core 1 as
  the tests' ``MP_CPU_ENV`` binds the second worker's);
- ``uni``: the tests' ``CPU_ENV`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``OMP_NUM_THREADS=1``: the model runs in the
  engine-core process).

Per start: seconds to ready (``/health``), seconds for 8 greedy prompts (``--concurrency 8``), and the digest of the
tokens and the speculative counters, which must be the same under every environment (the run fails otherwise).

    flock /tmp/mtpquant-heavy.lock .venv/bin/python scripts/bench_engine_start.py --repeat 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtpquant.engine.server import RunRequest
from mtpquant.engine.vllm import VllmClient
from mtpquant.records.sampling import GREEDY
from mtpquant.synth.train import TINY_MTP_ASSET
from tests.support.engine import CPU_ENV, MP_CPU_ENV, pool_server, prompt_ids
from tests.support.vllm_env import vllm_python

ENVS = {
    "mp": {**MP_CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": "1"},  # as the tests bind the second xdist worker's servers
    "uni": CPU_ENV,
}


def one(name: str, log_dir: Path) -> dict[str, object]:
    """Start, measure 8 greedy prompts, stop: the seconds and the digest of what was served."""
    server = pool_server(vllm_python(), log_dir / name, TINY_MTP_ASSET, 2, env=ENVS[name])
    t0 = time.monotonic()
    server.start()
    ready = time.monotonic() - t0
    try:
        client = VllmClient(server.url)
        ids, n = prompt_ids(TINY_MTP_ASSET, 8)
        t1 = time.monotonic()
        run = client.run(RunRequest(str(TINY_MTP_ASSET), ids, n, GREEDY, concurrency=8), client.info())
        generate = time.monotonic() - t1
    finally:
        server.stop()
    served = json.dumps([[list(c.tokens) for c in run.completions], str(run.counts)])
    return {"env": name, "ready_s": round(ready, 1), "generate_s": round(generate, 1),
            "served": hashlib.sha256(served.encode()).hexdigest()[:16]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", nargs="+", choices=sorted(ENVS), default=["mp", "uni"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/bench-engine-start"))
    opts = parser.parse_args()
    opts.logs.mkdir(parents=True, exist_ok=True)
    rows = [one(name, opts.logs) for _ in range(opts.repeat) for name in opts.env]
    for row in rows:
        print(json.dumps(row))
    digests = {row["served"] for row in rows}
    if len(digests) != 1:
        print(f"different tokens or counters across environments: {sorted(digests)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
