"""Header table, index validation (one test per defect class) and lazy reads."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.source import LocalSource
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.dev

MOE_SHARDS = [f"model.safetensors-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def _index(path: Path) -> dict:
    return json.loads((path / INDEX_NAME).read_text())


def _write_index(path: Path, index: dict) -> None:
    (path / INDEX_NAME).write_text(json.dumps(index))


def _header_bytes(path: Path) -> int:
    return sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in path.glob("*.safetensors"))


def test_header_table_reads_no_tensor_data(tiny_factory: Callable[[str], Path]) -> None:
    path = tiny_factory("qwen3_5_moe")
    source = LocalSource(path)
    ckpt = Checkpoint.open(source)
    json_bytes = (path / "config.json").stat().st_size + (path / INDEX_NAME).stat().st_size
    assert source.bytes_read == _header_bytes(path) + json_bytes
    assert ckpt.shards == MOE_SHARDS
    assert len(ckpt.mtp_tensors()) == 17 + 3 * 4
    assert {e.shard for e in ckpt.mtp_tensors()} == {MOE_SHARDS[0], MOE_SHARDS[2]}


def test_header_table_with_unreadable_data_region(tiny_copy: Callable[[str], Path]) -> None:
    path = tiny_copy("qwen3_5-tied")
    shard = path / "model.safetensors"
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    shard.write_bytes(raw[: 8 + n] + b"\xff" * (len(raw) - 8 - n))  # data garbage, header intact
    ckpt = Checkpoint.open(path)
    assert len(ckpt.tensors) == 91
    assert ckpt.by_class()["mtp"][0].name == "mtp.fc.weight"


def test_lazy_tensor_read_matches_safetensors(tiny_factory: Callable[[str], Path]) -> None:
    from safetensors import safe_open

    path = tiny_factory("qwen3_5")
    ckpt = Checkpoint.open(path)
    entry = ckpt.tensors["mtp.fc.weight"]
    with safe_open(path / entry.shard, framework="pt") as fh:
        expected = fh.get_tensor("mtp.fc.weight")
    assert torch.equal(ckpt.read_tensor("mtp.fc.weight"), expected)
    assert expected.shape == (128, 256) and expected.dtype == torch.bfloat16
    shards_seen = [e.shard for e, _ in ckpt.iter_raw(n for n in ckpt.tensors if n.startswith("mtp."))]
    assert shards_seen == sorted(shards_seen)  # grouped by shard: one shard open at a time


def test_reuse_takes_headers_only_of_the_same_unchanged_file(tiny_copy: Callable[[str], Path], tmp_path: Path) -> None:
    path = tiny_copy("qwen3_5_moe")
    first = Checkpoint.open(path)
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in path.iterdir():
        if f.suffix == ".safetensors":
            os.link(f, linked / f.name)
        else:
            shutil.copyfile(f, linked / f.name)
    again = Checkpoint.open(linked, reuse=first)
    assert all(again.headers[s] is first.headers[s] for s in MOE_SHARDS)  # hard links: not re-parsed
    assert again.tensors == first.tensors and again.problems == first.problems
    # a copy (another inode) and a file modified since (another mtime) are parsed again
    (linked / MOE_SHARDS[0]).unlink()
    shutil.copyfile(path / MOE_SHARDS[0], linked / MOE_SHARDS[0])
    st = (linked / MOE_SHARDS[1]).stat()
    os.utime(linked / MOE_SHARDS[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    third = Checkpoint.open(linked, reuse=first)
    assert third.headers[MOE_SHARDS[0]] is not first.headers[MOE_SHARDS[0]]
    assert third.headers[MOE_SHARDS[1]] is not first.headers[MOE_SHARDS[1]]
    assert third.headers[MOE_SHARDS[2]] is first.headers[MOE_SHARDS[2]]
    assert third.headers[MOE_SHARDS[0]] == first.headers[MOE_SHARDS[0]]  # same content, parsed anew
    # a hostile rewrite of a linked shard in place is caught: its header is parsed, and refused
    raw = bytearray((linked / MOE_SHARDS[2]).read_bytes())
    raw[8] = ord("[")
    (linked / MOE_SHARDS[2]).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        Checkpoint.open(linked, reuse=first)


def test_missing_shard(tiny_copy: Callable[[str], Path]) -> None:
    path = tiny_copy("qwen3_5_moe")
    (path / MOE_SHARDS[1]).unlink()
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    assert str(err.value) == f"{INDEX_NAME}: shard '{MOE_SHARDS[1]}' does not exist"


def test_indexed_name_absent_from_shard(tiny_copy: Callable[[str], Path]) -> None:
    path = tiny_copy("qwen3_5_moe")
    index = _index(path)
    index["weight_map"]["mtp.ghost.weight"] = MOE_SHARDS[2]
    _write_index(path, index)
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    assert str(err.value) == (
        f"{INDEX_NAME}: tensor 'mtp.ghost.weight' is mapped to {MOE_SHARDS[2]} but {MOE_SHARDS[2]} does not contain it"
    )


def test_shard_tensor_not_indexed(tiny_copy: Callable[[str], Path]) -> None:
    path = tiny_copy("qwen3_5_moe")
    index = _index(path)
    del index["weight_map"]["mtp.fc.weight"]
    _write_index(path, index)
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    assert str(err.value) == f"{MOE_SHARDS[2]}: tensor 'mtp.fc.weight' is not listed in {INDEX_NAME}"


def test_name_in_two_shards(tiny_copy: Callable[[str], Path]) -> None:
    from safetensors.torch import load_file, save_file

    path = tiny_copy("qwen3_5_moe")
    first = path / MOE_SHARDS[0]
    tensors = load_file(first)
    tensors["mtp.fc.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    save_file(tensors, first)
    index = _index(path)
    index["metadata"]["total_size"] += 128 * 256 * 2
    _write_index(path, index)
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    assert (
        str(err.value)
        == f"{MOE_SHARDS[0]}: tensor 'mtp.fc.weight' also appears in {MOE_SHARDS[2]}, where the index maps it"
    )


@pytest.mark.parametrize(
    "bad",
    [
        "../model-00001.safetensors",
        "/etc/model.safetensors",
        "sub/../../x.safetensors",
        "model-00001.bin",
        "C:\\model.safetensors",
    ],
)
def test_unsafe_shard_names(tiny_copy: Callable[[str], Path], bad: str) -> None:
    path = tiny_copy("qwen3_5_moe")
    index = _index(path)
    index["weight_map"]["mtp.fc.weight"] = bad
    _write_index(path, index)
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    assert str(err.value) == f"{INDEX_NAME}: shard name {bad!r} is not a relative .safetensors file name"


@pytest.mark.parametrize("declared", [0, 12345, "3.1 MB", None])
def test_wrong_total_size_is_advisory(tiny_copy: Callable[[str], Path], declared: object) -> None:
    # No loader reads total_size (llm-compressor writes it from file sizes, AutoRound as 0): a warning, never a
    # refusal, even with strict=True.
    path = tiny_copy("qwen3_5_moe")
    index = _index(path)
    actual = index["metadata"]["total_size"]
    index["metadata"]["total_size"] = declared
    _write_index(path, index)
    ckpt = Checkpoint.open(path, strict=True)
    if declared is None:  # an index without total_size is fine
        assert ckpt.problems == []
        return
    (problem,) = ckpt.problems
    assert problem.code == "total_size" and not problem.fatal
    assert problem.message == (
        f"{INDEX_NAME}: metadata.total_size is {declared!r} but the tensors hold {actual} bytes "
        "(advisory: no loader reads it)"
    )


def test_stray_shard_is_advisory(tiny_copy: Callable[[str], Path]) -> None:
    path = tiny_copy("qwen3_5_moe")
    shutil.copyfile(path / MOE_SHARDS[0], path / "extra.safetensors")
    ckpt = Checkpoint.open(path, strict=True)
    (problem,) = ckpt.problems
    assert not problem.fatal
    assert problem.message == f"extra.safetensors: shard exists but {INDEX_NAME} does not reference it"


def test_non_strict_collects_all_problems(tiny_copy: Callable[[str], Path]) -> None:
    path = tiny_copy("qwen3_5_moe")
    index = _index(path)
    del index["weight_map"]["mtp.fc.weight"]
    index["weight_map"]["mtp.ghost.weight"] = MOE_SHARDS[0]
    _write_index(path, index)
    ckpt = Checkpoint.open(path, strict=False)
    assert sorted(p.code for p in ckpt.problems) == ["missing_tensor", "unindexed_tensor"]


def test_pickle_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(tmp_path)
    assert "pytorch_model.bin is a pickle checkpoint; mtpquant never loads pickles" in str(err.value)


def test_missing_config(tiny_copy: Callable[[str], Path]) -> None:
    path = tiny_copy("qwen3_5-tied")
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config.json is missing$"):
        Checkpoint.open(path)


def test_text_only_prefix_detected(tiny_factory: Callable[[str], Path]) -> None:
    ckpt = Checkpoint.open(tiny_factory("qwen3_5-text"))
    assert ckpt.main_prefix == "model."
    assert set(ckpt.by_class()) == {"main", "embed", "lm_head", "mtp"}


# ---- the bulk layout check ------------------------------------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _walk(entries: list[tuple[str, int, int]], data_len: int) -> str | None:
    """The reference: sorted by (start, end), each start at the previous end, the last end at the data's end."""
    cursor, previous = 0, None
    for name, start, end in sorted(entries, key=lambda e: (e[1], e[2])):
        if start < cursor:
            return f"tensors {previous!r} and {name!r} overlap"
        if start > cursor:
            return f"{start - cursor} bytes before tensor {name!r} are unused"
        cursor, previous = end, name
    if cursor != data_len:
        return "after the last tensor" if cursor < data_len else "truncated"
    return None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), max_size=6),
    st.integers(0, 3),
)
def test_bulk_layout_check_agrees_with_the_ordered_walk(spans: list[tuple[int, int]], slack: int) -> None:
    """parse_header accepts a header exactly when the ordered walk does, and refuses it with the walk's message."""
    from mtpquant.checkpoint.header import parse_header

    entries = [(f"t{i}", start, start + length) for i, (start, length) in enumerate(spans)]
    data_len = max((e for _, _, e in entries), default=0) + slack - (slack > 1) * 2
    data_len = max(data_len, 0)
    header = {n: {"dtype": "U8", "shape": [e - s], "data_offsets": [s, e]} for n, s, e in entries}
    raw = json.dumps(header).encode()
    expected = None if any(e > data_len for _, _, e in entries) else _walk(entries, data_len)
    if any(e > data_len for _, _, e in entries):
        with pytest.raises(CheckpointError, match="run past the end of the data"):
            parse_header("s.safetensors", raw, 8 + len(raw) + data_len)
    elif expected is None:
        parsed = parse_header("s.safetensors", raw, 8 + len(raw) + data_len)
        assert sorted(parsed.tensors) == sorted(header)
    else:
        with pytest.raises(CheckpointError) as err:
            parse_header("s.safetensors", raw, 8 + len(raw) + data_len)
        assert expected in str(err.value)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=8), st.randoms(use_true_random=False), st.booleans())
def test_bulk_layout_check_on_tilings(lengths: list[int], rnd, inside: bool) -> None:
    """Any contiguous tiling (empty tensors included, in any header order) is accepted; an empty tensor placed
    strictly inside another one is refused as an overlap, as the ordered walk refuses it."""
    from mtpquant.checkpoint.header import parse_header

    entries, cursor = [], 0
    for i, n in enumerate(lengths):
        entries.append((f"t{i}", cursor, cursor + n))
        cursor += n
    wide = [e for e in entries if e[2] - e[1] >= 2]
    if inside and wide:
        _, s, _ = wide[0]
        entries.append(("empty", s + 1, s + 1))
    rnd.shuffle(entries)
    header = {n: {"dtype": "U8", "shape": [e - s], "data_offsets": [s, e]} for n, s, e in entries}
    raw = json.dumps(header).encode()
    expected = _walk(entries, cursor)
    if expected is None:
        assert len(parse_header("s.safetensors", raw, 8 + len(raw) + cursor).tensors) == len(entries)
    else:
        assert inside and wide and "overlap" in expected
        with pytest.raises(CheckpointError, match="overlap"):
            parse_header("s.safetensors", raw, 8 + len(raw) + cursor)
