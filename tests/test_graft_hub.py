"""graft with SRC and QUANT on a Hub: LocalHub serves them to the real huggingface_hub client."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode, MtpModeError
from mtpquant.graft.run import GraftOptions, graft
from tests.support.hubserver import LocalHub
from tests.test_graft import tensor_digests, tree_state

Factory = Callable[[str], Path]
pytestmark = pytest.mark.slow


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[LocalHub]:
    with LocalHub(tmp_path / "hub") as server, server.client_env(tmp_path / "hf_home"):
        yield server
    assert server.errors == []


def publish(hub: LocalHub, repo: str, path: Path, revision: str = "main") -> None:
    files = {p.name: p for p in path.iterdir() if p.is_file()}
    hub.create_repo(repo, files, revision=revision, exist_ok=True)


def served(hub: LocalHub, repo: str, filename: str | None = None) -> int:
    """Response body bytes the server sent for one repo (one file of it)."""
    return sum(r.body_bytes for r in hub.requests if r.repo_id == repo and (filename is None or r.filename == filename))


def test_hub_src_is_read_by_ranges_only_its_mtp(
    hub: LocalHub, naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    src = tiny_factory("qwen3_5_moe")  # 3 shards; the MTP sits in the first and the last
    publish(hub, "org/src", src)
    hub.reset_counters()
    out = tmp_path / "out"
    result = graft(GraftOptions(quant=naive_export_factory("qwen3_5_moe"), source="org/src", out=out))
    assert result.source is not None and result.source.startswith("org/src")
    fetched = served(hub, "org/src")
    assert result.mtp_bytes <= fetched <= 1.1 * result.mtp_bytes  # within 10 % of the MTP bytes
    assert result.src_bytes_fetched <= fetched < result.src_bytes_fetched + 16 * 1024  # + the repo listing
    assert result.src_shards_downloaded == []
    middle = "model.safetensors-00002-of-00003.safetensors"
    assert served(hub, "org/src", middle) < 64 * 1024  # its header, never its tensors
    # adjacent MTP tensors merged into one ranged read: one data read per run of MTP tensors with no other tensor
    # between them in a shard's data, not one per tensor (at scale, the 1,553 tensors of Qwen3-Next-80B-A3B's MTP: the
    # nightly test below)
    ckpt = Checkpoint.open(src)
    mtp = ckpt.mtp_tensors()
    spans = {shard: [(e.start, e.end) for e in mtp if e.shard == shard] for shard in {e.shard for e in mtp}}
    runs: dict[str, int] = {}
    for shard in spans:
        order = [ckpt.is_mtp(e.name) for e in sorted(ckpt.tensors.values(), key=lambda e: e.start) if e.shard == shard]
        runs[shard] = sum(1 for i, m in enumerate(order) if m and (i == 0 or not order[i - 1]))
    mtp_reads = dict.fromkeys(runs, 0)
    for r in hub.requests:
        if r.kind == "resolve" and r.range and r.filename in runs:
            first, last = (int(x) for x in r.range.split("=")[1].split("-"))
            mtp_reads[r.filename] += any(first < end and start <= last for start, end in spans[r.filename])
    assert mtp_reads == runs and len(mtp) > sum(runs.values()), (mtp_reads, runs)
    assert tensor_digests(out, mtp=True) == tensor_digests(src, mtp=True)
    assert inspect_checkpoint(out).healthy


def test_hub_quant_and_hub_src_with_revisions(
    hub: LocalHub,
    naive_export_factory: Factory,
    tiny_factory: Factory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    naive, src = naive_export_factory("qwen3_5"), tiny_factory("qwen3_5")
    publish(hub, "org/src", naive)  # main: an MTP-less upload ...
    publish(hub, "org/src", src, revision="bf16")  # ... the original on a branch
    publish(hub, "org/quant", naive, revision="v2")
    hub.create_repo("org/quant", {"README.md": "placeholder"}, exist_ok=True)
    with pytest.raises(MtpModeError, match="has no MTP"):
        graft(GraftOptions(quant="org/quant", revision="v2", source="org/src", out=tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    ref = tmp_path / "ref"
    graft(GraftOptions(quant=naive, source=src, out=ref))
    out = tmp_path / "out"
    result = graft(GraftOptions(quant="org/quant", revision="v2", source="org/src", source_revision="bf16", out=out))
    assert result.quant == "org/quant@v2" and result.source == "org/src@bf16"
    assert tree_state(out) == tree_state(ref)  # same result as from local copies
    assert (hub.repo_dir("org/quant", "v2") / ".gitattributes").is_file() and not (out / ".gitattributes").exists()
    assert result.mtp_bytes <= result.src_bytes_fetched <= 1.1 * result.mtp_bytes
    assert result.quant_bytes_fetched >= (naive / "model.safetensors").stat().st_size  # QUANT had to come down
    capsys.readouterr()
    rc = main(
        ["-q", "graft", "org/quant", "--revision", "v2", "--from", "org/src", "--from-revision", "bf16", "--in-place"]
    )
    err = capsys.readouterr().err.strip()
    assert rc == ExitCode.USAGE, (rc, err)
    assert "--in-place needs a local QUANT directory" in err and len(err.splitlines()) == 1, (rc, err)


def test_a_server_ignoring_range_for_tensor_data_makes_graft_download_only_the_mtp_shards(
    hub: LocalHub,
    naive_export_factory: Factory,
    tiny_factory: Factory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    src = tiny_factory("qwen3_5_moe")
    publish(hub, "org/src", src)
    # a mirror that honours Range for the shard headers but answers every read of tensor data with the whole
    # file: graft detects it (206 expected, 200 came) and downloads just the shards that hold the MTP
    hub.ignore_range_from = min(h.data_start for h in Checkpoint.open(src).headers.values())
    hub.reset_counters()
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        result = graft(GraftOptions(quant=naive_export_factory("qwen3_5_moe"), source="org/src", out=out))
    holding = sorted({e.shard for e in Checkpoint.open(src).mtp_tensors()})
    assert sorted(result.src_shards_downloaded) == holding and len(holding) == 2
    assert "ignores HTTP Range requests" in caplog.text and "downloading that shard" in caplog.text
    for shard in holding:
        assert served(hub, "org/src", shard) >= (src / shard).stat().st_size
    assert served(hub, "org/src", "model.safetensors-00002-of-00003.safetensors") < 64 * 1024
    assert tensor_digests(out, mtp=True) == tensor_digests(src, mtp=True)


@pytest.mark.nightly(
    reason="3.3 GB of MTP through the local Hub (a minute of I/O): the full lane checks the merged ranged reads on the "
    "tiny MoE's MTP (test_hub_src_is_read_by_ranges_only_its_mtp: one data read per run of adjacent MTP tensors)"
)
def test_graft_from_the_hub_reads_a_1553_tensor_mtp_in_a_few_requests(
    real_layouts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-Next-80B-A3B's MTP (1,553 tensors, 3.3 GB) from a Hub SRC: adjacent tensors are merged into one
    ranged read, so the requests are about one per MTP shard, not one per tensor."""
    from tests.support.skeleton import find_layout, make_skeleton

    layout = find_layout("Qwen3-Next-80B-A3B-Instruct", real_layouts)
    # hash_contents=False: stat-derived ids, so serving the 163 GB sparse skeleton never hashes it
    with LocalHub(tmp_path / "hub", hash_contents=False) as hub, hub.client_env(tmp_path / "hf_home"):
        # served in place, not copied; "stamped": every MTP tensor distinct, the source a few MB on disk (graft's
        # OUT still holds the 3.3 GB it downloads)
        src = make_skeleton(layout, hub.repo_dir("org/next"), mtp_data="stamped")
        quant = make_skeleton(layout, tmp_path / "quant", quant=True)
        mtp = Checkpoint.open(src.path).mtp_tensors()
        mtp_shards = {e.shard for e in mtp}
        assert len(mtp) == 1553
        hub.reset_counters()
        out = tmp_path / "out"
        assert main(["graft", str(quant.path), "--from", "org/next", "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        (shard,) = mtp_shards
        data_start = Checkpoint.open(src.path).headers[shard].data_start
        reads = [r for r in hub.requests if r.kind == "resolve" and r.filename == shard and r.range]
        data_reads = [r for r in reads if int(r.range.split("=")[1].split("-")[0]) >= data_start]
        # the MTP data in spans of at most 1 GiB (the memory a merged read may take): 4 reads for 3.3 GB
        assert len(data_reads) == math.ceil(sum(e.nbytes for e in mtp) / 2**30) == 4
        header_reads = 2 * len(src.shards)  # the length prefix and the JSON header of every shard
        # beyond the shard reads: the listing, config.json, the index, the commit (model_info)
        assert len(hub.requests) <= header_reads + len(mtp_shards) + 8, len(hub.requests)
        assert f"in {len(hub.requests)} requests" in printed, printed.splitlines()[:4]
        assert hub.errors == []
    # every MTP tensor's bytes compared directly, not through sha256 digests: 2 x 3.3 GB hashed took ~20 s here
    got, want = Checkpoint.open(out), Checkpoint.open(src.path)
    names = sorted(e.name for e in want.mtp_tensors())
    assert sorted(e.name for e in got.mtp_tensors()) == names
    for name in names:
        assert got.read_raw(got.tensors[name]) == want.read_raw(want.tensors[name]), name
