"""A config.json transformers would refuse is a config error (exit 3), found where the config is read: inspect checks
what it can without importing transformers (sections, layer_types, dtype), convert (and its --dry-run) runs
transformers' own validation before any work, and neither the tokenizer load nor validate reports it under another
name (a tokenizer failure, exit 2; a traceback)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.errors import ConfigError, ExitCode
from tests.support.cli import one_error

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


def _edit(path: Path, edit: Callable[[dict], None]) -> Path:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c: c["text_config"].__setitem__("layer_types", ["linear_attention"] * 3),
            "config.json: text_config.layer_types lists 3 layers but num_hidden_layers is 4",
        ),
        (
            lambda c: c["text_config"].__setitem__("dtype", "float17"),
            "config.json: text_config.dtype 'float17' is not a torch dtype",
        ),
        (
            lambda c: c.__setitem__("vision_config", [1, 2]),
            "config.json: vision_config must be an object, got list",
        ),
    ],
)
def test_inspect_and_dry_run_never_call_it_healthy(
    tiny_copy: Factory, capsys: pytest.CaptureFixture[str], edit: Callable[[dict], None], message: str
) -> None:
    src = _edit(tiny_copy("qwen3_5"), edit)
    for argv in (["inspect", str(src)], ["convert", str(src), str(src.parent / "out"), "--dry-run"]):
        code, err = one_error(capsys, *argv)
        assert (code, err) == (ExitCode.CHECKPOINT, f"mtpquant: error: {message}")


def test_convert_runs_transformers_own_validation_before_any_work(
    tiny_copy: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _edit(tiny_copy("qwen3_5"), lambda c: c["vision_config"].__setitem__("depth", "one"))
    code, err = one_error(capsys, "convert", str(src), str(tmp_path / "out"), "--dry-run")
    assert code == ExitCode.CHECKPOINT
    assert err.startswith(
        "mtpquant: error: config.json: transformers refuses it (Validation error for field 'depth': TypeError: Field "
        "'depth' expected int, got str"
    ), err
    code, _ = one_error(capsys, "convert", str(src), str(tmp_path / "work" / "out"), "--device", "cpu")
    assert code == ExitCode.CHECKPOINT and not (tmp_path / "work").exists()  # refused before any work


def test_the_tokenizer_load_reports_a_refused_config_as_one(tiny_copy: Factory) -> None:
    from mtpquant.text.calibration import load_tokenizer

    src = _edit(tiny_copy("qwen3_5"), lambda c: c["text_config"].__setitem__("rope_parameters", "abc"))
    # no tokenizer.json and no tokenizer class: transformers' AutoTokenizer reads config.json to choose one
    (src / "tokenizer.json").unlink()
    (src / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError) as exc:
        load_tokenizer(src)
    assert exc.value.exit_code == ExitCode.CHECKPOINT
    assert str(exc.value).startswith(
        f"{src}/config.json: transformers refuses it (Validation error for field 'rope_parameters': TypeError:"
    )


def test_layer_kinds_are_the_installed_transformers_own() -> None:
    """inspect's torch-free layer_types check accepts exactly what transformers' config classes accept (its allowed
    kinds and the legacy names it renames first): Qwen4-Exp's ``indexed_attention`` came with 5.18."""
    from transformers import configuration_utils as cu

    from mtpquant.checkpoint.table import _LAYER_TYPES

    assert set(_LAYER_TYPES) == set(cu.ALLOWED_LAYER_TYPES) | set(cu._LEGACY_LAYER_TYPE_REMAP)
