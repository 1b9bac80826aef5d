"""One exit-code table: distinct codes per cause, documented, and inspect non-zero on every FAIL."""

from __future__ import annotations

import inspect as pyinspect
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import mtpquant.errors as errors
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.cli import main as cli
from mtpquant.errors import ExitCode, MtpquantError, exit_code_table

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]
EXIT_CODES_DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"  # the README links to it


def test_every_error_type_has_a_code_of_the_table() -> None:
    classes = [c for _, c in pyinspect.getmembers(errors, pyinspect.isclass) if issubclass(c, MtpquantError)]
    assert len(classes) > 20
    for cls in classes:
        assert cls.exit_code in set(ExitCode), cls
    # causes that used to share code 6 (or 1) are apart now
    causes = [
        errors.MtpModeError,
        errors.SourceQuantizedError,
        errors.GraftError,
        errors.LineageError,
        errors.OutputVerificationError,
        errors.HubUnreachableError,
        errors.HubAccessError,
        errors.HubRefusedError,
        errors.EngineUnreachableError,
        errors.EngineAnswerError,
        errors.EngineModelError,
        errors.EngineSpecDecodeError,
        errors.EngineStartError,
    ]
    codes = [c.exit_code for c in causes]
    assert len(set(codes)) == len(codes)
    assert {ExitCode.IO, ExitCode.VALIDATE_WARN, ExitCode.VALIDATE_FAIL}.isdisjoint(codes)
    assert ExitCode.VALIDATE_WARN != ExitCode.INTERNAL


def test_the_table_is_documented_in_the_docs_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    table = exit_code_table()
    assert table in EXIT_CODES_DOC.read_text()
    with pytest.raises(SystemExit):
        cli(["--help"])
    assert table in capsys.readouterr().out


def _index(path: Path) -> dict:
    return json.loads((path / INDEX_NAME).read_text())


@pytest.mark.parametrize("defect", ["healthy", "missing_shard", "unindexed_tensor", "declared_missing"])
def test_inspect_fails_non_zero_without_strict(
    tiny_copy: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str], defect: str
) -> None:
    path = tiny_copy("qwen3_5_moe")
    index = _index(path)
    if defect == "missing_shard":
        index["weight_map"]["mtp.fc.weight"] = "model-00099-of-00099.safetensors"
    elif defect == "unindexed_tensor":
        del index["weight_map"]["mtp.fc.weight"]
    elif defect == "declared_missing":
        for name in [n for n in index["weight_map"] if n.startswith("mtp.")]:
            del index["weight_map"][name]
        # the MTP tensors gone from the shards too: a real "declared but missing" checkpoint
        from safetensors.torch import load_file, save_file

        for shard in {p.name for p in path.glob("*.safetensors")}:
            tensors = {k: v for k, v in load_file(path / shard).items() if not k.startswith("mtp.")}
            if tensors:
                save_file(tensors, path / shard, metadata={"format": "pt"})
            else:
                (path / shard).unlink()
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if (path / v).exists()}
        index["metadata"] = {}
    (path / INDEX_NAME).write_text(json.dumps(index))
    code = cli(["inspect", str(path)])
    out = capsys.readouterr().out
    expected = {
        "healthy": 0,
        "missing_shard": ExitCode.INSPECT_INDEX,
        "unindexed_tensor": ExitCode.INSPECT_INDEX,
        "declared_missing": ExitCode.INSPECT_MTP,
    }[defect]
    assert code == expected, out
    assert ("verdict: healthy" in out) == (defect == "healthy")
    shutil.rmtree(path)
