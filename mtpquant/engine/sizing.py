"""How much memory an engine mtpquant starts may take: sized from the checkpoint and what validate sends.

Left to their defaults the engines take most of the machine: vLLM reserves ``--gpu-memory-utilization`` 0.92 of
the memory (on the CPU backend of RAM: it refuses to start when that much is not free, even for a 5 MB model),
SGLang sizes its pool from ``--mem-fraction-static``. validate needs far less: one request at a time (a few
slots of slack), sequences of ``max_len`` tokens plus the k drafts. So a launched engine gets:

- a context of ``max(512, 2 * max_len)`` tokens and at most ``SEQS`` sequences at once;
- a KV cache for those sequences, from the checkpoint's config: the full-attention layers (the MTP layer's own
  included) at ``2 * kv_heads * head_dim`` bf16 values per token, and the linear-attention (Gated DeltaNet)
  layers' fixed state per sequence (the conv state, bf16, and the fp32 recurrent state); doubled for the engines'
  block rounding and the drafts' slots, and at least ``KV_FLOOR``;
- per platform: vLLM takes that KV size as ``--kv-cache-memory-bytes`` (on the CPU backend this replaces the
  utilization check; ``vllm/v1/worker/cpu_worker.py``), and on a GPU a ``--gpu-memory-utilization`` the free
  memory meets (``vllm/v1/worker/utils.py::request_memory`` refuses more than is free); SGLang takes
  ``--context-length``, ``--max-running-requests``, ``--max-total-tokens`` (the KV pool in tokens) and a
  ``--mem-fraction-static`` covering the weights and that pool (at least 0.05, the recorded CPU server's).

``--engine-arg`` comes last on the command line, so the engine's own parser lets it override any of these; when it
names one of the memory settings, mtpquant leaves all of its memory settings out (the user sizes memory).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from mtpquant.engine.table import engine as engine_row
from mtpquant.families import ModelSpec
from mtpquant.runtime.machine import available_cpu_bytes, gpu_memory, total_cpu_bytes
from mtpquant.units import format_bytes

__all__ = [
    "GPU_HEADROOM",
    "KV_FLOOR",
    "MIN_FRACTION",
    "OVERHEAD",
    "SEQS",
    "EngineMemory",
    "Machine",
    "kv_bytes",
    "plan_engine_memory",
    "probe_machine",
]

log = logging.getLogger(__name__)

SEQS = 4  # sequences at once: validate sends one request at a time; the rest is slack
KV_FLOOR = 512 * 2**20
_MARGIN = 2.0
GPU_HEADROOM = 0.97  # of the free memory, for the utilization vLLM checks at start
MIN_FRACTION = 0.05  # SGLang's mem_fraction_static of the recorded CPU server (tests/fixtures/sglang-cpu)
OVERHEAD = 2**30  # activations, workspaces, the engine's own buffers (per device)
LENGTH_FLAGS = ("--max-model-len", "--context-length")


@dataclass(frozen=True)
class Machine:
    """The memory of the device the engine runs on (None: unknown)."""

    device: str  # "cpu" | "cuda"
    total: int | None
    free: int | None


def probe_machine(cpu: bool) -> Machine:
    """The memory the engine can use: RAM (MemAvailable, bounded by the cgroup) on the CPU, else GPU 0's."""
    if cpu:
        return Machine("cpu", total_cpu_bytes(), available_cpu_bytes())
    total, free = gpu_memory()
    return Machine("cuda", total, free)


def _int(spec: ModelSpec, key: str, default: int) -> int:
    value = spec.text.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def kv_bytes(spec: ModelSpec, tokens: int, seqs: int) -> int:
    """KV cache and linear-attention state for ``seqs`` sequences of ``tokens`` tokens (before the margin)."""
    layers = _int(spec, "num_hidden_layers", 1)
    types = spec.text.get("layer_types")
    if isinstance(types, list) and types:
        full = sum(1 for t in types if t == "full_attention")
    else:
        full = layers // max(_int(spec, "full_attention_interval", 1), 1)
    linear = layers - full
    full += spec.mtp.layers  # the MTP layer attends over the whole prefix: its own KV cache
    heads = _int(spec, "num_attention_heads", 1)
    head_dim = _int(spec, "head_dim", spec.hidden_size // max(heads, 1))
    per_token = full * 2 * _int(spec, "num_key_value_heads", heads) * head_dim * 2
    k_heads, v_heads = _int(spec, "linear_num_key_heads", 0), _int(spec, "linear_num_value_heads", 0)
    k_dim, v_dim = _int(spec, "linear_key_head_dim", 0), _int(spec, "linear_value_head_dim", 0)
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * max(_int(spec, "linear_conv_kernel_dim", 4) - 1, 0) * 2
    recurrent = v_heads * k_dim * v_dim * 4
    return seqs * (tokens * per_token + linear * (conv + recurrent))


@dataclass(frozen=True)
class EngineMemory:
    """The memory settings of one launched engine, and where they came from."""

    engine: str
    machine: Machine
    max_model_len: int
    seqs: int
    kv: int  # bytes of KV cache and linear-attention state
    weights: int  # bytes of weights per device
    fraction: float | None  # vLLM on a GPU: --gpu-memory-utilization; SGLang: --mem-fraction-static
    user_sized: bool = False  # --engine-arg names a memory setting: mtpquant's are left out
    user_length: bool = False  # --engine-arg names the context length

    def args(self) -> list[str]:
        """The engine's arguments for these settings (its module's ``memory_args``)."""
        from mtpquant.engine.table import engine

        return list(engine(self.engine).adapter.memory_args(self))

    def describe(self) -> str:
        """One line for the log and the report's notes."""
        if self.user_sized:
            return f"engine memory: as --engine-arg sets it; context {self.max_model_len} tokens"
        free = f" of {format_bytes(self.machine.free)} free" if self.machine.free is not None else ""
        fraction = f", fraction {self.fraction:.3f}" if self.fraction is not None else ""
        return (
            f"engine memory ({self.machine.device}): KV cache {format_bytes(self.kv)} for {self.seqs} sequences of "
            f"{self.max_model_len} tokens, weights {format_bytes(self.weights)}{free}{fraction} "
            "(--engine-arg overrides)"
        )


def _names(args: Sequence[str], flags: Sequence[str]) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def plan_engine_memory(
    engine: str,
    spec: ModelSpec,
    weights: int,
    *,
    max_len: int,
    k: int,
    machine: Machine,
    tensor_parallel_size: int = 1,
    user_args: Sequence[str] = (),
    user_env: Sequence[str] = (),
    sequences: int = SEQS,
) -> EngineMemory:
    """The memory settings of ``engine`` serving ``spec`` (``weights`` bytes on disk) for validate's requests.

    ``user_env``: environment variables given to the engine (vLLM's ``VLLM_CPU_KVCACHE_SPACE`` sizes its KV cache).
    ``sequences``: requests validate keeps in flight at once (``--concurrency``; at least ``SEQS``).
    """
    max_model_len = max(512, 2 * max_len, max_len + k + 1)
    seqs = max(SEQS, sequences)
    tp = max(tensor_parallel_size, 1)
    kv = max(KV_FLOOR, math.ceil(_MARGIN * kv_bytes(spec, max_model_len, seqs) / tp))
    per_device = math.ceil(weights / tp)
    row = engine_row(engine)
    user_sized = _names(user_args, row.memory_flags) or any(name in user_env for name in row.memory_env)
    user_length = _names(user_args, LENGTH_FLAGS)
    fraction: float | None = row.adapter.memory_fraction(machine, per_device, kv)
    plan = EngineMemory(engine, machine, max_model_len, seqs, kv, per_device, fraction, user_sized, user_length)
    log.info("%s", plan.describe())
    return plan
