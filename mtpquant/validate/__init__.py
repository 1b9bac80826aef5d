"""``mtpquant validate``: MTP draft acceptance before and after quantization, built in or through an engine."""
