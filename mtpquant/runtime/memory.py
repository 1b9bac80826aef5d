"""Convert's memory plan, from headers only: what the main model weighs, where it will sit, whether it fits.

``--max-memory cpu=8GiB`` (or ``cuda:0=70GiB,cpu=200GiB``) caps what accelerate may place on each
device; what does not fit stays on disk and is read from SRC's own safetensors when its layer runs
(transformers' disk offload maps offloaded weights to the files they already lie in; per-expert MoE
tensors, which transformers fuses while loading, are fused from SRC's files whenever their layer runs:
``offload.py``). An offloaded model is calibrated layer by layer
(modelopt's ``layerwise`` mode) and exported by modelopt's streaming writer, so memory holds the
resident part plus about one layer and one shard.

On the CPU the estimated peak stays within the cap + 2 GB (``CAP_HEADROOM``): where the whole cap placed would pass
it (an MoE layer of 4.7 GB loaded from disk beside an appended MTP layer as large), accelerate is given less to place
and more stays on disk; a cap under which even the first weights alone would pass it is refused before anything runs
(exit ``MEMORY``), naming the smallest cap that does not.

Without ``--max-memory``, a CPU plan whose in-memory peak would not fit in the memory this process
can use (``MemAvailable``, and the cgroup limit in a container) caps itself at 80 % of it and
offloads the rest; a machine that cannot hold even one layer and the buffers is refused with the
needed and available sizes. The estimates are estimates: after loading, the log shows the device
map accelerate actually chose.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mtpquant.checkpoint.sharded import sharded_tables
from mtpquant.errors import MemoryPlanError, UsageError
from mtpquant.runtime.machine import available_cpu_bytes
from mtpquant.units import ByteSize, format_bytes

__all__ = [
    "CAP_HEADROOM",
    "IN_MEMORY_PEAK_FACTOR",
    "RUNTIME_BYTES",
    "MemoryCaps",
    "MemoryPlan",
    "available_cpu_bytes",
    "keep_freed_memory",
    "parse_max_memory",
    "plan_memory",
    "release_file_pages",
    "return_freed_memory",
    "smallest_cpu_cap",
]

# Peak resident memory of an in-memory convert, as a multiple of the main model's loaded bytes
# (docs/BENCHMARKS.md, the full-size Qwen3.5-4B: the model plus modelopt's packed export state dict).
IN_MEMORY_PEAK_FACTOR = 1.2
# torch + transformers + modelopt, imported and running, before any weight (measured: ~0.9 GB).
RUNTIME_BYTES = 1_000_000_000
# Under a CPU cap the streaming export buffers one shard: shards are capped at this share of it.
SHARD_SHARE_OF_CAP = 4
_AUTO_SHARE = 0.8  # of the available memory, when convert caps itself
# A --max-memory CPU cap bounds accelerate's placement; convert's estimated peak may pass it by this much, no more
# (the runtime and the working set come on top of the resident weights): a cap the plan's own estimate exceeds by
# more is refused before anything runs.
CAP_HEADROOM = 2_000_000_000
GIB = 1 << 30

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DEVICE = re.compile(r"^(cpu|cuda(?::\d+)?|\d+)$")


@dataclass(frozen=True)
class MemoryCaps:
    """Per-device caps, in bytes: ``(("cuda:0", n), ("cpu", m))`` in the order given."""

    caps: tuple[tuple[str, int], ...]
    given: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # the sizes as ``--max-memory`` wrote them

    def get(self, device: str) -> int | None:
        """The cap of one device (``cpu`` / ``cuda:N``), None if not capped."""
        return dict(self.caps).get(device)

    def gpu_caps(self) -> tuple[tuple[str, int], ...]:
        """The GPU entries."""
        return tuple((d, n) for d, n in self.caps if d.startswith("cuda"))

    def for_accelerate(self) -> dict[int | str, int]:
        """accelerate's ``max_memory``: GPU index -> bytes, ``"cpu"`` -> bytes."""
        out: dict[int | str, int] = {}
        for device, n in self.caps:
            out["cpu" if device == "cpu" else int(device.split(":")[1])] = n
        return out

    def text(self) -> str:
        """``cuda:0=70GiB, cpu=8GiB`` as the flag gave them, else ``cuda:0=70.00 GB, cpu=8.59 GB``."""
        given = dict(self.given)
        return ", ".join(f"{d}={given.get(d) or format_bytes(n)}" for d, n in self.caps)


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def _mallopt(settings: dict[int, int]) -> bool:
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return all(bool(libc.mallopt(param, value)) for param, value in settings.items())
    except (OSError, AttributeError):
        return False


def return_freed_memory() -> bool:
    """Make glibc give memory back to the system when large tensors are freed (``mallopt``; Linux only).

    glibc serves allocations below its mmap threshold from its heap, and raises that threshold up to
    32 MB as large blocks come and go; a layer-by-layer pass frees and allocates tens of MB per layer,
    and the heap keeps the freed blocks: measured on the full-size Qwen3.5-4B under a 3 GiB cap, the
    anonymous memory grew by ~130 MB per exported layer. With the threshold fixed at 1 MB every tensor
    of a layer is its own mapping, returned when freed. Returns whether the setting was applied.
    """
    return _mallopt({_M_MMAP_THRESHOLD: 1 << 20})


def keep_freed_memory() -> bool:
    """The other trade, for a process whose model stays resident and that allocates the same tensors again and
    again (heal's generation and training): glibc keeps freed memory for the next allocation instead of returning
    and faulting it in anew. Blocks below 64 MiB come from its heap, which keeps up to 256 MiB free at its top and
    grows 64 MiB at a time. (``return_freed_memory`` fixes the mmap threshold, which also stops glibc from raising
    its trim threshold: the heap is then trimmed whenever 128 kB lie free at its top.) Measured on heal of the
    trained tiny model (``--mtp quantize``, 2 threads): 18 M page faults, 51 s of system time and 146 CPU-s with
    ``return_freed_memory``; 0.2 M page faults, 9 s and 106 CPU-s with this; the same results bit for bit.
    Returns whether the settings were applied.
    """
    return _mallopt({_M_MMAP_THRESHOLD: 64 << 20, _M_TRIM_THRESHOLD: 256 << 20, _M_TOP_PAD: 64 << 20})


_MADV_PAGEOUT = 21  # Linux 5.4+


def release_file_pages(files: Iterable[str | os.PathLike[str]]) -> int:
    """Give back the pages of ``files`` this process has mapped (``madvise(MADV_PAGEOUT)``; Linux only); returns
    the bytes of the mappings advised.

    transformers maps each SRC shard whole while loading and its resident weights stay views into those mappings, so
    every page it read (the per-expert tensors of an offloaded MoE layer it fused, then handed to disk offload,
    included) stays in the process's RSS as long as the model lives: 6.5 GB measured on the GLM-4.5-Air-dimension
    checkpoint under ``--max-memory cpu=8GiB``. Paged out, the resident weights are read back from the files when
    they are next used, the rest never; the pages a write made private (none: convert only reads its weights) stay.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return 0
    wanted = {os.path.realpath(f) for f in files}
    try:
        with open("/proc/self/maps") as fh:
            maps = fh.read().splitlines()
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5] not in wanted:
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if libc.madvise(start, end - start, _MADV_PAGEOUT) == 0:
            advised += end - start
    return advised


def parse_max_memory(spec: str, where: str = "--max-memory") -> MemoryCaps:
    """``cpu=8GiB`` / ``cuda:0=70GiB,cpu=200GiB`` -> MemoryCaps, or a one-line UsageError."""
    caps: dict[str, int] = {}
    given: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        device, sep, size = part.partition("=")
        device = device.strip().lower()
        if not sep or not _DEVICE.match(device):
            raise UsageError(f"{where}: {part!r} is not DEVICE=SIZE (DEVICE: cpu, cuda:N; e.g. cpu=8GiB)")
        if device.isdigit():
            device = f"cuda:{device}"
        elif device == "cuda":
            device = "cuda:0"
        try:
            n = ByteSize.of(size.strip()).bytes
        except ValueError as exc:
            raise UsageError(f"{where}: {exc}") from None
        if device in caps:
            raise UsageError(f"{where}: {device} is given twice")
        caps[device], given[device] = n, size.strip()
    if not caps:
        raise UsageError(f"{where}: no DEVICE=SIZE given (e.g. cpu=8GiB)")
    return MemoryCaps(tuple(caps.items()), tuple(given.items()))


@dataclass(frozen=True)
class Block:
    """A unit accelerate places whole: one decoder layer, the embedding, the vision tower, the rest."""

    name: str
    nbytes: int
    converted: int = 0  # bytes transformers converts while loading (per-expert tensors it fuses)
    head: int = 0  # bytes of its first module, where accelerate may split it (the vision tower's patch embedding)


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")
TABLES = "n-gram tables"  # the block of row-sharded tables (model_blocks)


def model_blocks(entries: Iterable[tuple[str, int]], *, is_vision: Mapping[str, bool]) -> list[Block]:
    """Blocks of the main model in placement order (vision, embedding, layers, the rest, the row-sharded tables),
    from ``(tensor name, loaded bytes)`` pairs; MTP tensors must be left out by the caller.

    Row-sharded tables (Qwen4-Exp's PLE n-gram tables, ~95 GiB a layer at full size) are looked up, never computed
    with: transformers keeps them out of the device map (``_no_placement_params``), so they are a block of their own,
    placed last and not part of any layer's working set."""
    entries = list(entries)
    tables = {n for shards in sharded_tables(n for n, _ in entries).values() for n in shards}
    layers: dict[int, list[int]] = {}
    vision = embed = rest = table = patch = 0
    for name, nbytes in entries:
        m = _LAYER.search(name)
        if name in tables:
            table += nbytes
        elif is_vision.get(name):
            vision += nbytes
            patch += nbytes if ".patch_embed." in name else 0
        elif "embed_tokens" in name:
            embed += nbytes
        elif m:
            acc = layers.setdefault(int(m.group(1)), [0, 0])
            acc[0] += nbytes
            acc[1] += nbytes if _PER_EXPERT.search(name) else 0
        else:
            rest += nbytes
    blocks = [Block("vision", vision, head=patch or vision)] if vision else []
    blocks.append(Block("embed", embed))
    blocks += [Block(f"layer {i}", layers[i][0], layers[i][1]) for i in sorted(layers)]
    if rest:
        blocks.append(Block("norm/lm_head", rest))
    if table:
        blocks.append(Block(TABLES, table))
    return blocks


@dataclass(frozen=True)
class MemoryPlan:
    """Where the main model sits during convert, and the estimated peak per device."""

    model_bytes: int  # the main model as loaded (MTP excluded: transformers skips it)
    largest_block: int  # the largest decoder layer
    caps: MemoryCaps | None  # None: everything on the one device
    capped_by: str  # "flag" | "auto" | "none"
    resident: tuple[tuple[str, int], ...]  # device -> estimated bytes of weights resident there
    disk_bytes: int  # weights left in SRC's files, read when their layer runs
    peak: tuple[tuple[str, int], ...]  # device -> estimated peak
    available: tuple[tuple[str, int], ...] = ()  # device -> what this machine has free (when known)
    layerwise: bool = False
    shard_bytes: int = 0  # output shard budget (reduced under a CPU cap)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def offloaded(self) -> bool:
        """Whether part of the model is expected off the compute device (disk, or CPU under a GPU)."""
        return self.disk_bytes > 0 or (
            any(d.startswith("cuda") for d, _ in self.resident) and dict(self.resident).get("cpu", 0) > 0
        )

    def lines(self, work: str | None = None) -> list[str]:
        """The ``--dry-run`` lines; ``work`` replaces what the peak line says runs (convert: its calibration)."""
        parts = [f"{d} {format_bytes(n)}" for d, n in self.resident if n]
        if self.disk_bytes:
            parts.append(f"disk {format_bytes(self.disk_bytes)} (read from SRC's files as each layer runs)")
        where = ", ".join(parts)
        caps = {"flag": f"--max-memory {self.caps.text()}" if self.caps else "", "none": "no caps"}
        caps["auto"] = f"capped by convert at {self.caps.text()}" if self.caps else ""
        free = dict(self.available)
        peaks = ", ".join(f"{d} ~{format_bytes(n)}" + (f" of {format_bytes(free[d])} free" if d in free else "")
                          for d, n in self.peak)
        out = [
            f"memory     main model {format_bytes(self.model_bytes)} as loaded (largest decoder layer "
            f"{format_bytes(self.largest_block)}); {caps[self.capped_by]}",
            f"placement  {where}",
            "peak       "
            + peaks
            + (f"; {work}" if work else "; layer-wise calibration (resumable)" if self.layerwise
               else "; calibration in one pass"),
        ]
        out += [f"note       {n}" for n in self.notes]
        return out

    def to_json(self) -> dict[str, object]:
        """Plain data for ``--json``."""
        return {
            "model_bytes": self.model_bytes,
            "largest_block": self.largest_block,
            "caps": dict(self.caps.caps) if self.caps else None,
            "capped_by": self.capped_by,
            "resident": dict(self.resident),
            "disk_bytes": self.disk_bytes,
            "peak": dict(self.peak),
            "available": dict(self.available),
            "layerwise": self.layerwise,
            "shard_bytes": self.shard_bytes,
        }


def _place(blocks: list[Block], caps: MemoryCaps, reserve: int) -> tuple[dict[str, int], int, int, int]:
    """Greedy, in order, as accelerate's ``infer_auto_device_map`` does (an estimate of it): on its main devices
    (the first GPU and the CPU) it keeps room for the largest layer (``reserve``) free. Returns the bytes per device,
    on disk, of those on disk the ones transformers converts (fuses) while loading, and the largest block on disk
    that runs (read whole when it does; the n-gram tables are looked up row by row)."""
    room = dict(caps.caps)
    order = [d for d, _ in caps.caps if d.startswith("cuda")] + (["cpu"] if "cpu" in room else [])
    for main in {*order[:1], "cpu"} & set(room):
        room[main] -= reserve
    placed = dict.fromkeys(order, 0)
    disk = fused = loaded = 0
    at = 0
    for block in blocks:
        while at < len(order) and placed[order[at]] + block.nbytes > room[order[at]]:
            at += 1  # accelerate fills devices in order and never goes back
        if at == len(order):
            disk += block.nbytes
            fused += block.converted
            loaded = max(loaded, 0 if block.name == TABLES else min(block.nbytes, reserve))
        else:
            placed[order[at]] += block.nbytes
    return placed, disk, fused, loaded


def _first_weight_resident(blocks: list[Block], caps: MemoryCaps, capped_by: str, reserve: int) -> None:
    """modelopt's export runs the model on dummy inputs it puts on the device of the model's first weight (the vision
    tower's patch embedding, or the token embedding): on disk that is the meta device, and the export fails after the
    whole calibration. Refuse such a placement before anything runs. The first block is placed first, whole where
    it fits, else (the vision tower) split, its first module where that fits."""
    if not blocks:
        return
    first = blocks[0]
    order = [d for d, _ in caps.caps if d.startswith("cuda")] + (["cpu"] if caps.get("cpu") is not None else [])
    main = {*order[:1], "cpu"}
    rooms = [n - (reserve if d in main else 0) for d, n in caps.caps]
    head = min(first.head or first.nbytes, first.nbytes)
    if any(room >= head for room in rooms):
        return
    what = "the vision tower's patch embedding" if first.name == "vision" else "the embedding"
    where = f"--max-memory {caps.text()}" if capped_by == "flag" else f"the memory available (capped at {caps.text()})"
    raise MemoryPlanError(
        f"{where} leaves the model's first weights ({what}, {format_bytes(head)}) on disk, where modelopt's export "
        "cannot run the model from: they and the room accelerate keeps for one layer need "
        f"{format_bytes(head + reserve)} (raise the cap)"
    )


def plan_memory(
    blocks: list[Block],
    *,
    device: str,
    max_memory: str | None,
    layerwise: bool,
    shard_bytes: int,
    available: Mapping[str, int] | None = None,
) -> MemoryPlan:
    """The memory plan of a convert on ``device`` (cpu | cuda), from the model's blocks.

    ``caps`` of the plan are what accelerate gets as ``max_memory`` (None: no device map on CPU;
    accelerate's own defaults on CUDA). The placement is an estimate of accelerate's.
    """
    model = sum(b.nbytes for b in blocks)
    # the working set is one decoder layer (the embedding and the vision tower stay where they are placed)
    largest = max((b.nbytes for b in blocks if b.name.startswith("layer ")), default=0) or max(
        (b.nbytes for b in blocks), default=0
    )
    avail = {k: v for k, v in (available or {}).items() if v is not None}
    notes: list[str] = []
    caps = parse_max_memory(max_memory) if max_memory else None
    if caps is not None and device == "cpu" and caps.gpu_caps():
        raise UsageError(f"--max-memory {max_memory}: names a GPU, but the device is cpu")
    capped_by = "flag" if caps is not None else "none"
    in_memory_peak = int(model * IN_MEMORY_PEAK_FACTOR) + RUNTIME_BYTES
    if caps is None and device == "cpu" and "cpu" in avail and in_memory_peak > avail["cpu"]:
        caps = _auto_cpu_cap(avail["cpu"], largest, shard_bytes)
        capped_by = "auto"
        notes.append(
            f"the model needs ~{format_bytes(in_memory_peak)} in memory but {format_bytes(avail['cpu'])} is "
            f"available: capped at cpu={format_bytes(caps.caps[0][1])}, the rest offloaded to disk "
            "(set --max-memory to choose)"
        )
    if caps is None and device == "cpu":
        return MemoryPlan(
            model, largest, None, capped_by, (("cpu", model),), 0, (("cpu", in_memory_peak),),
            tuple(avail.items()), layerwise, shard_bytes, tuple(notes),
        )
    # a device map: the caps given (or chosen), else what accelerate would take by default
    estimate = caps
    if estimate is None:  # cuda, no flag: accelerate's defaults (most of each GPU, then the CPU)
        gpus = [(d, int(n * 0.9)) for d, n in avail.items() if d.startswith("cuda")] or [("cuda:0", model)]
        estimate = MemoryCaps((*gpus, ("cpu", int(avail.get("cpu", model) * _AUTO_SHARE))))
    elif device == "cuda" and estimate.get("cpu") is None and "cpu" in avail:
        estimate = MemoryCaps((*estimate.caps, ("cpu", int(avail["cpu"] * _AUTO_SHARE))))
    cpu_cap = caps.get("cpu") if caps is not None else None
    shard_budget = shard_bytes
    if cpu_cap is not None:
        shard_bytes = max(1, min(shard_bytes, cpu_cap // SHARD_SHARE_OF_CAP))
    _first_weight_resident(blocks, estimate, capped_by if caps is not None else "auto", largest)
    if caps is not None and cpu_cap is not None and capped_by == "flag" and device == "cpu":
        budget = _cpu_budget(blocks, cpu_cap, largest, shard_budget)
        if budget is None:
            least = _cpu_peak(blocks, _first_only(blocks, largest), cpu_cap, largest, shard_budget) or 0
            raise MemoryPlanError(_over_cap(blocks, caps, largest, shard_budget, least))
        if budget < cpu_cap:
            caps = estimate = MemoryCaps((("cpu", budget),), caps.given)
            notes.append(
                f"accelerate is given cpu={format_bytes(budget)} to place weights in, not the whole cap: with more "
                f"resident the estimated peak would pass the cap + {format_bytes(CAP_HEADROOM)}"
            )
    placed, disk, fused, loaded = _place(blocks, estimate, largest)
    if fused:
        notes.append(
            f"transformers fuses this checkpoint's per-expert tensors while loading: the ~{format_bytes(fused)} of "
            "them that go to disk are read from SRC's per-expert tensors and fused each time their layer runs "
            "(nothing re-saved)"
        )
    tables = sum(b.nbytes for b in blocks if b.name == TABLES)
    if tables and disk >= tables:  # placed last, so the first block to go to disk
        notes.append(
            f"the PLE n-gram tables (~{format_bytes(tables)}) stay on disk: read from SRC's row shards when their "
            "layer runs (nothing re-saved), as transformers keeps them off the device"
        )
    peak = {d: n + _working_set(largest, shard_bytes if d == "cpu" else 0, loaded) for d, n in placed.items()}
    peak.setdefault("cpu", _working_set(largest, shard_bytes, loaded))
    plan = MemoryPlan(
        model, largest, caps, capped_by, tuple(placed.items()), disk, tuple(peak.items()),
        tuple(avail.items()), layerwise, shard_bytes, tuple(notes),
    )
    return dataclasses.replace(plan, layerwise=layerwise or plan.offloaded)


def _working_set(largest: int, shard: int, loaded: int) -> int:
    """What a device holds beyond its resident weights (``shard``: the export's buffer, on the CPU only; with it the
    runtime), whichever phase holds more: the calibration's block read from disk (``loaded``: the largest on disk) and
    a layer as large as the largest (quantize mode's MTP layer, an appended one as large as a decoder layer, runs beside
    it), or the export's block read from disk, a packed copy (at most half a layer: FP8; NVFP4 packs to ~0.28) and one
    output shard."""
    calibration = loaded + largest
    export = loaded + largest // 2 + shard
    return max(calibration, export) + (RUNTIME_BYTES if shard else 0)


def _cpu_peak(blocks: list[Block], budget: int, cap: int, largest: int, shard_bytes: int) -> int | None:
    """The estimated CPU peak when accelerate places into ``budget`` under ``--max-memory cpu=cap`` (the output shard
    is a share of the cap); None: a budget that leaves the first weights on disk."""
    caps = MemoryCaps((("cpu", budget),))
    try:
        _first_weight_resident(blocks, caps, "flag", largest)
    except MemoryPlanError:
        return None
    placed, _, _, loaded = _place(blocks, caps, largest)
    return placed["cpu"] + _working_set(largest, max(1, min(shard_bytes, cap // SHARD_SHARE_OF_CAP)), loaded)


def _cpu_budget(blocks: list[Block], cap: int, largest: int, shard_bytes: int) -> int | None:
    """What accelerate may place on the CPU under ``--max-memory cpu=cap``: the cap itself when the estimated peak
    stays within the cap + ``CAP_HEADROOM``, else the largest budget under it that keeps the peak there (fewer weights
    resident); None when even the first weights alone do not (the cap is refused). The peak grows with the budget."""

    def fits(budget: int) -> bool:
        peak = _cpu_peak(blocks, budget, cap, largest, shard_bytes)
        return peak is not None and peak <= cap + CAP_HEADROOM

    if fits(cap):
        return cap
    lo, hi = _first_only(blocks, largest), cap  # the largest fitting budget in [lo, hi)
    if not fits(lo):
        return None
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _first_only(blocks: list[Block], largest: int) -> int:
    """The budget that keeps only the first weights resident (beside the room accelerate keeps for one layer)."""
    return largest + (min(blocks[0].head or blocks[0].nbytes, blocks[0].nbytes) if blocks else 0)


def smallest_cpu_cap(blocks: list[Block], shard_bytes: int) -> int:
    """The smallest ``--max-memory cpu=`` cap convert accepts (``_cpu_budget``; larger caps are all accepted)."""
    largest = max((b.nbytes for b in blocks if b.name.startswith("layer ")), default=0) or max(
        (b.nbytes for b in blocks), default=0
    )
    lo, hi = 1, sum(b.nbytes for b in blocks) + 4 * largest + 4 * shard_bytes + CAP_HEADROOM
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _cpu_budget(blocks, mid, largest, shard_bytes) is not None else (mid + 1, hi)
    return lo


def _over_cap(blocks: list[Block], caps: MemoryCaps, largest: int, shard_bytes: int, peak: int) -> str:
    """The one line refusing a CPU cap under which even the first weights alone, with the runtime and the working
    set, would pass the cap + ``CAP_HEADROOM``."""
    smallest = smallest_cpu_cap(blocks, shard_bytes)
    gib = -(-smallest * 10 // GIB) / 10  # rounded up to 0.1 GiB
    return (
        f"--max-memory {caps.text()}: the estimated peak, ~{format_bytes(peak)}, is over the cap + "
        f"{format_bytes(CAP_HEADROOM)} even with only the first weights resident (the runtime, two decoder layers "
        f"of {format_bytes(largest)} or one, its packed copy and an output shard come on top); the smallest cap that "
        f"keeps it within is cpu={gib:g}GiB"
    )


def _auto_cpu_cap(available: int, largest: int, shard_bytes: int) -> MemoryCaps:
    """A CPU cap that leaves room for the runtime, the working layer and one shard; or a MemoryPlanError."""
    budget = int(available * _AUTO_SHARE)
    shard = min(shard_bytes, budget // SHARD_SHARE_OF_CAP)
    cap = budget - RUNTIME_BYTES - 2 * largest - shard
    if cap < largest:
        need = RUNTIME_BYTES + 3 * largest + min(shard_bytes, largest)
        raise MemoryPlanError(
            f"convert needs about {format_bytes(need)} of memory (one layer of {format_bytes(largest)} resident, "
            f"one being calibrated, buffers), but only {format_bytes(available)} is available"
        )
    return MemoryCaps((("cpu", cap),))
