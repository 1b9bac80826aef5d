"""Error types: every user-facing failure is one line naming the file or tensor and what is wrong."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "MtpquantError",
    "OutputExistsError",
    "UnsupportedArchitectureError",
]


class MtpquantError(Exception):
    """Base class; the CLI prints ``str(error)`` as one line and exits with ``exit_code``."""

    exit_code = 1


class CheckpointError(MtpquantError):
    """A checkpoint is malformed: bad header, bad index, missing shard, refused pickle, ..."""

    exit_code = 3


class ConfigError(MtpquantError):
    """A config is missing, unreadable or contradicts the tensors."""

    exit_code = 3


class UnsupportedArchitectureError(MtpquantError):
    """The checkpoint is not one of the supported Qwen families."""

    exit_code = 4


class OutputExistsError(MtpquantError):
    """The output path exists and ``--overwrite`` was not given."""

    exit_code = 5
