"""graft: real modelopt exports that lost their MTP, repaired from their BF16 sources.

Every quant here is a real ``export_hf_checkpoint`` output of a tiny model (``naive_export_factory``)
or a checkpoint derived from one; SRCs are the tiny real-layout checkpoints (``tiny_factory``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mtpquant import __version__
from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import PARTIAL_MARK, OutputDir, PlannedTensor
from mtpquant.cli import main
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode
from mtpquant.families import is_mtp_name
from mtpquant.formats.quant_config import HF_QUANT_CONFIG
from mtpquant.graft.run import GraftOptions, GraftResult, fix_metadata, graft
from mtpquant.recipes.recipe import RECIPE_FILE, MtpSection, Recipe
from mtpquant.records.provenance import PROVENANCE_FILE, read_provenance
from tests.support.kills import KILL_PRELUDE

pytestmark = pytest.mark.dev

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
Factory = Callable[[str], Path]


# ---------------------------------------------------------------------------------------------- helpers


def tensor_digests(path: Path, *, mtp: bool | None = None) -> dict[str, str]:
    """sha256 of every tensor's stored bytes (only MTP / only non-MTP when ``mtp`` is set)."""
    ckpt = Checkpoint.open(path)
    names = [n for n in ckpt.tensors if mtp is None or is_mtp_name(n) == mtp]
    return {e.name: hashlib.sha256(data).hexdigest() for e, data in ckpt.iter_raw(names)}


def tree_state(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) -> sha256 of its bytes (symlinks: their target).

    The provenance file is the one file whose bytes differ from run to run by design (time, the source's path
    or repo): it stands for the steps it records.
    """
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif name == PROVENANCE_FILE and p.is_file():
                out[rel] = "provenance: " + ", ".join(s.tool for s in read_provenance(p.parent).steps)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def inodes(root: Path) -> dict[str, int]:
    """Top-level file name -> inode."""
    return {p.name: p.stat().st_ino for p in root.iterdir() if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    """Temporary directories of mtpquant writers left in ``parent``."""
    return sorted(p.name for p in parent.iterdir() if "mtpquant" in p.name)


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def exclusions(root: Path) -> dict[str, list[str]]:
    """Exclusion list per metadata file."""
    out = {}
    if (root / HF_QUANT_CONFIG).exists():
        out[HF_QUANT_CONFIG] = load_json(root / HF_QUANT_CONFIG)["quantization"]["exclude_modules"]
    qc = load_json(root / "config.json").get("quantization_config")
    if qc is not None:
        out["config.json"] = qc.get("ignore") or []
    return out


def private_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _raw(ckpt: Checkpoint, e: TensorEntry) -> PlannedTensor:
    return PlannedTensor(e.name, e.dtype, e.shape, lambda: ckpt.read_raw(e))


def strip_mtp(src: Path, dst: Path, *, keep_declaration: bool = True) -> Path:
    """A copy of ``src`` without its MTP tensors, same shard names (what `convert --mtp extract` leaves)."""
    ckpt = Checkpoint.open(src)
    with OutputDir(dst) as od:
        for shard in ckpt.shards:
            entries = sorted(
                (e for e in ckpt.headers[shard].tensors.values() if not is_mtp_name(e.name)), key=lambda e: e.start
            )
            od.write_shard(shard, [_raw(ckpt, e) for e in entries], ckpt.headers[shard].metadata)
        od.write_index()
        config = json.loads(json.dumps(ckpt.config))
        if not keep_declaration:  # as some exporters leave it: the key removed, not set to 0
            del config["text_config"]["mtp_num_hidden_layers"]
        od.write_json("config.json", config)
        for f in ckpt.source.list_files():
            if not f.endswith(".safetensors") and f not in ("config.json", INDEX_NAME):
                od.link_file(src / f, f, link=False)
        return od.finalize()


def _f32(raw: bytes) -> float:
    return float(struct.unpack("<f", raw)[0])


def to_compressed_tensors(naive: Path, dst: Path) -> Path:
    """Rewrite a ModelOpt NVFP4 export into compressed-tensors' nvfp4-pack-quantized form.

    weight -> weight_packed (same nibbles), weight_scale kept, weight_scale_2 -> weight_global_scale
    and input_scale -> input_global_scale as reciprocals of shape [1]; config.json gets a
    compressed-tensors ``quantization_config`` (exact names and ``re:`` entries) and there is no
    hf_quant_config.json, as llm-compressor writes them.
    """
    ckpt = Checkpoint.open(naive)
    nvfp4 = {n[: -len(".weight_scale_2")] for n in ckpt.tensors if n.endswith(".weight_scale_2")}
    planned: list[PlannedTensor] = []
    for name in sorted(ckpt.tensors):
        e = ckpt.tensors[name]
        module, _, leaf = name.rpartition(".")
        if module in nvfp4 and leaf in ("weight_scale_2", "input_scale"):
            new = module + (".weight_global_scale" if leaf == "weight_scale_2" else ".input_global_scale")
            value = 1.0 / _f32(ckpt.read_raw(e))
            planned.append(PlannedTensor(new, "F32", (1,), lambda v=value: struct.pack("<f", v)))
        elif module in nvfp4 and leaf == "weight":
            planned.append(PlannedTensor(module + ".weight_packed", e.dtype, e.shape, _raw(ckpt, e).produce))
        else:
            planned.append(_raw(ckpt, e))
    config = dict(ckpt.config)
    ignore = [
        ("re:" + p[:-1].replace(".", r"\.") + r"\..*") if p.endswith("*") else p
        for p in config["quantization_config"]["ignore"]
    ]
    scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**scheme, "dynamic": False},
                "input_activations": {**scheme, "dynamic": "local"},
            }
        },
        "ignore": ignore,
    }
    with OutputDir(dst) as od:
        od.write_shard("model.safetensors", planned, {"format": "pt"})
        od.write_json("config.json", config)
        for f in ckpt.source.list_files():
            if f not in ("config.json", HF_QUANT_CONFIG, "model.safetensors"):
                od.link_file(naive / f, f, link=False)
        return od.finalize()


def set_exclusions(root: Path, patterns_from: Callable[[list[str]], list[str]]) -> None:
    """Rewrite the exclusion lists of both metadata files in place (test setup only)."""
    hfq = load_json(root / HF_QUANT_CONFIG)
    hfq["quantization"]["exclude_modules"] = patterns_from(hfq["quantization"]["exclude_modules"])
    (root / HF_QUANT_CONFIG).write_text(json.dumps(hfq, indent=4))
    cfg = load_json(root / "config.json")
    cfg["quantization_config"]["ignore"] = patterns_from(cfg["quantization_config"]["ignore"])
    (root / "config.json").write_text(json.dumps(cfg, indent=2))


def assert_mtp_repaired(out: Path, quant: Path, src: Path, result: GraftResult) -> None:
    """The acceptance list of the issue, for one grafted output."""
    report = inspect_checkpoint(out)
    assert report.healthy, report.failure_messages
    assert report.mtp_present_tensors == report.mtp_expected_tensors > 0
    assert tensor_digests(out, mtp=True) == tensor_digests(src, mtp=True)  # MTP bytes identical to SRC
    assert tensor_digests(out, mtp=False) == tensor_digests(quant, mtp=False)  # nothing else changed
    q, o = Checkpoint.open(quant), Checkpoint.open(out)
    old_map = {n: e.shard for n, e in q.tensors.items()}
    index = load_json(out / INDEX_NAME)
    assert {n: s for n, s in index["weight_map"].items() if n in old_map} == old_map  # entries unchanged
    assert {s for n, s in index["weight_map"].items() if n not in old_map} == set(result.new_shards)
    assert index["metadata"]["total_size"] == o.total_bytes
    for shard in q.shards:  # every pre-existing shard byte-identical
        assert (out / shard).read_bytes() == (quant / shard).read_bytes()
    assert o.spec.mtp.declared
    for patterns in exclusions(out).values():
        assert "mtp*" in patterns or r"re:^mtp\..*" in patterns


# ---------------------------------------------------------------------------------------------- happy paths


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_graft_out_repairs_real_modelopt_export(
    family: str, naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    quant, src = naive_export_factory(family), tiny_factory(family)
    before = inspect_checkpoint(quant)
    assert not before.healthy and before.mtp_present_tensors == 0  # the naive export lost its MTP
    out = tmp_path / "out"
    result = graft(GraftOptions(quant=quant, source=src, out=out))
    assert result.action == "grafted" and result.commit == "rename"
    assert_mtp_repaired(out, quant, src, result)
    # untouched files are hard links to QUANT's (the same inode), never copies
    q_inodes, o_inodes = inodes(quant), inodes(out)
    carried = [f for f in q_inodes if f not in ("config.json", HF_QUANT_CONFIG)]
    assert carried and all(o_inodes[f] == q_inodes[f] for f in carried)
    assert sorted(result.linked) == sorted(carried) and result.copied == []
    assert "model.safetensors" in result.linked
    # bytes written are the new files and nothing else (measured independently of the result)
    new_files = [p for p in out.iterdir() if p.stat().st_ino not in set(q_inodes.values())]
    assert result.bytes_written == sum(p.stat().st_size for p in new_files)
    mtp_shard_bytes = sum((out / s).stat().st_size for s in result.new_shards)
    assert result.mtp_bytes <= mtp_shard_bytes < result.mtp_bytes + 16 * 1024
    assert result.bytes_written - mtp_shard_bytes < 64 * 1024  # JSON metadata only
    assert result.mtp_bytes <= result.src_bytes_fetched <= 1.1 * result.mtp_bytes
    assert {c.split(":")[0] for c in result.metadata_changes} == {"config.json", HF_QUANT_CONFIG}
    assert "inspect" in result.verified_with and "mtp-bytes" in result.verified_with
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_in_place_equals_out_and_second_graft_is_noop(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    naive, src = naive_export_factory("qwen3_5"), tiny_factory("qwen3_5")
    quant = private_copy(naive, tmp_path / "work" / "quant")
    ref = tmp_path / "ref"
    graft(GraftOptions(quant=naive, source=src, out=ref))
    shard_inode = (quant / "model.safetensors").stat().st_ino
    result = graft(GraftOptions(quant=quant, source=src, in_place=True))
    assert result.action == "grafted" and result.commit == "exchange"
    assert tree_state(quant) == tree_state(ref)  # same files, same bytes as --out
    assert (quant / "model.safetensors").stat().st_ino == shard_inode  # the shard was not rewritten
    assert leftovers(quant.parent) == []
    # the same graft again: a no-op with a message, nothing touched
    state, stamps = tree_state(quant), {p.name: p.stat().st_mtime_ns for p in quant.iterdir()}
    again = graft(GraftOptions(quant=quant, source=src, in_place=True))
    assert again.action == "noop" and "nothing to do" in again.message and again.bytes_written == 0
    assert tree_state(quant) == state and {p.name: p.stat().st_mtime_ns for p in quant.iterdir()} == stamps
    # with --out the output asked for is made all the same: QUANT as it is, its shards linked, and it loads
    copy = tmp_path / "copy"
    out_again = graft(GraftOptions(quant=ref, source=src, out=copy))
    same = f"{ref} already has this MTP (15 tensors, byte-identical to SRC's)"
    assert out_again.message == f"{same}; nothing to change: wrote {copy}"
    assert out_again.metadata_changes == []
    assert tensor_digests(copy) == tensor_digests(ref) and inspect_checkpoint(copy).healthy
    assert (copy / "model.safetensors").stat().st_ino == (ref / "model.safetensors").stat().st_ino


def test_multi_shard_quant_and_declaration_restored_in_place_of_origin(tiny_factory: Factory, tmp_path: Path) -> None:
    """An extract-like checkpoint (MTP tensors and declaration stripped, 2 shards) grafted back."""
    src = tiny_factory("qwen3_5")
    stripped = strip_mtp(src, tmp_path / "stripped", keep_declaration=False)
    assert not Checkpoint.open(stripped).spec.mtp.declared
    assert len(Checkpoint.open(src).shards) == 2 and len({e.shard for e in Checkpoint.open(src).mtp_tensors()}) == 2
    out = tmp_path / "out"
    result = graft(GraftOptions(quant=stripped, source=src, out=out, max_shard_bytes=300_000))
    assert len(result.new_shards) > 1  # the byte budget splits the MTP
    assert result.new_shards == [
        f"mtp-{i:05d}-of-{len(result.new_shards):05d}.safetensors" for i in range(1, len(result.new_shards) + 1)
    ]
    assert tensor_digests(out) == tensor_digests(src)  # every tensor, MTP included
    # the declaration goes back where SRC has it: config.json is byte-identical to SRC's
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert result.metadata_changes == ["config.json: text_config.mtp_num_hidden_layers = 1 (was absent)"]
    old = load_json(stripped / INDEX_NAME)
    new = load_json(out / INDEX_NAME)
    assert {k: v for k, v in new["weight_map"].items() if k in old["weight_map"]} == old["weight_map"]
    assert new["metadata"]["total_size"] == old["metadata"]["total_size"] + result.mtp_bytes
    for shard in Checkpoint.open(stripped).shards:
        assert (out / shard).stat().st_ino == (stripped / shard).stat().st_ino
    assert inspect_checkpoint(out).healthy


def test_a_wrong_byte_in_the_copy_fails_verification_and_leaves_nothing(
    tiny_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MTP bytes in the written result are checksummed against those read from SRC (while copying): a write
    that goes wrong after the bytes were read (here one byte of one piece flipped) is caught before anything is
    put in place."""
    import mtpquant.checkpoint.filesystem as filesystem
    from mtpquant.errors import OutputVerificationError

    src = tiny_factory("qwen3_5")
    stripped = strip_mtp(src, tmp_path / "stripped", keep_declaration=False)
    real = filesystem.write_data
    spoiled: list[int] = []

    def faulty(fh: Any, data: bytes | memoryview) -> None:
        if not spoiled and isinstance(data, memoryview) and len(data) > 4096:  # a piece of one large MTP tensor
            spoiled.append(len(data))
            bad = bytearray(data)
            bad[len(bad) // 2] ^= 0xFF
            real(fh, bytes(bad))
            return
        real(fh, data)

    monkeypatch.setattr(filesystem, "write_data", faulty)
    out = tmp_path / "out"
    with pytest.raises(OutputVerificationError, match=r"^the result failed verification.*is not byte-identical to SRC"):
        graft(GraftOptions(quant=stripped, source=src, out=out))
    assert spoiled and not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("link", [True, False])
def test_graft_parses_quant_headers_once_and_reverifies_what_it_wrote(
    tiny_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, link: bool
) -> None:
    """QUANT's shard headers are parsed once; the verification re-parses every file graft wrote and
    reuses a header only for a hard link to the very QUANT shard it came from (a copy is re-parsed)."""
    import mtpquant.checkpoint.table as table

    src = tiny_factory("qwen3_5")
    stripped = strip_mtp(src, tmp_path / "stripped", keep_declaration=False)
    quant_shards = Checkpoint.open(stripped).shards
    parsed: list[tuple[str, str]] = []
    real = table.read_shard_header

    def spy(source: Any, shard: str) -> Any:
        parsed.append((source.label, shard))
        return real(source, shard)

    monkeypatch.setattr(table, "read_shard_header", spy)
    out = tmp_path / "out"
    result = graft(GraftOptions(quant=stripped, source=src, out=out, link=link))
    monkeypatch.undo()
    assert sorted(s for label, s in parsed if label == str(stripped)) == quant_shards  # once each
    built = [(label, s) for label, s in parsed if label not in (str(stripped), str(src))]
    assert built and all(PARTIAL_MARK in label for label, _ in built)  # the temp directory of OUT
    verified = [s for _, s in built]
    for shard in result.new_shards:  # written: re-read after writing and again by the verification
        assert verified.count(shard) == 2
    for shard in quant_shards:  # linked: reused (same inode); copied: parsed again
        assert verified.count(shard) == (0 if link else 1)
    assert (result.linked if link else result.copied) and inspect_checkpoint(out).healthy


@pytest.mark.slow
def test_compressed_tensors_quant_gets_re_pattern(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    quant = to_compressed_tensors(naive_export_factory("qwen3_5"), tmp_path / "ct")
    src = tiny_factory("qwen3_5")
    out = tmp_path / "out"
    result = graft(GraftOptions(quant=quant, source=src, out=out))
    ignore = load_json(out / "config.json")["quantization_config"]["ignore"]
    assert r"re:^mtp\..*" in ignore and "mtp*" not in ignore  # `mtp*` means nothing to compressed-tensors
    assert not (out / HF_QUANT_CONFIG).exists()
    assert result.metadata_changes == [r"config.json: ignore += re:^mtp\..*"]
    assert tensor_digests(out, mtp=True) == tensor_digests(src, mtp=True)
    report = inspect_checkpoint(out)
    assert report.healthy, report.failure_messages
    assert report.quantization.method == "compressed-tensors"


@pytest.mark.slow
def test_fix_metadata_repairs_layers0_only_exclusions(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    """nvidia/Qwen3.5-397B-A17B-NVFP4's defect: `mtp.layers.0*` excluded, `mtp.fc` not."""
    grafted = tmp_path / "grafted"
    graft(GraftOptions(quant=naive_export_factory("qwen3_5_moe"), source=tiny_factory("qwen3_5_moe"), out=grafted))
    set_exclusions(grafted, lambda pats: [p for p in pats if p != "mtp*"] + ["mtp.layers.0*"])
    assert any("mtp.fc" in w.message for w in inspect_checkpoint(grafted).warnings)
    tensor_files = {p.name: p.stat().st_ino for p in grafted.iterdir() if p.suffix == ".safetensors"}
    out = tmp_path / "fixed"
    result = fix_metadata(grafted, out=out)
    assert result.action == "metadata" and result.new_shards == []
    assert result.metadata_changes == [f"{HF_QUANT_CONFIG}: exclude_modules += mtp*", "config.json: ignore += mtp*"]
    for patterns in exclusions(out).values():
        assert patterns[-2:] == ["mtp.layers.0*", "mtp*"]
    assert {n: (out / n).stat().st_ino for n in tensor_files} == tensor_files  # no tensor file touched
    assert not [w for w in inspect_checkpoint(out).warnings if "mtp.fc" in w.message]
    # in place: JSON files replaced, every tensor file the same inode and bytes
    state = tree_state(grafted)
    in_place = fix_metadata(grafted, in_place=True)
    assert in_place.action == "metadata" and in_place.commit == "exchange"
    assert tree_state(grafted) == tree_state(out)
    assert {n: (grafted / n).stat().st_ino for n in tensor_files} == tensor_files
    assert {k: v for k, v in tree_state(grafted).items() if k.endswith(".safetensors")} == {
        k: v for k, v in state.items() if k.endswith(".safetensors")
    }
    assert fix_metadata(grafted, in_place=True).action == "noop"
    assert leftovers(tmp_path) == []


def test_fix_metadata_finds_a_quantization_config_under_text_config(peer_quant: Factory, tmp_path: Path) -> None:
    """config.json's quantization_config is read, listed and edited where vLLM reads it: in text_config when the top
    level has none (the exclusion walker and the editor used to look at the top level only: nothing to do)."""
    quant = private_copy(peer_quant("autoround-nvfp4-llmc-dense"), tmp_path / "q")
    config = load_json(quant / "config.json")
    config["text_config"]["quantization_config"] = config.pop("quantization_config")
    (quant / "config.json").write_text(json.dumps(config))
    assert not inspect_checkpoint(quant).healthy  # the ignore list misses the BF16 MTP, wherever it lives
    result = fix_metadata(quant, out=tmp_path / "fixed")
    assert result.action == "metadata" and result.metadata_changes[0] == r"config.json: ignore += re:^mtp\..*"
    fixed = load_json(tmp_path / "fixed" / "config.json")
    assert "quantization_config" not in fixed and fixed["text_config"]["quantization_config"]["ignore"][-1] == (
        r"re:^mtp\..*"
    )
    assert inspect_checkpoint(tmp_path / "fixed").verdicts["vllm"] == "vLLM: MTP loads (BF16)"


def test_fix_metadata_cli_out_and_json(
    tiny_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A BF16 checkpoint with quantization metadata missing mtp.fc (hand-made, fast) via the CLI."""
    src = private_copy(tiny_factory("qwen3_5-tied"), tmp_path / "q")
    cfg = load_json(src / "config.json")
    patterns = ["lm_head", "mtp.layers.0*"]
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": patterns}
    (src / "config.json").write_text(json.dumps(cfg))
    quantization = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": patterns}
    hfq = {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quantization}
    (src / HF_QUANT_CONFIG).write_text(json.dumps(hfq))
    capsys.readouterr()
    rc = main(["-q", "graft", str(src), "--fix-metadata", "--out", str(tmp_path / "o"), "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["action"] == "metadata" and data["bytes_written"] < 8192
    # BF16 tensors under NVFP4 metadata: QUANT's own defect, reported, neither fixed nor blamed on graft
    assert any("QUANT's own problem" in w and "declared quantized" in w for w in data["warnings"])
    assert (tmp_path / "o" / "model.safetensors").stat().st_ino == (src / "model.safetensors").stat().st_ino
    # the command line as given, less -q and --json (they change only what is printed); directories by base name
    latest = read_provenance(tmp_path / "o").latest
    assert latest is not None and latest.command == ("mtpquant", "graft", "q", "--fix-metadata", "--out", "o")


# ---------------------------------------------------------------------------------------------- replace


def _altered_mtp(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose MTP bytes differ (one byte flipped in every MTP tensor)."""
    private_copy(src, dst)
    ckpt = Checkpoint.open(dst)
    for e in ckpt.mtp_tensors():
        with (dst / e.shard).open("r+b") as fh:
            fh.seek(e.start)
            b = fh.read(1)
            fh.seek(e.start)
            fh.write(bytes([b[0] ^ 0x01]))
    return dst


@pytest.mark.slow
def test_replace_needs_flag_and_then_swaps_the_mtp(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tiny_factory("qwen3_next")
    src2 = _altered_mtp(src, tmp_path / "src2")
    grafted = tmp_path / "grafted"
    graft(GraftOptions(quant=naive_export_factory("qwen3_next"), source=src, out=grafted))
    state = tree_state(tmp_path)
    capsys.readouterr()
    rc = main(["-q", "graft", str(grafted), "--from", str(src2), "--in-place"])
    err = capsys.readouterr().err.strip()
    assert rc == ExitCode.GRAFT_REFUSED
    assert "already has an MTP" in err and "--replace" in err and len(err.splitlines()) == 1
    assert tree_state(tmp_path) == state
    out = tmp_path / "replaced"
    result = graft(GraftOptions(quant=grafted, source=src2, out=out, replace=True))
    assert result.action == "replaced" and result.dropped == ["mtp-00001-of-00001.safetensors"]
    assert result.new_shards == ["mtp-00001-of-00001.safetensors"] and result.rewritten == []
    assert tensor_digests(out, mtp=True) == tensor_digests(src2, mtp=True)
    assert inspect_checkpoint(out).healthy
    in_place = graft(GraftOptions(quant=grafted, source=src2, in_place=True, replace=True))
    assert in_place.commit == "exchange" and tree_state(grafted) == tree_state(out)


def test_replace_mtp_mixed_into_main_shards_rewrites_only_those(tiny_factory: Factory, tmp_path: Path) -> None:
    src = tiny_factory("qwen3_5")  # its MTP shares both shards with main tensors
    src2 = _altered_mtp(src, tmp_path / "src2")
    out = tmp_path / "out"
    result = graft(GraftOptions(quant=src, source=src2, out=out, replace=True))
    assert sorted(result.rewritten) == sorted(Checkpoint.open(src).shards) and result.linked
    assert tensor_digests(out, mtp=False) == tensor_digests(src, mtp=False)
    assert tensor_digests(out, mtp=True) == tensor_digests(src2, mtp=True)
    assert inspect_checkpoint(out).healthy


# ---------------------------------------------------------------------------------------------- O(MTP)


def test_bytes_written_do_not_grow_with_the_rest_of_the_model(tmp_path: Path) -> None:
    """Same MTP, main model 1x and ~8x larger: bytes written stay MTP bytes + metadata."""
    from mtpquant.synth.tiny import TinySpec, make_tiny_checkpoint

    written = {}
    for vocab in (512, 32768):
        spec = TinySpec("qwen3_5", text_only=True, tied=False, shards=2, vocab_size=vocab)
        src = make_tiny_checkpoint(tmp_path / f"src-{vocab}", spec, tokenizer=False)
        quant = strip_mtp(src, tmp_path / f"quant-{vocab}")
        r = graft(GraftOptions(quant=quant, source=src, out=tmp_path / f"out-{vocab}"))
        main_bytes = Checkpoint.open(quant).total_bytes
        n_tensors = len(Checkpoint.open(tmp_path / f"out-{vocab}").tensors)
        assert r.bytes_written <= r.mtp_bytes + 4096 + 160 * n_tensors  # MTP + its header + the index
        written[vocab] = (r.bytes_written, r.mtp_bytes, main_bytes)
    (small, mtp_s, main_s), (big, mtp_b, main_b) = written[512], written[32768]
    assert mtp_s == mtp_b and main_b > 7 * main_s
    assert abs(big - small) < 64  # only digits in config/index differ


# ---------------------------------------------------------------------------------------------- refusals


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()  # drop what earlier steps (fixture builds) printed
    rc = main(["-q", *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("mtpquant: error: "), err
    return rc, err[0]


@pytest.mark.slow
def test_refusals_are_one_line_and_write_nothing(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quant = private_copy(naive_export_factory("qwen3_5"), tmp_path / "quant")
    src = tiny_factory("qwen3_5")
    from mtpquant.synth.tiny import TinySpec, make_tiny_checkpoint

    other_dims = make_tiny_checkpoint(tmp_path / "other", TinySpec("qwen3_5", hidden_size=256), tokenizer=False)
    lying = private_copy(src, tmp_path / "lying")
    cfg = load_json(lying / "config.json")
    cfg["text_config"] |= {"hidden_size": 256, "num_attention_heads": 4}
    (lying / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "keep.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    hostile = private_copy(src, tmp_path / "hostile")
    index = load_json(hostile / INDEX_NAME)
    index["weight_map"]["mtp.fc.weight"] = "../escape.safetensors"
    (hostile / INDEX_NAME).write_text(json.dumps(index))
    missing_shard = private_copy(naive_export_factory("qwen3_5"), tmp_path / "missing")
    (missing_shard / INDEX_NAME).write_text(
        json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "model-00009-of-00009.safetensors"}})
    )
    bad_meta = private_copy(naive_export_factory("qwen3_5"), tmp_path / "badmeta")
    hfq = load_json(bad_meta / HF_QUANT_CONFIG)
    hfq["quantization"]["exclude_modules"] = ["lm_head", 5]
    (bad_meta / HF_QUANT_CONFIG).write_text(json.dumps(hfq))
    # no MTP and none declared: nothing for --fix-metadata to repair (with one declared, it un-declares it)
    undeclared = private_copy(naive_export_factory("qwen3_5"), tmp_path / "undeclared")
    cfg = load_json(undeclared / "config.json")
    cfg["text_config"]["mtp_num_hidden_layers"] = 0
    (undeclared / "config.json").write_text(json.dumps(cfg))
    out = str(tmp_path / "out")
    cases = [
        (["graft", str(bad_meta), "--from", str(src), "--in-place"], ExitCode.CHECKPOINT, "must be a list of strings"),
        (
            ["graft", str(quant), "--from", str(tiny_factory("qwen3_5_moe")), "--out", out],
            ExitCode.LINEAGE,
            "Qwen3.5 / Qwen3.6 MoE",
        ),
        (
            ["graft", str(quant), "--from", str(other_dims), "--out", out],
            ExitCode.LINEAGE,
            "lineage mismatch between QUANT and SRC: hidden_size 128 vs 256",
        ),
        # graft reads two checkpoints: an error about one of their files names the checkpoint first
        (["graft", str(quant), "--from", str(lying), "--out", out], ExitCode.CHECKPOINT, f"{lying}: config.json: "),
        (
            ["graft", str(quant), "--from", str(naive_export_factory("qwen3_5")), "--out", out],
            ExitCode.MTP_MODE,
            "has no MTP tensors",
        ),
        (
            ["graft", str(quant), "--from", str(src), "--out", str(tmp_path / "exists")],
            ExitCode.OUTPUT_EXISTS,
            "already exists",
        ),
        (
            ["graft", str(tmp_path / "empty"), "--from", str(src), "--out", out],
            ExitCode.CHECKPOINT,
            "config.json is missing",
        ),
        (["graft", str(tmp_path / "nowhere"), "--from", str(src), "--out", out], ExitCode.CHECKPOINT, "no such dir"),
        (["graft", str(hostile), "--from", str(src), "--out", out], ExitCode.CHECKPOINT, "not a relative .safetensors"),
        (
            ["graft", str(quant), "--from", str(hostile), "--in-place"],
            ExitCode.CHECKPOINT,
            f"{hostile}: model.safetensors.index.json: shard name '../escape.safetensors' is not a relative",
        ),
        (["graft", str(missing_shard), "--from", str(src), "--in-place"], ExitCode.CHECKPOINT, "does not exist"),
        (["graft", str(undeclared), "--fix-metadata", "--in-place"], ExitCode.GRAFT_REFUSED, "and declares none"),
        (["graft", str(quant), "--from", str(src), "--fix-metadata", "--in-place"], ExitCode.USAGE, "takes no --from"),
    ]
    state = tree_state(tmp_path)
    for argv, code, text in cases:
        rc, line = _cli_error(capsys, argv)
        assert rc == code and text in line, (argv, rc, line)
        assert tree_state(tmp_path) == state, argv  # nothing written, nothing left behind
    assert leftovers(tmp_path) == []


def test_mtp_shards_deleted_are_put_back_and_a_lost_model_shard_is_refused(
    tiny_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The index still names MTP shards that were deleted (what a user did to a convert output): graft --from SRC
    puts the MTP back, in place too, as it was; a part of an MTP left is replaced only with --replace; --fix-metadata
    and a lost shard of the model itself are refused in one line, nothing written."""
    src = tiny_factory("qwen3_5")
    whole = tmp_path / "whole"
    graft(GraftOptions(quant=strip_mtp(src, tmp_path / "stripped"), source=src, out=whole, max_shard_bytes=300_000))
    mtp_shards = sorted({e.shard for e in Checkpoint.open(whole).mtp_tensors()})
    model_shards = sorted(set(Checkpoint.open(whole).shards) - set(mtp_shards))
    assert len(mtp_shards) == 4 and all(s.startswith("mtp-") for s in mtp_shards)
    lost = private_copy(whole, tmp_path / "lost")
    for shard in mtp_shards:
        (lost / shard).unlink()
    part = private_copy(whole, tmp_path / "part")
    (part / mtp_shards[0]).unlink()
    lost_n = sum(1 for s in load_json(whole / INDEX_NAME)["weight_map"].values() if s == mtp_shards[0])
    no_model = private_copy(whole, tmp_path / "no-model")
    (no_model / model_shards[0]).unlink()
    first = sorted(n for n, s in load_json(whole / INDEX_NAME)["weight_map"].items() if s == model_shards[0])
    state = tree_state(tmp_path)
    for argv, code, text in [
        (
            ["graft", str(lost), "--fix-metadata", "--in-place"],
            ExitCode.GRAFT_REFUSED,
            f"{lost}: {INDEX_NAME}: shard '{mtp_shards[0]}' does not exist (it held {lost_n} MTP tensors); "
            "--fix-metadata repairs metadata only: put the MTP back with --from SRC",
        ),
        (
            ["graft", str(part), "--from", str(src), "--in-place"],
            ExitCode.GRAFT_REFUSED,
            f"{part}: already has part of an MTP ({15 - lost_n} MTP tensors; {lost_n} more were in shards that do "
            "not exist); pass --replace to replace it",
        ),
        (
            ["graft", str(no_model), "--from", str(src), "--out", str(tmp_path / "out")],
            ExitCode.CHECKPOINT,
            f"{no_model}: {INDEX_NAME}: shard '{model_shards[0]}' does not exist and held {len(first)} tensors that "
            f"are not MTP (first: {first[0]}); graft puts back only an MTP: restore that shard from where QUANT came",
        ),
    ]:
        rc, line = _cli_error(capsys, argv)
        assert (rc, line) == (code, f"mtpquant: error: {text}"), argv
        assert tree_state(tmp_path) == state, argv
    assert inspect_checkpoint(no_model).fixes == []  # and inspect offers no command for it

    result = graft(GraftOptions(quant=lost, source=src, in_place=True, max_shard_bytes=300_000))
    assert result.action == "grafted" and result.new_shards == mtp_shards
    assert result.metadata_changes == [
        f"{INDEX_NAME}: the {n} entries of '{shard}' (a shard that does not exist) dropped; SRC's MTP takes their place"
        for shard, n in [(s, sum(1 for v in load_json(whole / INDEX_NAME)["weight_map"].values() if v == s))
                         for s in mtp_shards]
    ]  # fmt: skip
    replaced = graft(GraftOptions(quant=part, source=src, out=tmp_path / "out", replace=True, max_shard_bytes=300_000))
    assert replaced.action == "replaced"
    for repaired in (lost, tmp_path / "out"):
        assert load_json(repaired / INDEX_NAME) == load_json(whole / INDEX_NAME)
        assert tensor_digests(repaired) == tensor_digests(whole)
        assert (repaired / "config.json").read_bytes() == (whole / "config.json").read_bytes()
        assert inspect_checkpoint(repaired).exit_code(strict=True) == 0


def test_out_inside_quant_is_refused(tiny_factory: Factory, tmp_path: Path) -> None:
    """--out inside QUANT is refused before anything is written."""
    quant = strip_mtp(tiny_factory("qwen3_5"), tmp_path / "q")
    state = tree_state(tmp_path)
    with pytest.raises(Exception, match="must not be inside QUANT"):
        graft(GraftOptions(quant=quant, source=tiny_factory("qwen3_5"), out=quant / "sub"))
    assert tree_state(tmp_path) == state


# ---------------------------------------------------------------------------------------------- kills

_DRIVER = KILL_PRELUDE + textwrap.dedent(
    """
    import mtpquant.checkpoint.table as table
    import mtpquant.surgery.inplace as inplace
    from mtpquant.graft.run import GraftOptions, graft

    for name in ("fsync", "link", "replace", "rename", "unlink", "mkdir", "rmdir", "symlink"):
        wrap(os, name)
    wrap(table.Checkpoint, "read_raw")  # between tensor writes: a kill mid-shard
    wrap(inplace, "exchange_dirs", after=True)
    if args["no_exchange"]:
        inplace.exchange_supported = lambda scratch: False
    options = GraftOptions(**args["options"])
    graft(options)
    print(json.dumps(tags))
    """
)


def _run_driver(
    tmp: Path, options: dict[str, Any], kill_at: int, no_exchange: bool
) -> subprocess.CompletedProcess[str]:
    script = tmp / "driver.py"
    if not script.exists():
        script.write_text(_DRIVER)
    arg = json.dumps({"options": options, "kill_at": kill_at, "no_exchange": no_exchange})
    return subprocess.run(
        [sys.executable, str(script), arg],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )


def _loadable(root: Path) -> None:
    ckpt = Checkpoint.open(root, strict=True)
    for shard in ckpt.shards:
        assert (root / shard).is_file()


KILL_CASES = {
    # name: (no_exchange, fix_metadata, samples)
    "graft-exchange": (False, False, 7),
    "graft-files": (True, False, 7),
    "fix-metadata-exchange": (False, True, 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(KILL_CASES))
def test_kill_during_in_place_leaves_quant_loadable_and_as_it_was(
    case: str, naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    no_exchange, fix, samples = KILL_CASES[case]
    src = tiny_factory("qwen3_5")
    if fix:
        base = tmp_path / "base"
        graft(GraftOptions(quant=naive_export_factory("qwen3_5"), source=src, out=base))
        set_exclusions(base, lambda pats: [p for p in pats if p != "mtp*"] + ["mtp.layers.0*"])
    else:
        base = naive_export_factory("qwen3_5")

    def options(quant: Path) -> dict[str, Any]:
        if fix:
            return {"quant": str(quant), "in_place": True, "fix_metadata": True}
        return {"quant": str(quant), "source": str(src), "in_place": True}

    # reference run (also counts the write steps)
    ref = private_copy(base, tmp_path / "ref" / "quant")
    before = tree_state(ref)
    counted = _run_driver(tmp_path, options(ref), 0, no_exchange)
    assert counted.returncode == 0, counted.stderr
    tags = json.loads(counted.stdout.strip().splitlines()[-1])
    after = tree_state(ref)
    assert after != before
    rng = random.Random(f"{case}-5")
    points = set(rng.sample(range(1, len(tags) + 1), min(samples, len(tags))))
    points |= {i + 1 for i, t in enumerate(tags) if t.startswith("exchange_dirs")}  # just before/after the swap
    if no_exchange:
        points |= {i + 1 for i, t in enumerate(tags) if t in ("rename", "replace")}  # every commit step
    new_files = set(after) - set(before)
    for k in sorted(points):
        quant = private_copy(base, tmp_path / f"k{k}" / "quant")
        killed = _run_driver(tmp_path, options(quant), k, no_exchange)
        assert killed.returncode == -signal.SIGKILL, (k, tags[k - 1], killed.stderr[-2000:])
        now = tree_state(quant)
        _loadable(quant)
        if no_exchange:
            # old files as they were, or already replaced by their new version; only new files extra
            assert set(before) <= set(now) <= set(after), (k, tags[k - 1])
            assert all(now[f] in (before[f], after.get(f)) for f in before), (k, tags[k - 1])
            if not any(now[f] != before[f] for f in before):
                assert set(now) - set(before) <= new_files
        else:
            assert now in (before, after), (k, tags[k - 1])  # old or new, never a mix
            if k <= tags.index("exchange_dirs") + 1:
                assert now == before, (k, tags[k - 1])
        # rerunning the same command succeeds and cleans up whatever the kill left behind
        rerun = graft(GraftOptions(**options(quant)))
        assert rerun.action in ("grafted", "metadata", "noop")
        assert tree_state(quant) == after, (k, tags[k - 1])
        assert leftovers(quant.parent) == [], (k, tags[k - 1])


@pytest.mark.slow
def test_kill_during_out_leaves_no_finished_looking_output(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    quant, src = naive_export_factory("qwen3_5"), tiny_factory("qwen3_5")
    ref = tmp_path / "ref" / "out"
    counted = _run_driver(tmp_path, {"quant": str(quant), "source": str(src), "out": str(ref)}, 0, False)
    assert counted.returncode == 0, counted.stderr
    tags = json.loads(counted.stdout.strip().splitlines()[-1])
    expected = tree_state(ref)
    for k in sorted(random.Random(9).sample(range(1, len(tags) + 1), 5)):
        out = tmp_path / f"k{k}" / "out"
        out.parent.mkdir()
        killed = _run_driver(tmp_path, {"quant": str(quant), "source": str(src), "out": str(out)}, k, False)
        assert killed.returncode == -signal.SIGKILL
        if out.exists():  # killed after the final rename: complete
            assert tree_state(out) == expected
            continue
        graft(GraftOptions(quant=quant, source=src, out=out))  # the rerun cleans the stale temp dir
        assert tree_state(out) == expected and leftovers(out.parent) == []


# ---------------------------------------------------------------------------------------------- odd layouts


def test_dry_run_plans_and_writes_nothing(tiny_factory: Factory, tmp_path: Path) -> None:
    src = tiny_factory("qwen3_5")
    quant = strip_mtp(src, tmp_path / "q", keep_declaration=False)
    state = tree_state(tmp_path)
    result = graft(GraftOptions(quant=quant, source=src, in_place=True, dry_run=True))
    assert result.action == "planned" and "would graft 15 MTP tensors (788.74 kB) from" in result.message
    assert result.metadata_changes and result.bytes_written == 0 and result.destination is None
    assert tree_state(tmp_path) == state


def test_snapshot_of_symlinks_and_hidden_files(tiny_factory: Factory, tmp_path: Path) -> None:
    """A QUANT laid out like an HF cache snapshot (relative symlinks into blobs/) plus a hidden file."""
    src = tiny_factory("qwen3_5")
    plain = strip_mtp(src, tmp_path / "plain")
    blobs, snap = tmp_path / "repo" / "blobs", tmp_path / "repo" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in plain.iterdir():
        shutil.copyfile(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    (snap / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    out = tmp_path / "out"
    graft(GraftOptions(quant=snap, source=src, out=out))
    for shard in Checkpoint.open(plain).shards:  # hard links to the blobs, not to the symlinks
        assert not (out / shard).is_symlink() and (out / shard).stat().st_ino == (blobs / shard).stat().st_ino
    assert tensor_digests(out) == tensor_digests(src)
    graft(GraftOptions(quant=snap, source=src, in_place=True))
    for shard in Checkpoint.open(plain).shards:  # in place keeps the user's layout: still symlinks
        assert (snap / shard).is_symlink()
    assert (snap / ".gitattributes").read_text() == "*.safetensors filter=lfs\n"
    assert tensor_digests(snap) == tensor_digests(src)


def test_without_directory_exchange_in_place_replace_is_refused(
    tiny_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mtpquant.surgery.inplace as inplace
    from mtpquant.graft.run import GraftError

    monkeypatch.setattr(inplace, "exchange_supported", lambda scratch: False)
    src = tiny_factory("qwen3_5")
    quant = private_copy(src, tmp_path / "work" / "q")
    src2 = _altered_mtp(src, tmp_path / "src2")
    state = tree_state(tmp_path)
    with pytest.raises(GraftError, match="needs a filesystem with atomic directory exchange"):
        graft(GraftOptions(quant=quant, source=src2, in_place=True, replace=True))
    assert tree_state(tmp_path) == state
    # adding an MTP works without exchange: new files first, JSON (and the rewritten recipe) last
    stripped = strip_mtp(src, tmp_path / "work" / "s")
    (stripped / RECIPE_FILE).write_text(Recipe("mine", mtp=MtpSection(mode="drop")).to_yaml("by hand"))
    result = graft(GraftOptions(quant=stripped, source=src, in_place=True))
    assert result.commit == "files" and tensor_digests(stripped) == tensor_digests(src)
    assert leftovers(stripped.parent) == []
    note = f"MTP grafted from {src.name} by mtpquant {__version__} graft: mtp.mode was drop, now keep."
    assert (stripped / RECIPE_FILE).read_text() == Recipe("mine", mtp=MtpSection(mode="keep")).to_yaml(
        f"by hand\n{note}"
    )


def test_a_validation_report_is_not_carried_into_what_graft_changes(
    tiny_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a user saw: graft (and heal, the same writer) linked QUANT's ``validation/`` into the result, whose card
    then showed QUANT's numbers as measured on the changed checkpoint. A report describes the checkpoint it was
    measured on: --out leaves it behind (QUANT keeps it), in place it is removed, with the exchange and without."""
    import mtpquant.surgery.inplace as inplace

    src = tiny_factory("qwen3_5")

    def with_report(name: str) -> Path:
        quant = strip_mtp(src, tmp_path / name / "q")
        (quant / "validation" / "logs").mkdir(parents=True)
        (quant / "validation" / "report.json").write_text('{"schema": "mtpquant.validate/2"}\n')
        (quant / "validation" / "logs" / "vllm-reference-k1.log").write_text("a server\n")
        return quant

    quant = with_report("out")
    result = graft(GraftOptions(quant=quant, source=src, out=tmp_path / "out" / "grafted"))
    assert not (tmp_path / "out" / "grafted" / "validation").exists()
    assert (quant / "validation" / "report.json").exists()  # QUANT is never changed
    said = "its report measured QUANT before this graft (validate the result for a report on it)"
    assert f"validation/: not carried over: {said}" in result.warnings
    assert inspect_checkpoint(tmp_path / "out" / "grafted").healthy
    for commit in ("exchange", "files"):
        if commit == "files":
            monkeypatch.setattr(inplace, "exchange_supported", lambda scratch: False)
        quant = with_report(commit)
        result = graft(GraftOptions(quant=quant, source=src, in_place=True))
        assert result.commit == commit and not (quant / "validation").exists()
        assert f"validation/: removed: {said}" in result.warnings
        assert tensor_digests(quant) == tensor_digests(src) and leftovers(quant.parent) == []
    # a QUANT without a report: nothing said
    plain = graft(GraftOptions(quant=strip_mtp(src, tmp_path / "plain"), source=src, out=tmp_path / "plain-out"))
    assert not any(w.startswith("validation/") for w in plain.warnings)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"mtp: [\n", "not valid YAML (line 2)"),
        (b"mtp:\n  mode: \xff\n", "not UTF-8 text"),
        (b"#" * (1024 * 1024 + 1), "1048577 bytes, more than the 1048576 mtpquant reads of a recipe file"),
    ],
    ids=["yaml", "utf8", "size"],
)
def test_a_recipe_file_that_is_not_a_recipe_is_carried_with_a_warning(
    tiny_factory: Factory, tmp_path: Path, content: bytes, why: str
) -> None:
    src = tiny_factory("qwen3_5")
    quant = strip_mtp(src, tmp_path / "q")
    (quant / RECIPE_FILE).write_bytes(content)
    result = graft(GraftOptions(quant=quant, source=src, out=tmp_path / "out"))
    assert result.warnings == [
        f"{quant}: {RECIPE_FILE}: {why}; carried unchanged (its mtp.mode does not say the MTP was grafted)"
    ]
    assert (tmp_path / "out" / RECIPE_FILE).read_bytes() == content
