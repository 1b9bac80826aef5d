"""The base model in the card (``--base-model`` on convert and publish), and nothing private in what publish
uploads. A Hub SRC (tests/test_convert.py) and an HF-cache snapshot (tests/test_publish.py) are the other two
ways the base model is recorded."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from mtpquant.cli import main
from mtpquant.errors import ExitCode, PublishRefusedError
from mtpquant.publish.run import PublishOptions, publish
from mtpquant.records.provenance import read_provenance
from tests.support.hubserver import LocalHub

pytestmark = pytest.mark.slow

CALIB = ["--calib-samples", "2", "--calib-seq-len", "32", "--device", "cpu"]


@pytest.fixture(scope="module")
def plain(tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A convert of a plain local directory (not a Hub snapshot): no base model is recorded."""
    out = tmp_path_factory.mktemp("plain") / "tiny-NVFP4"
    assert main(["-q", "convert", str(tiny_factory("qwen3_5")), str(out), "--keep-mtp", *CALIB]) == 0
    return out


def _meta(card: str) -> dict:
    return ModelCard(card).data.to_dict()


def test_unrecorded_base_model_says_how_to_name_it(plain: Path) -> None:
    card = publish(PublishOptions(out=plain, repo="me/tiny", dry_run=True)).card
    assert "base_model" not in _meta(card) and "a base model that is not recorded" in card
    assert "--base-model ORG/NAME" in card


def test_convert_base_model(tiny_factory: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny_factory("qwen3_5_moe")
    out = tmp_path / "moe-NVFP4"
    argv = ["convert", str(src), str(out), "--base-model", "Qwen/Qwen3.5-35B-A3B", "--base-model-revision", "v1"]
    assert main(["-q", *argv, *CALIB]) == 0
    origin = read_provenance(out).origin
    assert origin is not None and (origin.base_model, origin.base_model_revision) == ("Qwen/Qwen3.5-35B-A3B", "v1")
    assert origin.command[2:4] == (src.name, out.name)  # local directories by base name
    assert origin.source is not None and origin.source.path == src.name
    card = publish(PublishOptions(out=out, repo="me/moe", dry_run=True)).card
    meta = _meta(card)
    assert (meta["base_model"], meta["base_model_relation"]) == ("Qwen/Qwen3.5-35B-A3B", "quantized")
    assert "Base model `Qwen/Qwen3.5-35B-A3B` at revision `v1` from the provenance file (--base-model)." in card
    recipe = (out / "mtpquant_recipe.yaml").read_text()
    assert f"# source: {src.name}\n" in recipe and str(tmp_path) not in recipe and str(src.parent) not in recipe


def test_publish_base_model_is_recorded_and_uploaded(plain: Path, tmp_path: Path, local_hub: LocalHub) -> None:
    out = tmp_path / "tiny-NVFP4"
    shutil.copytree(plain, out)
    before = (out / "mtpquant_provenance.json").read_bytes()
    dry = publish(PublishOptions(out=out, repo="me/tiny", dry_run=True, base_model="Qwen/Qwen3.5-0.8B"))
    assert _meta(dry.card)["base_model"] == "Qwen/Qwen3.5-0.8B"
    assert (out / "mtpquant_provenance.json").read_bytes() == before and not (out / "README.md").exists()

    code = main(["publish", str(out), "--repo", "me/tiny", "--base-model", "Qwen/Qwen3.5-0.8B"])
    assert code == 0
    steps = read_provenance(out).steps
    assert [s.tool for s in steps] == ["convert", "publish"]
    assert steps[1].base_model == "Qwen/Qwen3.5-0.8B" and steps[1].command == (
        "mtpquant", "publish", "tiny-NVFP4", "--repo", "me/tiny", "--base-model", "Qwen/Qwen3.5-0.8B"
    )
    remote = local_hub.repo_dir("me/tiny")
    meta = _meta((remote / "README.md").read_text())
    assert (meta["base_model"], meta["base_model_relation"]) == ("Qwen/Qwen3.5-0.8B", "quantized")
    uploaded = json.loads((remote / "mtpquant_provenance.json").read_text())
    assert [s["base_model"] for s in uploaded["steps"]] == [None, "Qwen/Qwen3.5-0.8B"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--base-model", "not a repo"],
        ["--base-model", "Qwen--Qwen3.5"],
        ["--base-model-revision", "main"],  # a revision of nothing
    ],
)
def test_malformed_base_model_is_refused_before_anything(
    argv: list[str], plain: Path, tiny_factory: Callable[[str], Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    assert main(["convert", str(tiny_factory("qwen3_5")), str(out), *argv, *CALIB]) == ExitCode.USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtpquant: error: --base-model") and len(err.splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert main(["publish", str(plain), "--repo", "me/x", "--dry-run", *argv]) == ExitCode.USAGE


def test_a_file_naming_a_local_path_is_not_uploaded(plain: Path, tmp_path: Path, local_hub: LocalHub) -> None:
    out = tmp_path / "tiny-NVFP4"
    shutil.copytree(plain, out)
    (out / "notes.md").write_text(f"made on my box from {tmp_path}/models/qwen\n")
    with pytest.raises(PublishRefusedError, match=r"notes\.md names the local path .*refusing to upload it"):
        publish(PublishOptions(out=out, repo="me/tiny"))
    assert not local_hub.repo_dir("me/tiny").exists()
    assert main(["publish", str(out), "--repo", "me/tiny"]) == ExitCode.PUBLISH_REFUSED


def test_engine_server_logs_stay_local(plain: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny-NVFP4"
    shutil.copytree(plain, out)
    (out / "validation" / "logs").mkdir(parents=True)
    (out / "validation" / "logs" / "vllm-candidate-k3.log").write_text(f"INFO loading {out}\n")
    files = [f.path for f in publish(PublishOptions(out=out, repo="me/tiny", dry_run=True)).files]
    assert not any(f.startswith("validation/") for f in files)
