"""MTP sidecar repos: ``convert --mtp extract``'s MTP directory, inspected as what it is, published with a card of
its own, and grafted back from the Hub (the real huggingface_hub client against LocalHub)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode, LineageError
from mtpquant.graft.run import GraftOptions, graft
from mtpquant.publish.card import card_origin, validate_card_metadata
from mtpquant.publish.run import PublishOptions, publish
from mtpquant.recipes.recipe import RECIPE_FILE
from tests.support.hubserver import LocalHub
from tests.test_graft import tensor_digests, tree_state

pytestmark = pytest.mark.slow

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
CALIB = {"calib_samples": 2, "calib_seq_len": 32}


@pytest.fixture(scope="module")
def extracted(
    tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], tuple[Path, Path, Path]]]:
    """(SRC, OUT without MTP, OUT-mtp) of ``convert --mtp extract --base-model org/<family>``, once per family."""
    root = tmp_path_factory.mktemp("extract")
    runs: dict[str, tuple[Path, Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path, Path]:
        if family not in runs:
            src, out = tiny_factory(family), root / f"{family}-NVFP4"
            result = convert(
                ConvertOptions(
                    src=str(src),
                    out=out,
                    mtp="extract",
                    device="cpu",
                    progress=False,
                    base_model=f"org/{family}",
                    base_model_revision="r1",
                    command=("mtpquant", "convert", str(src), str(out), "--mtp", "extract"),
                    **CALIB,  # type: ignore[arg-type]
                )
            )
            assert result.mtp_output is not None
            runs[family] = (src, out, result.mtp_output)
        return runs[family]

    yield get


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[LocalHub]:
    with LocalHub(tmp_path / "hub") as server, server.client_env(tmp_path / "hf_home"):
        yield server
    assert server.errors == []


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_says_mtp_only(extracted: Callable[[str], tuple[Path, Path, Path]], family: str) -> None:
    src, _, sidecar = extracted(family)
    report = inspect_checkpoint(sidecar)
    expected = len(Checkpoint.open(src).mtp_tensors())
    assert (report.kind, report.healthy) == ("mtp-only", True)
    assert report.mtp_present_tensors == report.mtp_expected_tensors == expected
    assert report.serve_commands == {}  # nothing to serve on its own
    assert report.verdicts["vllm"] == (
        f"vLLM: MTP-only checkpoint (BF16), no model to serve; graft it into a quant of its base model: "
        f"mtpquant graft QUANT --from {sidecar}"
    )
    assert [w.message for w in report.warnings] == []  # no "vision tower missing" for an MTP alone
    assert inspect_checkpoint(src).kind == "model"


def test_inspect_cli_text(extracted: Callable[[str], tuple[Path, Path, Path]], capsys: pytest.CaptureFixture) -> None:
    _, _, sidecar = extracted("qwen3_5")
    assert main(["inspect", str(sidecar)]) == 0
    text = capsys.readouterr().out
    assert "contents       the MTP layer alone (an MTP sidecar): no main model, no vision tower" in text
    assert "main Linears" not in text and "vision tower   MISSING" not in text and "verdict: healthy" in text


@pytest.mark.parametrize("family", FAMILIES)
def test_publish_then_graft_from_the_hub(
    extracted: Callable[[str], tuple[Path, Path, Path]], hub: LocalHub, family: str, tmp_path: Path
) -> None:
    src, quant, sidecar = extracted(family)
    repo = f"org/{family}-MTP"
    before = (sidecar / "README.md").read_text()
    assert card_origin(before) == "generated"  # extract's README is a generated card: publish replaces it

    result = publish(PublishOptions(out=sidecar, repo=repo))

    assert result.card_action == "regenerated" and result.healthy
    served = {p.relative_to(hub.repo_dir(repo)).as_posix(): p.read_bytes() for p in hub.repo_dir(repo).rglob("*")}
    assert sorted(served) == sorted(
        [
            ".gitattributes",
            "README.md",
            "config.json",
            "model.safetensors.index.json",
            "mtp-00001-of-00001.safetensors",
            "mtpquant_provenance.json",
        ]
    )
    card = ModelCard(served["README.md"].decode())
    meta = card.data.to_dict()
    assert meta == {
        "base_model": f"org/{family}",
        "base_model_relation": "adapter",
        "tags": ["mtp", "mtp-sidecar", "speculative-decoding", family, "mtpquant"],
    }
    assert validate_card_metadata(meta) == []
    report = inspect_checkpoint(sidecar)
    for needle in (
        f"The Multi-Token-Prediction (MTP) layer of [`org/{family}`](https://huggingface.co/org/{family}) at "
        "revision `r1` alone",
        f"| Tensors | {report.mtp_present_tensors} `mtp.*` tensors (",
        "| Precision | BF16 |",
        f"mtpquant graft QUANT --from {repo} --out QUANT-with-mtp",
        "**not tested by mtpquant**",
        f'"method":"mtp","model":"{repo}"',
        f"mtpquant convert {src.name} {quant.name} --mtp extract",
        f"Base model `org/{family}` at revision `r1` from the provenance file (--base-model).",
    ):
        assert needle in card.text, needle
    for name, data in served.items():  # nothing names a local directory
        if not name.endswith(".safetensors"):
            assert str(tmp_path.parent).encode() not in data and str(sidecar.parent).encode() not in data, name

    hub.reset_counters()
    out = tmp_path / "grafted"
    grafted = graft(GraftOptions(quant=str(quant), source=repo, out=out))
    fetched = sum(r.body_bytes for r in hub.requests if r.repo_id == repo)
    assert grafted.mtp_bytes <= fetched <= 1.1 * grafted.mtp_bytes + 64 * 1024  # the MTP, its header, the listing
    local = tmp_path / "grafted-local"
    graft(GraftOptions(quant=str(quant), source=str(sidecar), out=local))
    state, state_local = tree_state(out), tree_state(local)
    recorded = ("mtpquant_provenance.json", RECIPE_FILE)  # they name where the MTP came from
    assert {k: v for k, v in state.items() if k not in recorded} == {
        k: v for k, v in state_local.items() if k not in recorded
    }
    recipe, recipe_local = (d / RECIPE_FILE for d in (out, local))
    assert recipe.read_text().replace(f"MTP grafted from {repo} ", f"MTP grafted from {sidecar.name} ") == (
        recipe_local.read_text()
    )
    assert tensor_digests(out, mtp=True) == tensor_digests(src, mtp=True)
    after = inspect_checkpoint(out)
    assert after.healthy and after.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    steps = json.loads((out / "mtpquant_provenance.json").read_text())["steps"]
    assert [s["tool"] for s in steps] == ["convert", "graft"] and steps[1]["source"]["repo_id"] == repo


def test_graft_from_a_sidecar_of_another_model_is_refused(
    extracted: Callable[[str], tuple[Path, Path, Path]], tmp_path: Path
) -> None:
    _, quant, _ = extracted("qwen3_5_moe")
    _, _, other = extracted("qwen3_5")
    with pytest.raises(LineageError):
        graft(GraftOptions(quant=str(quant), source=str(other), out=tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    code = main(["graft", str(quant), "--from", str(other), "--out", str(tmp_path / "x")])
    assert code == ExitCode.LINEAGE and not (tmp_path / "x").exists()
