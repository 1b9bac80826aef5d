"""convert's memory plan from headers: ``--max-memory`` parsing, placement estimate, auto-cap, refusal.

The full-size layouts are sparse skeletons (no data on disk): the plan reads headers only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import mtpquant.convert.plan as plan_module
from mtpquant.cli import main
from mtpquant.convert.plan import ConvertOptions, _loaded_blocks, plan_convert
from mtpquant.errors import ExitCode, MemoryPlanError, UsageError
from mtpquant.render import plan_lines
from mtpquant.runtime.memory import MemoryCaps, parse_max_memory, plan_memory
from mtpquant.units import format_bytes
from tests.support.skeleton import find_layout, make_skeleton

pytestmark = pytest.mark.dev

GiB = 2**30


@pytest.fixture(scope="module")
def qwen35_4b(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Path]:
    real_layouts = request.getfixturevalue("real_layouts")
    yield make_skeleton(find_layout("Qwen3.5-4B", real_layouts), tmp_path_factory.mktemp("4b") / "src").path


@pytest.fixture(scope="module")
def qwen_next(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Path]:
    real_layouts = request.getfixturevalue("real_layouts")
    layout = find_layout("Qwen3-Next-80B-A3B-Instruct", real_layouts)
    yield make_skeleton(layout, tmp_path_factory.mktemp("next") / "src").path


@pytest.mark.parametrize(
    ("spec", "caps"),
    [
        ("cpu=8GiB", (("cpu", 8 * GiB),)),
        ("cuda:0=70GiB,cpu=200GiB", (("cuda:0", 70 * GiB), ("cpu", 200 * GiB))),
        ("0=1GB, cuda:1=500MB", (("cuda:0", 10**9), ("cuda:1", 5 * 10**8))),
        ("CUDA=2GiB", (("cuda:0", 2 * GiB),)),
    ],
)
def test_max_memory_specs(spec: str, caps: tuple[tuple[str, int], ...]) -> None:
    parsed = parse_max_memory(spec)
    assert parsed == MemoryCaps(caps)
    assert parsed.for_accelerate() == {("cpu" if d == "cpu" else int(d[5:])): n for d, n in caps}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cpu", "'cpu' is not DEVICE=SIZE"),
        ("gpu=1GB", "'gpu=1GB' is not DEVICE=SIZE"),
        ("cpu=lots", "'lots' is not a size"),
        ("cpu=0", "size must be positive, got '0'"),
        ("cpu=1GB,cpu=2GB", "cpu is given twice"),
        (",", "no DEVICE=SIZE given"),
    ],
)
def test_bad_max_memory_is_a_usage_error(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as err:
        parse_max_memory(spec)
    assert err.value.exit_code == ExitCode.USAGE
    assert str(err.value).startswith("--max-memory: ")


def test_a_gpu_cap_with_device_cpu_is_refused() -> None:
    with pytest.raises(UsageError, match="names a GPU, but the device is cpu"):
        plan_memory([], device="cpu", max_memory="cuda:0=1GiB", layerwise=False, shard_bytes=10**9)


def test_dry_run_shows_placement_and_peak_of_the_full_size_4b(qwen35_4b: Path, tmp_path: Path) -> None:
    plan, ckpt = plan_convert(
        ConvertOptions(src=str(qwen35_4b), out=tmp_path / "out", dry_run=True, device="cpu", max_memory="cpu=3GiB")
    )
    mem = plan.memory
    # every tensor but the MTP's (transformers skips it), in bfloat16 (the float32 A_log / norm too)
    assert mem.model_bytes == sum(2 * e.numel for n, e in ckpt.tensors.items() if not n.startswith("mtp."))
    # a linear-attention layer: in_proj_qkv, in_proj_z, out_proj, in_proj_a/b, conv1d, A_log, dt_bias, norm, MLP
    layer = 8192 * 2560 + 4096 * 2560 + 2560 * 4096 + 2 * 32 * 2560 + 8192 * 4 + 32 + 32 + 128 + 3 * 9216 * 2560
    assert mem.largest_block == 2 * (layer + 2 * 2560)  # and its two RMSNorms
    assert mem.capped_by == "flag" and mem.layerwise and mem.offloaded
    assert plan.max_shard_bytes == 3 * GiB // 4  # the streaming export buffers one shard: a quarter of the cap
    lines = plan_lines(plan)
    # the cap echoed as given (not cpu=3.22 GB)
    memory = "memory     main model 9.08 GB as loaded (largest decoder layer 225.85 MB); --max-memory cpu=3GiB"
    assert memory in lines
    # accelerate keeps room for one layer free on the CPU: the vision tower, the embedding and 4 layers fit in the rest
    assert "placement  cpu 2.83 GB, disk 6.25 GB (read from SRC's files as each layer runs)" in lines
    peak = next(line for line in lines if line.startswith("peak "))
    # resident + the runtime (1 GB) + the export's layer read from disk, its packed copy (half a layer) and one shard
    # buffer (more than the calibration's two layers): within the cap + 2 GB (5.22 GB), so the whole cap is placed into
    assert peak.startswith("peak       cpu ~4.98 GB") and peak.endswith("; layer-wise calibration (resumable)")
    assert mem.caps == parse_max_memory("cpu=3GiB")


def test_in_memory_plan_of_the_4b(qwen35_4b: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_module, "available_cpu_bytes", lambda: 64 * 10**9)
    plan, _ = plan_convert(ConvertOptions(src=str(qwen35_4b), out=tmp_path / "out", dry_run=True, device="cpu"))
    assert plan.memory.caps is None and not plan.memory.layerwise and plan.memory.capped_by == "none"
    assert plan.max_shard_bytes == 5 * 10**9
    assert "peak       cpu ~11.89 GB of 64.00 GB free; calibration in one pass" in plan_lines(plan)


def test_a_model_too_large_for_the_machine_caps_itself(
    qwen35_4b: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_module, "available_cpu_bytes", lambda: 8 * 10**9)
    plan, _ = plan_convert(ConvertOptions(src=str(qwen35_4b), out=tmp_path / "out", dry_run=True, device="cpu"))
    mem = plan.memory
    assert mem.capped_by == "auto" and mem.layerwise
    # 80 % of 8 GB, less the runtime (1 GB), two layers being worked on and one shard buffer (a quarter)
    assert mem.caps == MemoryCaps((("cpu", 6_400_000_000 - 1_000_000_000 - 2 * 225_847_680 - 1_600_000_000),))
    assert any("capped at cpu=3.35 GB, the rest offloaded to disk" in n for n in mem.notes)


def test_a_machine_that_cannot_hold_one_layer_is_refused_before_loading(
    qwen35_4b: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(plan_module, "available_cpu_bytes", lambda: 1_500_000_000)
    with pytest.raises(MemoryPlanError, match=r"needs about 1\.90 GB of memory .* only 1\.50 GB is available"):
        plan_convert(ConvertOptions(src=str(qwen35_4b), out=tmp_path / "out", dry_run=True, device="cpu"))
    assert main(["convert", str(qwen35_4b), str(tmp_path / "out"), "--device", "cpu"]) == ExitCode.MEMORY
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is available" in err[0]
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_per_expert_layouts_say_that_offloaded_experts_are_fused_from_src(qwen_next: Path, tmp_path: Path) -> None:
    plan, ckpt = plan_convert(
        ConvertOptions(src=str(qwen_next), out=tmp_path / "out", dry_run=True, device="cpu", max_memory="cpu=40GB")
    )
    blocks = _loaded_blocks(ckpt)
    assert [b.name for b in blocks] == ["embed", *(f"layer {i}" for i in range(48)), "norm/lm_head"]
    assert all(0 < b.converted < b.nbytes for b in blocks[1:-1])  # the routed experts, not attention or norms
    fused = 0
    budget = plan.memory.caps.get("cpu") if plan.memory.caps else None  # under the cap: the peak within cap + 2 GB
    assert budget is not None and budget < 40 * 10**9
    room = budget - max(b.nbytes for b in blocks if b.name.startswith("layer "))  # accelerate keeps one layer free
    for b in blocks:  # what the greedy placement leaves on disk
        if b.nbytes <= room:
            room -= b.nbytes
        else:
            room = -1
            fused += b.converted
    note = next(n for n in plan.memory.notes if "per-expert" in n)
    assert f"the ~{format_bytes(fused)} of them that go to disk are read from SRC's per-expert tensors" in note


@pytest.mark.parametrize(("cap", "refused"), [("cpu=900KB", True), ("cpu=1MB", False)])
def test_a_cap_that_leaves_the_first_weights_on_disk_is_refused_at_plan_time(
    tiny_factory: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], cap: str, refused: bool
) -> None:
    """modelopt's export runs the model from the device of its first weight; on disk (meta) it fails after the whole
    calibration ("Cannot copy out of meta tensor"). accelerate keeps one layer's room free (722.43 kB here) and
    then needs the vision tower's patch embedding (196.74 kB) resident: 900 kB is refused before anything runs
    (measured: it did fail at export), 1 MB converts."""
    src = tiny_factory("qwen3_5")
    capsys.readouterr()
    code = main(["convert", str(src), str(tmp_path / "out"), "--max-memory", cap, "--device", "cpu", "--dry-run"])
    err = capsys.readouterr().err.strip()
    if not refused:
        assert code == 0 and err == ""
        return
    assert code == ExitCode.MEMORY
    assert err == (
        "mtpquant: error: --max-memory cpu=900KB leaves the model's first weights (the vision tower's patch "
        "embedding, 196.74 kB) on disk, where modelopt's export cannot run the model from: they and the room "
        "accelerate keeps for one layer need 919.17 kB (raise the cap)"
    )
    code = main(["convert", str(src), str(tmp_path / "out"), "--max-memory", cap, "--device", "cpu"])
    assert code == ExitCode.MEMORY and list(tmp_path.iterdir()) == []  # refused before any work, nothing written


@pytest.fixture(scope="module")
def glm_air_two_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GLM-4.5-Air-dimension source of docs/BENCHMARKS.md's bounded-memory convert, headers only: an embedding
    and a head of 1.24 GB, a dense layer, a MoE layer of 4.68 GB (128 experts), the appended MTP layer."""
    from tests.support.nextn_skeleton import make_nextn_normal

    return make_nextn_normal("GLM-4.5-Air", tmp_path_factory.mktemp("air") / "src", layers=2, sparse=True)


def test_a_cap_the_estimate_passes_by_more_than_2_gb_is_refused_naming_the_smallest(
    glm_air_two_layers: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under cpu=8GiB (8.59 GB) even the embedding alone resident peaks at ~11.61 GB: the runtime (1 GB) and the
    calibration's MoE layer read from disk beside the MTP layer as large (2 x 4.68 GB) come on top. Refused before
    anything runs, naming the smallest cap whose estimate is within the cap + 2 GB; that cap plans."""
    out = tmp_path / "out"
    code = main(["convert", str(glm_air_two_layers), str(out), "--mtp", "quantize", "--device", "cpu",
                 "--max-memory", "cpu=8GiB", "--dry-run"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.MEMORY and not out.exists() and list(tmp_path.iterdir()) == []
    assert err == [
        "mtpquant: error: --max-memory cpu=8GiB: the estimated peak, ~11.61 GB, is over the cap + 2.00 GB even with "
        "only the first weights resident (the runtime, two decoder layers of 4.68 GB or one, its packed copy and an "
        "output shard come on top); the smallest cap that keeps it within is cpu=9.1GiB"
    ]
    with pytest.raises(MemoryPlanError, match=r"smallest cap that keeps it within is cpu=9\.1GiB$"):
        plan_convert(ConvertOptions(src=str(glm_air_two_layers), out=out, dry_run=True, device="cpu",
                                    max_memory="cpu=9GiB"))  # fmt: skip
    plan, _ = plan_convert(
        ConvertOptions(src=str(glm_air_two_layers), out=out, dry_run=True, device="cpu", max_memory="cpu=9.1GiB")
    )
    peak = dict(plan.memory.peak)["cpu"]
    assert peak == 11_708_755_225 <= int(9.1 * GiB) + 2 * 10**9


@pytest.mark.parametrize(("cap", "budget", "resident"), [
    ("cpu=9.1GiB", 6_411_608_319, 1_241_513_984),  # the embedding alone: the dense layer would pass cap + 2 GB
    ("cpu=10GiB", 10 * GiB, 1_728_622_592),  # the embedding and the dense layer: the whole cap
    ("cpu=11GiB", 11_094_594_047, 1_728_622_592),  # not the MoE layer: resident, the peak would be 14.21 GB
])  # fmt: skip
def test_a_larger_cap_places_less_when_more_resident_would_pass_the_cap_plus_2_gb(
    glm_air_two_layers: Path, tmp_path: Path, cap: str, budget: int, resident: int
) -> None:
    plan, _ = plan_convert(
        ConvertOptions(src=str(glm_air_two_layers), out=tmp_path / "o", dry_run=True, device="cpu", max_memory=cap)
    )
    mem = plan.memory
    assert mem.caps is not None and mem.caps.get("cpu") == budget and mem.caps.text() == cap  # shown as given
    assert dict(mem.resident)["cpu"] == resident
    assert dict(mem.peak)["cpu"] <= parse_max_memory(cap).caps[0][1] + 2 * 10**9
    lowered = [n for n in mem.notes if n.startswith("accelerate is given")]
    assert len(lowered) == (budget < parse_max_memory(cap).caps[0][1])
