"""Release day: an architecture the registry does not know, whose config declares an MTP, gets inspect's generic checks
for the storage its tensors show (an appended layer, the mtp. or model.mtp. namespace) and one line saying the family
is unknown, instead of exit 4; every surgery still refuses (exit 4); a config declaring no MTP stays unsupported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mtpquant.cli import main as cli
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode, UnsupportedArchitectureError
from mtpquant.families import resolve
from tests.support.skeleton import SkeletonTensor, write_sparse_safetensors

pytestmark = pytest.mark.dev

H, V = 64, 128


def _write(path: Path, config: dict[str, Any], names: list[str]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    shapes = {"embed_tokens": (V, H), "lm_head": (V, H)}
    tensors = [SkeletonTensor(n, "BF16", next((s for k, s in shapes.items() if k in n), (H, H)), "") for n in names]
    write_sparse_safetensors(path / "model.safetensors", tensors)
    return path


def _config(**mtp: Any) -> dict[str, Any]:
    return {"architectures": ["NovaK4ForCausalLM"], "model_type": "nova_k4", "hidden_size": H, "vocab_size": V,
            "num_hidden_layers": 2, **mtp}


_TRUNK = ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight",
          "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"]


def _appended(n: int) -> list[str]:
    return [f"model.layers.{n}.eh_proj.weight", f"model.layers.{n}.self_attn.o_proj.weight"]


@pytest.mark.parametrize(
    ("mtp", "names", "storage"),
    [
        ({"num_nextn_predict_layers": 1}, _appended(2), "appended"),
        ({"num_mtp_layers": 2}, [*_appended(2), *_appended(3)], "appended"),
        ({"num_mtp_layers": 1}, ["mtp.fc.weight", "mtp.layers.0.self_attn.o_proj.weight"], "namespace"),
        ({"mtp_num_hidden_layers": 1}, ["model.mtp.layers.0.eh_proj.weight"], "subspace"),
    ],
)
def test_an_unknown_mtp_family_gets_the_generic_checks(
    tmp_path: Path, mtp: dict[str, Any], names: list[str], storage: str
) -> None:
    path = _write(tmp_path / "ckpt", _config(**mtp), [*_TRUNK, *names])
    r = inspect_checkpoint(path)
    assert r.exit_code(strict=True) == 0 and r.mtp_status == "unknown"
    assert r.family == "unknown family" and r.architecture == "NovaK4ForCausalLM"
    assert r.verdicts["vllm"].endswith("(if vLLM has a drafter for NovaK4ForCausalLM: mtpquant does not know it)")
    assert r.mtp_present_tensors == len(names) and r.mtp_layers_present == next(iter(mtp.values()))
    assert [w.message for w in r.warnings if "not in mtpquant's registry" in w.message]
    assert resolve(_config(**mtp), [*_TRUNK, *names]).mtp_names.kind == storage
    assert {m.module for m in r.mtp_modules} == {n.removesuffix(".weight") for n in names}  # each precision judged


def test_an_unknown_family_that_lost_its_mtp_or_a_layer_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A quant of an unknown family that lost its appended layer fails inspect with the MTP exit code, not 4; one that
    holds fewer layers than it declares too; graft refuses in one line (exit 4)."""
    lost = _write(tmp_path / "lost", _config(num_nextn_predict_layers=1), _TRUNK)
    r = inspect_checkpoint(lost)
    assert r.exit_code() == ExitCode.INSPECT_MTP and r.mtp_status == "unknown"
    short = _write(tmp_path / "short", _config(num_mtp_layers=2), [*_TRUNK, *_appended(2)])
    r = inspect_checkpoint(short)
    assert r.exit_code() == ExitCode.INSPECT_MTP
    assert "MTP incomplete (num_mtp_layers = 2, the checkpoint holds 1 layer)" in r.failure_messages
    assert cli(["graft", str(lost), "--fix-metadata", "--out", str(tmp_path / "out")]) == ExitCode.ARCHITECTURE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NovaK4ForCausalLM is not in mtpquant's registry" in err
    assert not (tmp_path / "out").exists()
    # the inspect command itself: the unknown line printed, exit 10
    assert cli(["inspect", str(lost)]) == ExitCode.INSPECT_MTP
    assert "not in mtpquant's registry" in capsys.readouterr().out


def test_an_unknown_architecture_without_an_mtp_is_still_unsupported(tmp_path: Path) -> None:
    config = _config()
    with pytest.raises(UnsupportedArchitectureError, match="unsupported architecture NovaK4ForCausalLM"):
        resolve(config)
    assert cli(["inspect", str(_write(tmp_path / "plain", config, _TRUNK))]) == ExitCode.ARCHITECTURE
    # an mtp_* key alone (MiniMax-M2's use_mtp style) is a declaration too
    assert resolve(_config(use_mtp=True)).family.key == "unknown"


def test_kimi_k3_with_an_appended_layer_no_longer_exits_4(tmp_path: Path) -> None:
    """The issue's case: a text-only KimiK3ForCausalLM with its MTP appended at model.layers.{N} was exit 4; it is the
    registry's kimi_k3 now (vLLM's KimiK3MTPModel), and any other unknown name gets the generic checks."""
    names = [*_TRUNK, "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
             "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.o_proj.weight"]
    shapes = {"enorm": (H,), "hnorm": (H,), "norm.weight": (H,), "eh_proj": (H, 2 * H), "embed_tokens": (V, H),
              "lm_head": (V, H)}
    path = tmp_path / "k3"
    path.mkdir()
    config = {**_config(num_nextn_predict_layers=1), "architectures": ["KimiK3ForCausalLM"], "model_type": "kimi_k3"}
    (path / "config.json").write_text(json.dumps(config))
    tensors = [SkeletonTensor(n, "BF16", next((s for k, s in shapes.items() if k in n), (H, H)), "") for n in names]
    write_sparse_safetensors(path / "model.safetensors", tensors)
    r = inspect_checkpoint(path)
    assert r.healthy and r.mtp_status == "supported" and r.drafters["vllm"] == "KimiK3MTPModel"
    assert r.mtp_present_tensors == 5 and r.mtp_expected_tensors == 4  # the glue, by name and shape
