"""One bad input must not take the machine down: config values that size loops are bounded by the tensors and by
sane limits, JSON files are read only up to a size (locally and from the Hub) and never nested past the parser, and
a checkpoint's tensor count has a cap. Each is one line and exit 3 (the deep-JSON and huge-value cases are also in
the hostile corpus, ``tests/fixtures/bad``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint import table
from mtpquant.checkpoint.source import JSON_LIMIT
from mtpquant.errors import ExitCode
from tests.support.cli import one_error
from tests.support.hubserver import LocalHub

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


def _edit_config(path: Path, **text: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(text)
    (path / "config.json").write_text(json.dumps(config))


def test_more_layers_declared_than_the_tensors_hold(tiny_copy: Factory, capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_copy("qwen3_5")
    text = json.loads((src / "config.json").read_text())["text_config"]
    layers = text["num_hidden_layers"]
    _edit_config(src, num_hidden_layers=layers + 2, layer_types=text["layer_types"] + ["linear_attention"] * 2)
    code, err = one_error(capsys, "inspect", str(src))
    assert code == ExitCode.CHECKPOINT
    assert err == (
        f"mtpquant: error: config.json: num_hidden_layers {layers + 2} contradicts the tensors: there is no "
        f"model.language_model.layers.{layers + 1}.input_layernorm.weight"
    )
    _edit_config(src, num_hidden_layers=10**9, layer_types=None)
    code, err = one_error(capsys, "convert", str(src), str(src.parent / "out"), "--dry-run")
    assert code == ExitCode.CHECKPOINT
    assert err == (
        "mtpquant: error: config.json: text_config.num_hidden_layers = 1000000000 is outside what any model has "
        "(0 to 1024)"
    )


def test_a_json_file_past_the_limit_is_not_read(tiny_copy: Factory, capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_copy("qwen3_5")
    size = JSON_LIMIT + 1
    with (src / "config.json").open("r+b") as fh:
        fh.truncate(size)  # sparse: nothing is written, and nothing must be read
    code, err = one_error(capsys, "inspect", str(src))
    assert code == ExitCode.CHECKPOINT
    assert err == (
        f"mtpquant: error: config.json: {size} bytes, more than the {JSON_LIMIT} mtpquant reads of a JSON file"
    )


def test_a_json_file_past_the_limit_is_not_fetched_from_the_hub(
    local_hub: LocalHub, tiny_factory: Factory, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tiny_factory("qwen3_5")
    repo = local_hub.create_repo("org/big-index", {p.name: p for p in src.iterdir() if p.is_file()})
    with (repo / "model.safetensors.index.json").open("r+b") as fh:
        fh.truncate(JSON_LIMIT + 7)
    code, err = one_error(capsys, "inspect", "org/big-index")
    assert code == ExitCode.CHECKPOINT
    assert err == (
        f"mtpquant: error: model.safetensors.index.json: {JSON_LIMIT + 7} bytes, more than the {JSON_LIMIT} mtpquant "
        "reads of a JSON file"
    )
    fetched = [r for r in local_hub.requests if r.filename == "model.safetensors.index.json"]
    assert fetched == []  # refused from the listing's size, before a byte of it was fetched


def test_the_tensor_count_is_capped(
    tiny_factory: Factory, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tiny_factory("qwen3_5")  # two shards
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    monkeypatch.setattr(table, "MAX_TENSORS", len(index) - 1)  # the real cap is 1,000,000; the rule is the same
    code, err = one_error(capsys, "inspect", str(src))
    assert code == ExitCode.CHECKPOINT
    assert err == (
        f"mtpquant: error: model.safetensors.index.json: maps {len(index)} tensors, more than the {len(index) - 1} "
        "mtpquant reads of one checkpoint"
    )
    single = tiny_factory("qwen3_5-tied")  # no index: the count of the shard headers is capped as they are read
    n = len(table.Checkpoint.open(single).tensors)
    monkeypatch.setattr(table, "MAX_TENSORS", n - 1)
    code, err = one_error(capsys, "inspect", str(single))
    assert code == ExitCode.CHECKPOINT
    assert err == (
        f"mtpquant: error: model.safetensors: brings the checkpoint to {n} tensors, more than the {n - 1} mtpquant "
        "reads of one checkpoint"
    )


def test_a_bad_prompts_file_is_a_usage_error(
    tiny_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "fine"}\n' + "[" * 100_000 + "\n")
    code, err = one_error(
        capsys, "validate", str(tiny_factory("qwen3_5")), "--prompts", str(prompts), "--device", "cpu"
    )
    assert code == ExitCode.USAGE
    assert err == f"mtpquant: error: {prompts}:2: not a JSON line (nested deeper than the JSON parser allows)"


def test_a_tokenizer_past_the_limit_is_not_read(tiny_copy: Factory) -> None:
    from mtpquant.checkpoint.source import LocalSource
    from mtpquant.errors import CheckpointError
    from mtpquant.text.prompts import tokenize_prompts

    src = tiny_copy("qwen3_5")
    with (src / "tokenizer.json").open("r+b") as fh:
        fh.truncate(JSON_LIMIT + 1)  # sparse, as above
    with pytest.raises(CheckpointError) as caught:
        tokenize_prompts(LocalSource(src), ["a prompt"])
    assert str(caught.value) == (
        f"tokenizer.json: {JSON_LIMIT + 1} bytes, more than the {JSON_LIMIT} mtpquant reads of a tokenizer file"
    )
