"""Output writer: temp sibling dir, byte-budget shards, atomic JSON, links, finalize."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mtpquant.checkpoint.dtypes import planned
from mtpquant.checkpoint.filesystem import atomic_write_json
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import PARTIAL_MARK, OutputDir, find_stale_partials, plan_shards
from mtpquant.errors import CheckpointError, FilesystemError, OutputExistsError

pytestmark = pytest.mark.dev


def _config(tiny_factory: Callable[[str], Path]) -> dict:
    return json.loads((tiny_factory("qwen3_5-tied") / "config.json").read_text())


def test_shards_under_byte_budget_and_finalize(tmp_path: Path, tiny_factory: Callable[[str], Path]) -> None:
    tensors = [
        planned(f"model.language_model.layers.{i}.mlp.up_proj.weight", torch.full((16, 16), float(i))) for i in range(5)
    ]
    assert [len(s) for s in plan_shards(tensors, 2 * 1024)] == [2, 2, 1]  # 1 KiB each in float32
    final = tmp_path / "out"
    od = OutputDir(final)
    names = od.write_shards(tensors, max_bytes=2 * 1024)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    od.write_index()
    od.write_json("config.json", _config(tiny_factory))
    assert not final.exists()  # nothing finished-looking before finalize
    assert od.path.name.startswith(f".out{PARTIAL_MARK}")
    od.finalize()
    assert final.is_dir() and not od.path.exists()
    ckpt = Checkpoint.open(final)
    assert len(ckpt.tensors) == 5
    assert torch.equal(ckpt.read_tensor("model.language_model.layers.3.mlp.up_proj.weight"), torch.full((16, 16), 3.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_exception_inside_context_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), OutputDir(final) as od:
        od.write_json("config.json", {})
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_refused_without_overwrite(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputExistsError, match=r"out: output already exists \(use --overwrite to replace it\)"):
        OutputDir(tmp_path / "out")


def test_overwrite_replaces_atomically(tmp_path: Path, tiny_factory: Callable[[str], Path]) -> None:
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    od = OutputDir(final, overwrite=True)
    od.link_file(tiny_factory("qwen3_5-tied") / "model.safetensors")
    od.link_file(tiny_factory("qwen3_5-tied") / "config.json")
    od.finalize()
    assert not (final / "old.txt").exists()
    assert (final / "model.safetensors").stat().st_ino == (
        tiny_factory("qwen3_5-tied") / "model.safetensors"
    ).stat().st_ino
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_finalize_refuses_broken_output(tmp_path: Path, tiny_factory: Callable[[str], Path]) -> None:
    od = OutputDir(tmp_path / "out")
    od.write_shards([planned("model.language_model.norm.weight", torch.ones(16))], max_bytes=1 << 20)
    od.write_json("config.json", _config(tiny_factory))
    od.write_json(
        "model.safetensors.index.json",
        {"metadata": {"total_size": 64}, "weight_map": {"x": "model-00001-of-00001.safetensors"}},
    )
    with pytest.raises(CheckpointError):
        od.finalize()
    assert not (tmp_path / "out").exists()
    od.abort()
    assert list(tmp_path.iterdir()) == []


def test_refuses_paths_outside_output(tmp_path: Path) -> None:
    od = OutputDir(tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"not a relative \.safetensors file name"):
        od.write_shard("../evil.safetensors", [])
    with pytest.raises(CheckpointError, match="refusing to write outside the output directory"):
        od.write_json("../evil.json", {})
    od.abort()
    assert not (tmp_path / "evil.json").exists()


def test_stale_partial_from_dead_process_is_cleaned(tmp_path: Path) -> None:
    stale = tmp_path / f".out{PARTIAL_MARK}deadbeef"
    stale.mkdir()
    (stale / ".mtpquant-owner").write_text("999999999")
    live = tmp_path / f".out{PARTIAL_MARK}alive"
    live.mkdir()
    (live / ".mtpquant-owner").write_text(str(os.getpid()))
    assert find_stale_partials(tmp_path / "out") == [stale]
    od = OutputDir(tmp_path / "out")
    assert not stale.exists() and live.exists()
    od.abort()


def test_atomic_json_keeps_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "config.json"
    atomic_write_json(target, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(target, {"a": object()})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


@pytest.mark.parametrize("fail_at", [1, 2, 3, 5, 8])
def test_disk_full_at_any_write_leaves_nothing(
    tmp_path: Path, tiny_factory: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    import errno

    from mtpquant.checkpoint import filesystem

    calls = {"n": 0}
    real = filesystem.write_data

    def flaky(fh: object, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device", str(getattr(fh, "name", "")))
        real(fh, data)

    monkeypatch.setattr(filesystem, "write_data", flaky)
    final = tmp_path / "out"
    tensors = [planned(f"model.language_model.layers.{i}.mlp.up_proj.weight", torch.ones(16, 16)) for i in range(4)]
    # one line naming the file being written and its filesystem (exit 19), whatever write it was
    with pytest.raises(FilesystemError, match=r"out/.*: No space left on device \(the filesystem mounted at "), \
            OutputDir(final) as od:
        od.write_shards(tensors, max_bytes=2048)
        od.write_json("config.json", _config(tiny_factory))
        od.write_index()
        od.finalize()
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temp dir left


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_tensors_copied_from_a_local_file_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_copy: bool
) -> None:
    import os

    from mtpquant.checkpoint.writer import PlannedTensor, write_safetensors

    blob = tmp_path / "blob.bin"
    payload = os.urandom(4096)
    blob.write_bytes(b"x" * 100 + payload + b"y" * 50)
    if not kernel_copy:  # filesystems without copy_file_range take the read/write fallback
        monkeypatch.delattr(os, "copy_file_range")
    tensors = [
        PlannedTensor("a", "U8", (4096,), lambda: b"", (blob, 100, 4196)),
        planned("b", torch.arange(4, dtype=torch.int64)),
        PlannedTensor("c", "U8", (50,), lambda: b"", (blob, 4196, 4246)),
    ]
    write_safetensors(tmp_path / "s.safetensors", tensors)
    from safetensors.torch import load_file

    got = load_file(tmp_path / "s.safetensors")
    assert bytes(got["a"].numpy().tobytes()) == payload
    assert torch.equal(got["b"], torch.arange(4, dtype=torch.int64))
    assert bytes(got["c"].numpy().tobytes()) == b"y" * 50
