"""``mtpquant tune-mtp``: an existing quant's MTP re-quantized per precision group, as ``convert --mtp auto``
chooses."""
