"""Validation: acceptance and distribution metrics for an MTP head before and after quantization."""

# Kept here, free of torch, so the CLI can offer the choices without importing torch at start-up.
ACTIVATION_MODES = ("off", "emulate")
