"""Quantize one checkpoint with a peer tool, the way that tool's own docs do it (runs in the peers' venv).

Called by ``scripts/make_peer_fixtures.py`` with the peers' python (llm-compressor, compressed-tensors,
AutoRound and their transformers pin); it never imports mtpquant. Usage:

    python quantize.py TOOL SRC OUT CALIB

TOOL is one of:
- ``llmcompressor-nvfp4``: ``oneshot`` with ``QuantizationModifier(scheme="NVFP4", ignore=["lm_head"])``,
  calibrated on CALIB (a .txt of paragraphs); llm-compressor keeps the MTP itself
  (compressed-tensors ``save_mtp_tensors_to_checkpoint``);
- ``autoround-nvfp4-llmc``: AutoRound RTN (``iters=0``), scheme NVFP4, ``format="llm_compressor"``;
  AutoRound copies missing tensors back (``copy_missing_tensors_from_source``);
- ``autoround-nvfp4-native``: the same in AutoRound's own ``auto_round`` format.

Writes ``OUT/peer_versions.json`` with the versions that made it.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

CALIB_SAMPLES = 16
CALIB_SEQ_LEN = 128


def _calibration_texts(calib: Path) -> list[str]:
    """Paragraphs of CALIB joined into chunks long enough for a full row of CALIB_SEQ_LEN tokens."""
    chunks, current = [], ""
    for para in calib.read_text(encoding="utf-8").split("\n\n"):
        current = f"{current}\n\n{para}" if current else para
        if len(current) >= 8 * CALIB_SEQ_LEN:
            chunks.append(current)
            current = ""
    return chunks[: CALIB_SAMPLES * 2]


def _load(src: Path):  # type: ignore[no-untyped-def]
    import torch
    import transformers

    config = json.loads((src / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    model = cls.from_pretrained(str(src), dtype=torch.bfloat16)
    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    return model, tok


def llmcompressor_nvfp4(src: Path, out: Path, calib: Path) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model, tok = _load(src)
    rows = [tok(t, truncation=True, max_length=CALIB_SEQ_LEN) for t in _calibration_texts(calib)]
    rows = [r for r in rows if len(r["input_ids"]) >= 8][:CALIB_SAMPLES]
    ds = Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "attention_mask": [r["attention_mask"] for r in rows]}
    )
    # the ignore list of llm-compressor's own Qwen3.5 NVFP4 example (examples/quantization_w4a4_fp4)
    ignore = [
        "re:.*lm_head",
        "re:visual.*",
        "re:model.visual.*",
        "re:.*mlp.gate$",
        "re:.*embed_tokens$",
        "re:.*shared_expert_gate$",
    ]
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=ignore)
    oneshot(
        model=model,
        processor=tok,
        dataset=ds,
        recipe=recipe,
        max_seq_length=CALIB_SEQ_LEN,
        num_calibration_samples=len(rows),
        pipeline="basic",
    )
    model.save_pretrained(str(out), save_compressed=True)
    tok.save_pretrained(str(out))


def _autoround(src: Path, out: Path, calib: Path, fmt: str) -> None:
    from auto_round import AutoRound

    # a model path, as AutoRound's README does: it loads the model (and its MTP source files) itself
    # RTN (iters=0); the W4A4 activation scales still come from calibration text (a list of strings)
    ar = AutoRound(
        str(src),
        scheme="NVFP4",
        iters=0,
        device_map="cpu",
        dataset=_calibration_texts(calib),
        nsamples=CALIB_SAMPLES,
        seqlen=CALIB_SEQ_LEN,
    )
    ar.quantize_and_save(str(out / "autoround"), format=fmt)
    # AutoRound saves into OUT/autoround/<model-name>-<scheme>/: lift that directory's files into OUT
    (inner,) = (out / "autoround").iterdir()
    for f in inner.iterdir():
        f.rename(out / f.name)
    inner.rmdir()
    (out / "autoround").rmdir()


TOOLS = {
    "llmcompressor-nvfp4": llmcompressor_nvfp4,
    "autoround-nvfp4-llmc": lambda s, o, c: _autoround(s, o, c, "llm_compressor"),
    "autoround-nvfp4-native": lambda s, o, c: _autoround(s, o, c, "auto_round"),
}
PACKAGES = ("llmcompressor", "compressed-tensors", "auto-round", "transformers", "torch")


def main(argv: list[str]) -> int:
    tool, src, out, calib = argv[1], Path(argv[2]), Path(argv[3]), Path(argv[4])
    TOOLS[tool](src, out, calib)
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = version(pkg)
        except Exception:
            versions[pkg] = None
    (out / "peer_versions.json").write_text(json.dumps({"tool": tool, "versions": versions}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
