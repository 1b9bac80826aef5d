"""``mtpquant validate``'s options, as one frozen object (torch-free: the engine path needs no model code)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Annotated

from annotated_types import Ge, Interval

from mtpquant.engine.table import EngineName, launchable
from mtpquant.engine.table import engine as engine_row
from mtpquant.errors import OutputExistsError, ValidateError
from mtpquant.measure import HIDDEN_FORMAT, Activations
from mtpquant.records.record import FLAG, Options
from mtpquant.records.sampling import SamplingSettings, check_sampling, sampling_settings
from mtpquant.runtime.machine import ComputeDtype

__all__ = ["ValidateOptions", "check_hidden_destination"]
Positive = Annotated[int, Ge(1)]



def check_hidden_destination(path: Path) -> None:
    """``--save-hidden FILE`` replaces only a hidden-state file mtpquant wrote (or creates FILE); anything else there
    is refused before any work (exit 5), so an unrelated file is never overwritten."""
    import os

    from mtpquant.net import safejson

    if not os.path.lexists(path):
        return
    fmt = None
    if path.is_file() and not path.is_symlink():
        try:
            with path.open("rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if 0 < n <= 100_000_000:
                    header = safejson.loads(fh.read(n))
                    meta = header.get("__metadata__") if isinstance(header, dict) else None
                    fmt = meta.get("format") if isinstance(meta, dict) else None
        except (OSError, ValueError):
            fmt = None
    if fmt != HIDDEN_FORMAT:
        raise OutputExistsError(
            f"{path}: exists and is not an mtpquant hidden-state file; not replacing it (choose another --save-hidden)"
        )


@dataclass(frozen=True)
class ValidateOptions(Options):
    """Everything ``mtpquant validate`` does, as one frozen record (the CLI fills it; its defaults are these)."""

    reference: Path | str | None  # single mode: the checkpoint to evaluate (None: --server alone)
    candidate: Path | str | None = None
    prompts_file: Path | None = field(default=None, metadata={FLAG: "--prompts"})
    num_prompts: Positive = 32
    max_len: Annotated[int, Ge(4)] = 128  # tokens per sequence: prompt (at most half) + greedy continuation
    k: int = 3  # k = 1..k (``ks``: the listed values instead)
    batch_size: Positive = 16  # built-in path: prompts of one length generated together
    report_dir: Path | None = None
    device: str = "auto"  # cpu | cuda | cuda:N | auto (runtime.machine.resolve_device)
    dtype: ComputeDtype | None = None  # float32 on CPU, bfloat16 on CUDA unless given
    # emulate (the default): the inputs of every quantized Linear with an input scale quantized as the engines quantize
    # them (W4A4 NVFP4, static FP8); off: full-precision activations, an explicit opt-out every output labels
    activations: Activations = "emulate"
    save_hidden: Path | None = None
    hidden: Path | None = None
    warn_al_drop: Annotated[float, Ge(0)] = 0.1
    broken_al: float = field(default=1.02, metadata={FLAG: None})  # AL below this at k=1: the MTP is broken
    # pair: candidate main-model top-1 agreement below this means a broken candidate
    min_main_agreement: Annotated[float, Interval(ge=0, le=1)] = 0.5
    confidence: Annotated[float, Interval(ge=0.5, lt=1)] = 0.95  # two-sided level of the bootstrap intervals
    # ---- sampling: how the target samples and how drafts are verified (``mtpquant.records.sampling``) -----------
    temperatures: tuple[float, ...] = field(default=(0.0,), metadata={FLAG: "--temperature"})  # the first: headline
    top_p: tuple[float, ...] = (1.0,)  # one value for every temperature, or one per temperature
    top_k: tuple[int, ...] = (0,)  # the same
    rule: str = "vllm"  # vllm | probabilistic | strict
    seed: int = 0  # prompt i samples with seed + i (built-in generators and the engine's per-request seed)
    context_buckets: tuple[int, ...] = ()  # upper ends of context-length buckets the prompts are planned to fill
    progress: bool = field(default=True, metadata={FLAG: None})
    # ---- the engine path: a running server, or one mtpquant starts ------------------------------------------
    ks: tuple[int, ...] | None = field(default=None, metadata={FLAG: "--k"})  # explicit k values (--k 1,3)
    server: str | None = None  # URL of a running vLLM or SGLang server (the reference, or the one checkpoint)
    api_key_file: Path | None = None  # the servers' key (else MTPQUANT_ENGINE_API_KEY); never stored
    candidate_server: str | None = None
    served_model: str | None = None  # the model name to ask the server(s) for (default: the only one served)
    engine: EngineName | None = None  # start the engine for REFERENCE [and CANDIDATE]
    vllm_python: Path | None = None  # the python of the vLLM environment
    sglang_python: Path | None = None  # the python of the SGLang environment
    tensor_parallel_size: Positive = 1
    engine_args: tuple[str, ...] = field(default=(), metadata={FLAG: "--engine-arg"})
    compare_reference: bool = False  # also run the built-in prediction and put both side by side
    concurrency: Positive = 1  # requests in flight at once; counters are read between groups (each group one unit)
    startup_timeout: float = 900.0
    request_timeout: float = field(default=600.0, metadata={FLAG: None})
    env: dict[str, str] = field(default_factory=dict, metadata={FLAG: None})  # more environment for started servers

    @property
    def k_values(self) -> tuple[int, ...]:
        """The k values evaluated: --k N means 1..N, --k a,b,c those."""
        return self.ks if self.ks else tuple(range(1, self.k + 1))

    @property
    def sampling_settings(self) -> tuple[SamplingSettings, ...]:
        """One ``SamplingSettings`` per temperature, in the order given (``records.sampling.sampling_settings``)."""
        return sampling_settings(self.temperatures, self.top_p, self.top_k, self.seed)

    @property
    def prompt_chars(self) -> int:
        """Characters a default prompt needs to fill the context buckets (about 6 per token, generously)."""
        return 6 * (self.context_buckets[-2] if len(self.context_buckets) > 1 else 0)

    @property
    def engine_python(self) -> Path | None:
        """The python of the environment of ``engine``."""
        python: Path | None = getattr(self, f"{self.engine}_python", None) if self.engine is not None else None
        return python

    @property
    def engine_path(self) -> bool:
        """Whether acceptance is measured by a serving engine (a running server, or one started here)."""
        return self.server is not None or self.engine is not None

    def check(self) -> None:
        """Reject impossible settings with one-line errors."""
        if self.k < 1 or any(k < 1 for k in self.ks or ()):
            raise ValidateError(f"--k must be >= 1, got {','.join(map(str, self.ks or (self.k,)))}")
        self.check_fields(ValidateError)
        if self.hidden is not None and self.save_hidden is not None:
            raise ValidateError("--hidden and --save-hidden exclude each other")
        if self.save_hidden is not None:
            check_hidden_destination(Path(self.save_hidden))
        try:
            _, spec_rule = check_sampling(self.temperatures, self.top_p, self.top_k, self.seed, self.rule)
        except ValueError as exc:
            raise ValidateError(str(exc)) from None
        if self.engine is not None:
            refusal = engine_row(self.engine).adapter.rule_refusal(self.rule, spec_rule)
            if refusal is not None:
                raise ValidateError(refusal)
        if self.server is not None and self.engine is not None:
            raise ValidateError("--server and --engine exclude each other (measure a running server, or start one)")
        if self.candidate_server is not None and self.server is None:
            raise ValidateError("--candidate-server needs --server (the reference server)")
        if self.engine is not None:
            name = engine_row(self.engine).display
            if self.engine not in launchable():
                raise ValidateError(
                    f"--engine {self.engine}: mtpquant does not start {name} servers; measure a running one with "
                    "--server URL"
                )
            if self.engine_python is None:
                raise ValidateError(
                    f"--engine {self.engine} needs --{self.engine}-python PATH (the python of the {name} environment)"
                )
            if self.reference is None:
                raise ValidateError(f"--engine {self.engine} needs the CHECKPOINT to serve")
        if self.engine_path and (self.hidden is not None or self.save_hidden is not None):
            raise ValidateError("--hidden / --save-hidden belong to the built-in path, not to --server / --engine")
        if self.compare_reference and self.engine is None:
            raise ValidateError(f"--compare-reference needs --engine {'|'.join(launchable())} (and a local checkpoint)")
        if not self.engine_path and self.reference is None:
            raise ValidateError("give a CHECKPOINT (or --server URL)")
        buckets = self.context_buckets
        if buckets and (buckets[0] < 2 or any(b <= a for a, b in pairwise(buckets))):
            raise ValidateError(
                f"--context-buckets must ascend from at least 2, got {' '.join(map(str, buckets))}"
            )
