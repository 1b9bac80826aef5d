"""Calibration data: offline text, files, chat templates, tokenised with the model's own tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mtpquant.errors import CalibrationDataError
from mtpquant.text.calibration import build_calibration_data, check_calibration_source, load_tokenizer

pytestmark = pytest.mark.dev

TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tiny_factory: Callable[[str], Path]) -> Any:
    return load_tokenizer(tiny_factory("qwen3_5"))


def test_offline_default_is_real_text(tokenizer: Any) -> None:
    data = build_calibration_data(tokenizer, "offline", samples=4, seq_len=64, chat_template=True)
    assert tuple(data.input_ids.shape) == (4, 64) and data.samples == 4 and data.seq_len == 64
    assert not data.chat_template  # the tiny tokenizer has no chat template
    text = tokenizer.decode(data.input_ids[0])
    assert len(set(text.split())) > 10  # words, not noise
    again = build_calibration_data(tokenizer, "offline", samples=4, seq_len=64)
    assert bool((again.input_ids == data.input_ids).all())  # the same rows on every run


def test_tokenizer_is_the_checkpoints_tokenizer_json(tokenizer: Any, tiny_factory: Callable[[str], Path]) -> None:
    # calibration tokenises exactly as tokenizer.json says (validate's prompts read the same file), not with the
    # pre-tokenizer transformers >= 5.16 substitutes for qwen3_5 (Qwen3_5Tokenizer: "\n\n" one token, digits split)
    from tokenizers import Tokenizer

    text = "Paragraph 12:\n\nAssert statements are a convenient way 2024.\n\n\n    return x"
    own = Tokenizer.from_file(str(tiny_factory("qwen3_5") / "tokenizer.json")).encode(text, add_special_tokens=False)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == own.ids
    newline = Tokenizer.from_file(str(tiny_factory("qwen3_5") / "tokenizer.json")).token_to_id("ĊĊ")
    assert newline is not None and newline not in own.ids  # the file's byte-level regex keeps "\n\n" apart


def test_chat_template_is_used(tokenizer: Any) -> None:
    tokenizer.chat_template = TEMPLATE
    try:
        data = build_calibration_data(tokenizer, "offline", samples=2, seq_len=64, chat_template=True)
        plain = build_calibration_data(tokenizer, "offline", samples=2, seq_len=64, chat_template=False)
    finally:
        tokenizer.chat_template = None
    assert data.chat_template and not plain.chat_template
    text = tokenizer.decode(data.input_ids[0])
    assert text.startswith("<|bos|>user\nExplain the Python language topic")
    assert "assistant\n" in tokenizer.decode(data.input_ids.flatten())


def test_files(tokenizer: Any, tmp_path: Path) -> None:
    txt = tmp_path / "c.txt"
    txt.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(40)))
    data = build_calibration_data(tokenizer, str(txt), samples=3, seq_len=32)
    assert tuple(data.input_ids.shape) == (3, 32) and data.source == f"file {txt}"
    jsonl = tmp_path / "c.jsonl"
    rows = [{"text": "def f(x):\n    return x * 2\n" * 5}, {"messages": [{"role": "user", "content": "hi " * 40}]}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows * 5))
    data = build_calibration_data(tokenizer, str(jsonl), samples=2, seq_len=32)
    assert data.documents >= 1
    jsonl.write_text('{"prompt": "x"}\n')
    with pytest.raises(CalibrationDataError, match=r"c\.jsonl:1: expected an object with 'text' or 'messages'"):
        build_calibration_data(tokenizer, str(jsonl), samples=2, seq_len=32)
    txt.write_text("too short")
    with pytest.raises(CalibrationDataError, match="fewer than one row of 512"):
        build_calibration_data(tokenizer, str(txt), samples=2, seq_len=512)


def test_fewer_tokens_than_asked_gives_fewer_rows(tokenizer: Any, tmp_path: Path) -> None:
    txt = tmp_path / "c.txt"
    txt.write_text("one two three four five six seven eight nine ten " * 20)
    data = build_calibration_data(tokenizer, str(txt), samples=1000, seq_len=16)
    assert 1 <= data.samples < 1000


def test_dataset_name_needs_datasets(tmp_path: Path) -> None:
    import importlib.util

    check_calibration_source("offline")
    with pytest.raises(CalibrationDataError, match="calibration data file does not exist"):
        check_calibration_source(str(tmp_path / "nope.jsonl"))
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(CalibrationDataError, match=r"needs the `datasets` package \(pip install datasets\)"):
            check_calibration_source("wikitext:wikitext-2-raw-v1")


def test_missing_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CalibrationDataError, match="cannot load the model's tokenizer"):
        load_tokenizer(tmp_path)
