"""``convert``: a BF16 Qwen checkpoint to NVFP4 through nvidia-modelopt, with its MTP kept, quantized, extracted
or dropped (``run.convert``). ``plan`` decides everything from headers; ``recipes`` are the validated YAML
recipes; ``model`` is transformers + modelopt; ``calibration`` the data; ``assemble`` the output shards.

Importing this package is light: ``run.convert`` imports torch, transformers and modelopt when it runs.
"""
