"""No command follows a symbolic link out of a checkpoint: convert never copies, graft never hard-links, inspect
never reads, publish never uploads a file whose real path lies outside the directory it was given. The HF cache's
own ``snapshots/COMMIT/file -> ../../blobs/SHA`` links are the legitimate case and keep working."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint.source import LocalSource
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import CheckpointError, ExitCode
from mtpquant.publish.files import plan_files
from mtpquant.publish.run import PublishRefusedError
from tests.support.cli import one_error

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


def _outside_link(ckpt: Path, name: str, outside: Path) -> None:
    """Replace ``ckpt/name`` by a link to a copy of it outside the checkpoint (what an archive can carry)."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ckpt / name, outside)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(outside)


def _refusal(root: Path, name: str) -> str:
    return (
        f"mtpquant: error: {root}: {name} is a symbolic link that leads outside the checkpoint; mtpquant never follows "
        "a link out of a checkpoint (copy the file into it)"
    )


def test_convert_never_copies_a_link_out_of_src(
    tiny_copy: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tiny_copy("qwen3_5")
    _outside_link(src, "tokenizer_config.json", tmp_path / "elsewhere" / "secret.json")
    out = tmp_path / "work" / "out"
    code, err = one_error(capsys, "convert", str(src), str(out), "--device", "cpu")
    assert code == ExitCode.CHECKPOINT
    assert err == _refusal(src, "tokenizer_config.json")
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


@pytest.mark.parametrize("side", ["quant", "src"])
def test_graft_never_links_a_file_out_of_its_inputs(
    side: str,
    naive_export_factory: Factory,
    tiny_copy: Factory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    quant = tmp_path / "quant"
    shutil.copytree(naive_export_factory("qwen3_5"), quant)
    src = tiny_copy("qwen3_5")
    victim = quant if side == "quant" else src
    shard = sorted(p.name for p in victim.glob("*.safetensors"))[0]
    _outside_link(victim, shard, tmp_path / "elsewhere" / shard)
    out = tmp_path / "out"
    code, err = one_error(capsys, "graft", str(quant), "--from", str(src), "--out", str(out))
    assert code == ExitCode.CHECKPOINT
    assert err == _refusal(victim, shard)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if "mtpquant" in p.name] == []


def test_a_path_through_a_linked_directory_is_refused(tiny_copy: Factory, tmp_path: Path) -> None:
    src = tiny_copy("qwen3_5")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.safetensors").write_bytes(b"\0" * 16)
    (src / "sub").symlink_to(tmp_path / "elsewhere")
    source = LocalSource(src)
    assert "sub/x.safetensors" not in source.list_files()  # a linked directory is not descended into
    with pytest.raises(CheckpointError) as exc:
        source.read_range("sub/x.safetensors", 0, 8)
    assert str(exc.value) == _refusal(src, "sub/x.safetensors").removeprefix("mtpquant: error: ")


def _hf_cache(tiny: Path, cache: Path, *, blobs_elsewhere: bool = False) -> Path:
    """``tiny`` laid out as huggingface_hub's cache does: ``snapshots/COMMIT/f -> ../../blobs/<sha256>``."""
    repo = cache / "models--org--tiny"
    blobs = repo / "blobs"
    if blobs_elsewhere:  # a cache-looking tree whose blobs/ is itself a link to somewhere else
        (cache / "real-blobs").mkdir(parents=True)
        repo.mkdir(parents=True)
        blobs.symlink_to(cache / "real-blobs")
    else:
        blobs.mkdir(parents=True)
    snap = repo / "snapshots" / ("ab" * 20)
    snap.mkdir(parents=True)
    for f in sorted(tiny.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / digest)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snap


def test_hf_cache_blob_links_are_the_legitimate_case(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    from mtpquant.graft.run import GraftOptions, graft

    quant = _hf_cache(naive_export_factory("qwen3_5"), tmp_path / "cache-q")
    src = _hf_cache(tiny_factory("qwen3_5"), tmp_path / "cache-s")
    assert Checkpoint.open(src).source.label == str(src)
    out = tmp_path / "out"
    graft(GraftOptions(quant=str(quant), source=str(src), out=out))
    blobs = quant.parent.parent / "blobs"
    for f in out.glob("*.safetensors"):
        assert not f.is_symlink()
    linked = [f for f in out.glob("*.safetensors") if any(f.samefile(b) for b in blobs.iterdir())]
    assert linked  # the quant's shards are hard links to the cache's own blobs


def test_a_cache_lookalike_whose_blobs_lead_elsewhere_is_refused(tiny_factory: Factory, tmp_path: Path) -> None:
    snap = _hf_cache(tiny_factory("qwen3_5"), tmp_path / "cache", blobs_elsewhere=True)
    with pytest.raises(CheckpointError, match="leads outside the checkpoint"):
        Checkpoint.open(snap)


def test_publish_rechecks_every_real_path(tiny_copy: Factory, tmp_path: Path) -> None:
    out = tiny_copy("qwen3_5")
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "notes.md").write_text("mine")
    (out / "extra").symlink_to(tmp_path / "private")  # a linked directory
    with pytest.raises(PublishRefusedError) as exc:
        plan_files(out)
    assert str(exc.value) == f"{out}/extra: symlink points outside OUT; refusing to upload it"
    (out / "extra").unlink()
    (out / "inside.json").symlink_to(out / "config.json")  # a link that stays inside is uploaded as its target
    assert "inside.json" in [f.path for f in plan_files(out)]
