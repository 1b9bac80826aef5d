"""Validation: acceptance and distribution metrics for an MTP head before and after quantization."""

# Kept here, free of torch, so the CLI can offer the choices without importing torch at start-up.
ACTIVATION_MODES = ("off", "emulate")

# The report directory inside a checkpoint (``validate ... --report-dir OUT/validation``): the card reads it and
# publish uploads it, except its ``logs/`` (the engine's server logs name local paths and ports). It describes the
# checkpoint it was measured on, so graft and heal do not carry it into the checkpoint they change.
REPORT_DIR = "validation"
LOGS_DIR = "logs"
