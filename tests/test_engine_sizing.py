"""The memory a launched engine gets: sized from the checkpoint's config and validate's requests, per platform.

Hand-computed for the shipped tiny model and the real Qwen3.5-4B config: full-attention layers (+1 for the MTP
layer's own cache) hold 2 x kv_heads x head_dim bf16 values per token; each linear-attention layer holds a conv
state ((2 x key heads x key dim + value heads x value dim) x (kernel - 1) bf16) and an fp32 recurrent state
(value heads x key dim x value dim) per sequence. The real vLLM engine starting with these settings (and none from
the test) is ``tests/test_engine_validate.py::test_engine_measures_what_the_builtin_path_predicts``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.engine.sizing import KV_FLOOR, Machine, kv_bytes, plan_engine_memory
from mtpquant.families import resolve
from mtpquant.synth.train import TINY_MTP_ASSET

pytestmark = pytest.mark.dev

GiB = 2**30
CPU = Machine("cpu", 24 * GiB, 20 * GiB)
GPU = Machine("cuda", 140 * GiB, 100 * GiB)


def test_kv_bytes_from_the_config(real_layouts: Path) -> None:
    tiny = Checkpoint.open(TINY_MTP_ASSET).spec
    # 1 full-attention layer + the MTP layer: 2 x 2 x 1 x 256 x 2 B per token; 3 linear layers of
    # (2 x 128 + 256) x 3 x 2 + 2 x 128 x 128 x 4 B each
    assert kv_bytes(tiny, 512, 4) == 4 * (512 * 2048 + 3 * (3072 + 131072))
    big = resolve(json.loads((real_layouts / "Qwen3.5-4B_config.json").read_text()))
    # 8 full-attention layers + MTP: 9 x 2 x 4 x 256 x 2 = 36864 B per token; 24 linear layers of
    # (2 x 16 x 128 + 32 x 128) x 3 x 2 + 32 x 128 x 128 x 4 = 2146304 B
    assert kv_bytes(big, 512, 4) == 4 * (512 * 36864 + 24 * 2146304)


def test_vllm_on_the_cpu_gets_an_explicit_kv_cache(real_layouts: Path) -> None:
    tiny = Checkpoint.open(TINY_MTP_ASSET).spec
    plan = plan_engine_memory("vllm", tiny, 5_000_000, max_len=128, k=3, machine=CPU)
    assert plan.args() == ["--max-model-len", "512", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(KV_FLOOR)]
    big = resolve(json.loads((real_layouts / "Qwen3.5-4B_config.json").read_text()))
    plan = plan_engine_memory("vllm", big, 9_300_000_000, max_len=384, k=3, machine=CPU)
    # 768 tokens: 4 x (768 x 36864 + 24 x 2146304) = 319291392, doubled
    assert plan.args()[-1] == str(2 * 4 * (768 * 36864 + 24 * 2146304)) and plan.max_model_len == 768


def test_vllm_on_a_gpu_asks_for_what_is_free() -> None:
    tiny = Checkpoint.open(TINY_MTP_ASSET).spec
    plan = plan_engine_memory("vllm", tiny, 5_000_000, max_len=128, k=3, machine=GPU)
    args = plan.args()
    # vLLM refuses to start when utilization x total exceeds the free memory: 0.97 x 100 / 140
    assert args[args.index("--gpu-memory-utilization") + 1] == f"{0.97 * 100 / 140:.3f}"
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(KV_FLOOR)
    idle = plan_engine_memory("vllm", tiny, 5_000_000, max_len=128, k=3, machine=Machine("cuda", 140 * GiB, 139 * GiB))
    assert idle.fraction == 0.9  # vLLM's own default is the ceiling


def test_sglang_pool_in_tokens_and_static_fraction() -> None:
    tiny = Checkpoint.open(TINY_MTP_ASSET).spec
    plan = plan_engine_memory("sglang", tiny, 5_000_000, max_len=128, k=3, machine=CPU)
    fraction = (5_000_000 + KV_FLOOR + GiB) / (24 * GiB)
    assert plan.args() == [
        "--context-length", "512", "--max-running-requests", "4", "--max-total-tokens", "2048",
        "--mem-fraction-static", f"{fraction:.3f}",
    ]  # fmt: skip
    small = Machine("cpu", 24 * GiB, int(0.5 * GiB))  # little free: never more than that, never under 0.05
    assert plan_engine_memory("sglang", tiny, 5_000_000, max_len=128, k=3, machine=small).fraction == 0.05


def test_engine_args_take_over_memory() -> None:
    tiny = Checkpoint.open(TINY_MTP_ASSET).spec
    user = ["--gpu-memory-utilization=0.5"]
    plan = plan_engine_memory("vllm", tiny, 0, max_len=128, k=1, machine=CPU, user_args=user)
    assert plan.args() == ["--max-model-len", "512"]  # the user sizes memory; the context stays validate's
    env = plan_engine_memory("vllm", tiny, 0, max_len=128, k=1, machine=CPU, user_env=["VLLM_CPU_KVCACHE_SPACE"])
    assert env.args() == ["--max-model-len", "512"]
    both = plan_engine_memory("sglang", tiny, 0, max_len=128, k=1, machine=CPU, user_args=["--context-length", "4096"])
    assert both.args()[:2] == ["--max-running-requests", "4"]
    assert plan.describe() == "engine memory: as --engine-arg sets it; context 512 tokens"
