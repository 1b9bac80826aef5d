"""Validation: acceptance and distribution metrics for an MTP head before and after quantization."""
