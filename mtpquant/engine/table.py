"""The serving engines mtpquant knows, as one table: one row (``Engine``) per engine, read by everything that names
an engine (inspect's verdicts and serve lines, the card, the search, validate's launch, connect and sizing).

A row holds the engine's data (its name in messages, how its server is started, which of its arguments size its
memory, what its counters cover); what differs in behaviour lives in the engine's own module, its *adapter*
(``engine/vllm.py``, ``engine/sglang.py``, ``engine/trtllm.py``: the client and the loading rules of that engine),
reached through ``Engine.adapter`` and imported only when asked for. No module outside an engine's own branches on
its name (``tests/test_engine_table.py`` keeps it so): a new engine is one module, one row here, and its drafter
names in the family entries (``EngineRules.drafters``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, get_args

__all__ = [
    "ENGINES",
    "NAMES",
    "PROBE_ORDER",
    "Engine",
    "EngineName",
    "LaunchFlags",
    "display",
    "engine",
    "launchable",
    "searched",
]

# The table's keys as a type (options and settings records validate against it; ``tests/test_engine_table.py``
# checks it lists exactly the rows below, in their order).
EngineName = Literal["vllm", "sglang", "trtllm"]


@dataclass(frozen=True)
class LaunchFlags:
    """How an engine's server is told the common things (model, seed, tensor parallelism, the CPU backend)."""

    model: str
    seed: str
    tensor_parallel: str
    cpu: tuple[str, ...] = ()


@dataclass(frozen=True)
class Engine:
    """One serving engine: its data, and its adapter module (its client and its loading rules)."""

    key: str  # the name flags, reports and JSON use ("vllm")
    display: str  # its name in messages ("vLLM")
    version: str  # the release whose loader rules and HTTP answers mtpquant reproduces
    module: str  # its adapter, ``mtpquant.engine.<key>``
    launch_module: str | None  # ``python -m MODULE`` starts its server (None: mtpquant does not start it)
    flags: LaunchFlags | None  # how that server is told the model, the seed, ...
    memory_flags: tuple[str, ...]  # the arguments mtpquant's memory sizing sets (``engine/sizing.py``)
    memory_env: tuple[str, ...]  # environment variables that size its memory too
    counter_note: str  # what its speculative counters cover, for validate's report
    search: bool  # the precision search checks configurations against its loader rules (``--engine any``)
    card_heading: str  # the card's line above its serve command
    probe_rank: int = 1  # ``engine.connect`` asks the engines in this order (then the table's) which one serves a URL

    @property
    def adapter(self) -> ModuleType:
        """The engine's own module (imported on first use: inspect never loads a client it does not need)."""
        return importlib.import_module(self.module)


ENGINES: tuple[Engine, ...] = (
    Engine(
        key="vllm",
        display="vLLM",
        version="0.32",
        module="mtpquant.engine.vllm",
        # the server ``vllm serve`` runs for one API server (engine/launch.py says why not ``vllm serve`` itself)
        launch_module="vllm.entrypoints.launchers.api_server.entry",
        # vLLM's CPU backend for these hybrid models: bf16, prefix caching off for MTP, eager.
        flags=LaunchFlags(
            "--model",
            "--seed",
            "--tensor-parallel-size",
            ("--dtype", "bfloat16", "--no-enable-prefix-caching", "--enforce-eager"),
        ),
        memory_flags=("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--max-num-seqs"),
        memory_env=("VLLM_CPU_KVCACHE_SPACE",),
        counter_note="vLLM's speculative-decoding counters are server-wide: its numbers are the difference of two "
        "snapshots.",
        search=True,
        card_heading="vLLM, with the MTP as draft model:",
    ),
    Engine(
        key="sglang",
        display="SGLang",
        version="0.5.23",
        module="mtpquant.engine.sglang",
        launch_module="sglang.launch_server",
        # The settings of the real SGLang 0.5.23 CPU server recorded in ``tests/fixtures/sglang-cpu`` (device cpu,
        # bf16, radix cache off, no warm-up request).
        flags=LaunchFlags(
            "--model-path",
            "--random-seed",
            "--tp-size",
            ("--device", "cpu", "--dtype", "bfloat16", "--disable-radix-cache", "--skip-server-warmup"),
        ),
        memory_flags=("--mem-fraction-static", "--max-total-tokens", "--max-running-requests"),
        memory_env=(),
        counter_note="SGLang's speculative counters come with each request (meta_info: spec_verify_ct, "
        "spec_correct_drafts_histogram, ...): its numbers cover exactly these requests.",
        search=True,
        card_heading="SGLang (NEXTN speculative decoding):",
    ),
    Engine(
        key="trtllm",
        display="TensorRT-LLM",
        version="main (after PR #17051)",
        module="mtpquant.engine.trtllm",
        launch_module=None,  # trtllm-serve needs a GPU: validate measures a running one (--server)
        flags=None,
        memory_flags=("--kv_cache_free_gpu_memory_fraction", "--max_batch_size", "--max_num_tokens"),
        memory_env=(),
        counter_note="TensorRT-LLM's speculative-decoding counters (/prometheus/metrics) are server-wide and "
        "cumulative: its numbers are the difference of two snapshots around a dedicated run, and it counts no "
        "acceptance per draft position, so only AL is reported.",
        search=False,
        card_heading="TensorRT-LLM (MTP speculative decoding, its options written to mtp.yaml first):",
        probe_rank=0,  # its /version answers as vLLM's does: its own route (/prometheus/metrics) is asked first
    ),
)

NAMES: tuple[str, ...] = tuple(e.key for e in ENGINES)
_BY_KEY = {e.key: e for e in ENGINES}
PROBE_ORDER: tuple[Engine, ...] = tuple(sorted(ENGINES, key=lambda e: e.probe_rank))


def engine(key: str) -> Engine:
    """The row of ``key``; ValueError naming the known engines for any other name."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise ValueError(f"unknown engine {key!r} (known: {', '.join(NAMES)})") from None


def display(key: str) -> str:
    """``vLLM`` for ``vllm``; an unknown name as it is (a report an older or newer mtpquant wrote)."""
    row = _BY_KEY.get(key)
    return row.display if row is not None else key


def launchable() -> tuple[str, ...]:
    """The engines ``validate --engine`` can start."""
    return tuple(e.key for e in ENGINES if e.launch_module is not None)


def searched() -> tuple[str, ...]:
    """The engines whose loader rules the precision search applies (``--engine any``: all of them)."""
    return tuple(e.key for e in ENGINES if e.search)


assert get_args(EngineName) == NAMES, "EngineName must list the table's keys in its order"
