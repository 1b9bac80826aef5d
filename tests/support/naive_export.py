"""The pipeline mtpquant exists to fix, reproduced: load with transformers, quantize, export.

transformers skips ``mtp.*`` on load, so the export has no MTP while config.json still declares
it. Tests use these real modelopt exports as "quants that lost their MTP".
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def naive_modelopt_export(src: Path, out: Path, seed: int = 0) -> Path:
    """Quantize ``src`` to NVFP4 with modelopt's defaults and export it (MTP lost)."""
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint

    from mtpquant.checkpoint.table import Checkpoint

    ckpt = Checkpoint.open(src)
    model = getattr(transformers, ckpt.spec.architecture).from_pretrained(src, dtype=torch.bfloat16)
    vocab = int(ckpt.spec.text.get("vocab_size", 512))

    def loop(m: torch.nn.Module) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(2):
            m(input_ids=torch.randint(0, vocab, (1, 32), generator=gen))

    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, loop)
    export_hf_checkpoint(model, export_dir=str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copyfile(src / name, out / name)
    return out


if __name__ == "__main__":  # python -m tests.support.naive_export SRC OUT (the README's inspect example)
    import sys

    print(naive_modelopt_export(Path(sys.argv[1]), Path(sys.argv[2])))
