"""graft and extract beyond Qwen: a lost MTP put back from the BF16 source writing only the MTP's bytes (the head and
embedding copies only where the family's checkpoints carry them), extract to a sidecar in mtpquant's form and in
SGLang's standalone NextN form (read and written), and the refusals, one line each."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main as cli
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode
from mtpquant.graft.extract import NEXTN_FILE, ExtractOptions, extract_mtp
from mtpquant.graft.run import GraftOptions, graft
from tests.support.nextn_quants import make_nextn_quant

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


def _tensors(path: Path, names: list[str] | None = None) -> dict[str, bytes]:
    ckpt = Checkpoint.open(path)
    return {n: ckpt.read_raw(ckpt.tensors[n]) for n in (names or sorted(ckpt.tensors))}


def _lost(src: Path, out: Path) -> Path:
    """``src`` as a quantizer that lost the MTP leaves it: the MTP's shard and index entries gone, still declared."""
    shutil.copytree(src, out)
    index = json.loads((out / INDEX_NAME).read_text())
    spec = Checkpoint.open(src).spec
    mtp_shards = {s for n, s in index["weight_map"].items() if spec.is_mtp(n)}
    assert all(spec.is_mtp(n) for n, s in index["weight_map"].items() if s in mtp_shards)  # the MTP alone there
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s not in mtp_shards}
    for shard in mtp_shards:
        (out / shard).unlink()
    (out / INDEX_NAME).write_text(json.dumps(index))
    return out


@pytest.mark.parametrize(("variant", "count", "copies"), [("deepseek_v3", 32, True), ("glm4_moe", 32, False)])
def test_graft_puts_the_mtp_back_writing_only_its_bytes(
    tiny_factory: Factory, tmp_path: Path, variant: str, count: int, copies: bool
) -> None:
    """DeepSeek-V3 carries the head and embedding copies in its MTP layer (its drafter loads the head from it);
    GLM-4.7 does not (vLLM maps lm_head into the MTP's head): graft copies what the source has, nothing else."""
    src = tiny_factory(variant)
    quant = _lost(src, tmp_path / "quant")
    assert inspect_checkpoint(quant).exit_code() == ExitCode.INSPECT_MTP
    result = graft(GraftOptions(quant=quant, source=src, out=tmp_path / "out"))
    assert result.mtp_tensors == count and result.new_shards == ["mtp-00001-of-00001.safetensors"]
    out = tmp_path / "out"
    # every file of QUANT is the same file in OUT (hard links); only the MTP shard and the small files are new
    for f in quant.iterdir():
        if f.suffix == ".safetensors":
            assert os.path.samefile(f, out / f.name)
    ckpt = Checkpoint.open(out)
    mtp = sorted(e.name for e in ckpt.mtp_tensors())
    assert len(mtp) == count and any(n.endswith("shared_head.head.weight") for n in mtp) == copies
    assert _tensors(out, mtp) == _tensors(src, mtp)  # byte for byte the source's
    report = inspect_checkpoint(out)
    assert report.healthy and report.exit_code(strict=True) == 0 and report.fixes == []


def test_extract_then_graft_is_the_graft_from_the_source(tiny_factory: Factory, tmp_path: Path) -> None:
    src = tiny_factory("deepseek_v3")
    side = extract_mtp(ExtractOptions(src, tmp_path / "side"))
    assert side.form == "mtpquant" and side.mtp_tensors == 32
    sidecar = inspect_checkpoint(tmp_path / "side")
    assert sidecar.kind == "mtp-only" and "MTP-only checkpoint" in sidecar.verdicts["vllm"]
    quant = make_nextn_quant("deepseek-mtp-lost", tmp_path / "quant")
    graft(GraftOptions(quant=quant, source=tmp_path / "side", out=tmp_path / "a"))
    graft(GraftOptions(quant=quant, source=src, out=tmp_path / "b"))
    shard = "mtp-00001-of-00001.safetensors"
    assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()


def test_nextn_sidecar_is_sglangs_export(tiny_factory: Factory, tmp_path: Path) -> None:
    """SGLang's scripts/export_deepseek_nextn.py: num_hidden_layers 1 and DeepseekV3ForCausalLMNextN in a config with
    sorted keys, layer N renamed model.layers.0, embed_tokens and shared_head.head skipped, one file."""
    src = tiny_factory("deepseek_v3")
    result = extract_mtp(ExtractOptions(src, tmp_path / "nextn", nextn=True))
    assert (result.form, result.mtp_tensors, result.shards) == ("nextn", 30, [NEXTN_FILE])
    config = json.loads((tmp_path / "nextn" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["architectures"] == ["DeepseekV3ForCausalLMNextN"]
    assert list(config) == sorted(config)
    tensors = load_file(tmp_path / "nextn" / NEXTN_FILE)
    assert all(n.startswith("model.layers.0.") for n in tensors) and len(tensors) == 30
    assert not any(n.endswith(("embed_tokens.weight", "shared_head.head.weight")) for n in tensors)
    original = _tensors(src)
    side = _tensors(tmp_path / "nextn")
    assert all(side[n] == original[n.replace("model.layers.0.", "model.layers.2.", 1)] for n in side)
    r = inspect_checkpoint(tmp_path / "nextn")
    assert r.kind == "mtp-only" and r.architecture == "DeepseekV3ForCausalLMNextN" and r.mtp_missing == []


def test_graft_reads_a_nextn_export_made_by_sglangs_script(tiny_factory: Factory, tmp_path: Path) -> None:
    """A NextN directory as SGLang's script writes it (an index with a weight_map only, the config's keys sorted):
    graft puts its layer 0 at QUANT's layer N and the copies it dropped from QUANT's own head and embedding."""
    src = tiny_factory("deepseek_v3")
    ckpt = Checkpoint.open(src)
    side = tmp_path / "sglang-nextn"
    side.mkdir()
    params = {
        e.name.replace("model.layers.2", "model.layers.0"): ckpt.read_tensor(e.name)
        for e in ckpt.mtp_tensors()
        if "embed_tokens" not in e.name and "shared_head.head" not in e.name
    }
    save_file(params, side / NEXTN_FILE)
    (side / INDEX_NAME).write_text(json.dumps({"weight_map": dict.fromkeys(params, NEXTN_FILE)}, indent=4))
    config = {**ckpt.config, "num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"]}
    (side / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    quant = make_nextn_quant("deepseek-mtp-lost", tmp_path / "quant")
    result = graft(GraftOptions(quant=quant, source=side, out=tmp_path / "out"))
    assert result.mtp_tensors == 32
    out = _tensors(tmp_path / "out")
    q = _tensors(quant, ["lm_head.weight", "model.embed_tokens.weight"])
    assert out["model.layers.2.shared_head.head.weight"] == q["lm_head.weight"]
    assert out["model.layers.2.embed_tokens.weight"] == q["model.embed_tokens.weight"]
    reference = _tensors(src, [e.name for e in ckpt.mtp_tensors()])
    assert all(out[n] == b for n, b in reference.items() if "embed_tokens" not in n and "shared_head.head" not in n)
    assert inspect_checkpoint(tmp_path / "out").healthy


def test_extract_refusals_are_one_line(
    tiny_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["extract", str(tiny_factory("glm4_moe")), "--out", str(tmp_path / "a"), "--nextn"], ExitCode.USAGE,
         "--nextn: SGLang's standalone NextN form exists for DeepSeek-V3 / V3.2, not GLM-4.5"),
        (["extract", str(make_nextn_quant("deepseek-mtp-lost", tmp_path / "q")), "--out", str(tmp_path / "b")],
         ExitCode.MTP_MODE, "has no MTP tensors (num_nextn_predict_layers = 1), so there is nothing to extract"),
        (["extract", str(tiny_factory("glm4_moe")), "--out", str(tmp_path)], ExitCode.OUTPUT_EXISTS, "already exists"),
    ]
    for argv, code, text in cases:
        assert cli(argv) == code
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and text in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # nothing written
