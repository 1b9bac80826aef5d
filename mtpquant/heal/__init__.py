"""``heal``: re-align a quant's MTP to its own quantized target by self-distillation, written back only when better
beyond noise (``run.heal``). ``options`` and ``support`` (what heal can heal, decided torch-free) come first;
``plan`` (headers only), ``data`` (the target's continuations and hidden states), ``qat`` + ``train`` (the MTP
trained, fake-quantized where QUANT's MTP is quantized), ``precision`` (QUANT's MTP layout in and out), ``check``
(held-out AL before and after, through ``mtpquant.measure``), ``write`` (the graft way, ``mtpquant.surgery``).
"""
