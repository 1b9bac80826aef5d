"""A resume state is reused only for the same inputs, by content: the calibration text edited at the same path (or
another tokenizer, another dataset revision: they all change the token rows calibration consumes) starts afresh and
removes the old state; the device is part of the key too."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.convert.run import ConvertOptions, convert
from tests.test_convert_scale import CALIB, _killed_run, assert_same_output, leftovers

pytestmark = pytest.mark.slow


def _text(seed: int) -> str:
    return "\n\n".join(f"Document {seed}-{i}: " + " ".join(f"w{(seed * 31 + i * 7 + j) % 97}" for j in range(60))
                       for i in range(30))


def test_calibration_text_edited_at_the_same_path_does_not_resume(
    tiny_factory: Callable[[str], Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = tiny_factory("qwen3_5")
    calib = tmp_path / "calib.txt"
    calib.write_text(_text(1))
    out = tmp_path / "out"
    _killed_run(src, out, 1, "--resume-every", "1", "--calib-data", str(calib))
    calib.write_text(_text(2))  # same path, other text (and, here, even the same size)
    options = {"mtp": "keep", "calib_data": str(calib), "resume_every": 1, **CALIB}
    with caplog.at_level(logging.INFO, logger="mtpquant"):
        result = convert(ConvertOptions(src=str(src), out=out, layerwise=True, **options))  # type: ignore[arg-type]
    assert result.resumed_from_layer is None and "resuming" not in caplog.text
    assert "discarding the resume state of an earlier run" in caplog.text
    assert leftovers(out) == []
    fresh = convert(ConvertOptions(src=str(src), out=tmp_path / "fresh", **options))  # type: ignore[arg-type]
    assert_same_output(fresh.output, out)  # type: ignore[arg-type]  # the new text, not the old state


def test_the_key_covers_the_calibration_content_and_the_device(tiny_factory: Callable[[str], Path]) -> None:
    import dataclasses

    import torch

    from mtpquant.convert.plan import plan_convert
    from mtpquant.convert.resume import resume_key
    from mtpquant.convert.run import _resume_inputs
    from mtpquant.text.calibration import CalibrationData

    src = tiny_factory("qwen3_5")
    plan, _ = plan_convert(ConvertOptions(src=str(src), out=src.parent / "unused", dry_run=True, device="cpu"))
    rows = torch.arange(64).view(2, 32)
    data = CalibrationData(rows, "file calib.txt", 2, False)
    key = resume_key(_resume_inputs(plan, src, data))
    assert key == resume_key(_resume_inputs(plan, src, CalibrationData(rows.clone(), "file calib.txt", 2, False)))
    other = rows.clone()
    other[1, 5] += 1  # one token differs
    assert key != resume_key(_resume_inputs(plan, src, CalibrationData(other, "file calib.txt", 2, False)))
    assert key != resume_key(_resume_inputs(dataclasses.replace(plan, device="cuda"), src, data))
