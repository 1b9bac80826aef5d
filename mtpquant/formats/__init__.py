"""Tensor formats: NVFP4 (ModelOpt and compressed-tensors layouts), FP8, and checkpoint quant metadata."""
