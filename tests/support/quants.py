"""Hand-made quant variants for inspect tests: add an MTP to an export with chosen metadata."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from mtpquant.checkpoint.table import Checkpoint


def with_mtp(
    quant: Path,
    src: Path,
    out: Path,
    *,
    exclude_add: Sequence[str] = ("mtp*",),
    mtp_tensors: dict[str, Any] | None = None,
    ct_ignore: Sequence[str] | None = None,
) -> Path:
    """Copy ``quant`` to ``out`` plus the MTP of ``src`` (or ``mtp_tensors``) in its own shard.

    ``exclude_add`` is appended to both exclusion lists; ``ct_ignore`` rewrites the metadata
    into compressed-tensors form with that ignore list.
    """
    shutil.copytree(quant, out)
    if mtp_tensors is None:
        ckpt = Checkpoint.open(src)
        mtp_tensors = {e.name: ckpt.read_tensor(e.name) for e in ckpt.mtp_tensors()}
    save_file(mtp_tensors, out / "mtp.safetensors", metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        names = load_file(out / "model.safetensors").keys()
        index = {"metadata": {"total_size": 0}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    for name in mtp_tensors:
        index["weight_map"][name] = "mtp.safetensors"
    ckpt_total = 0
    for shard in set(index["weight_map"].values()):
        for t in load_file(out / shard).values():
            ckpt_total += t.numel() * t.element_size()
    index["metadata"]["total_size"] = ckpt_total
    index_path.write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    hfq = json.loads((out / "hf_quant_config.json").read_text())
    hfq["quantization"]["exclude_modules"] += list(exclude_add)
    config["quantization_config"]["ignore"] += list(exclude_add)
    if ct_ignore is not None:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}}
            },
            "ignore": list(ct_ignore),
        }
        (out / "hf_quant_config.json").unlink()
    else:
        (out / "hf_quant_config.json").write_text(json.dumps(hfq))
    (out / "config.json").write_text(json.dumps(config))
    return out
