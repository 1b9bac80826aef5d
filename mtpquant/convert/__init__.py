"""``convert``: a BF16 checkpoint to NVFP4 through nvidia-modelopt, with its MTP kept, quantized, extracted or dropped
(``run.convert``). ``plan`` decides everything from headers; ``model`` is transformers + modelopt; ``assemble`` the
output shards; ``resume`` the layer-wise resume state; ``offload`` the fused-expert loader; ``ct_format`` the
compressed-tensors output. The recipes (``mtpquant.recipes``), calibration data (``mtpquant.text``) and memory
planner (``mtpquant.runtime.memory``) are shared with heal.

Importing this package is light: ``run.convert`` imports torch, transformers and modelopt when it runs.
"""
