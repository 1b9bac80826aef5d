"""Errors that ``convert`` raises before (or instead of) writing anything; each is one line.

Exit codes extend ``mtpquant.errors`` (1 generic, 3 checkpoint/config, 4 architecture, 5 output
exists): 2 usage (recipe, calibration data), 6 the MTP mode does not fit the source, 7 a Linear
cannot be quantized, 8 the finished output failed its own verification.
"""

from __future__ import annotations

from mtpquant.errors import MtpquantError

__all__ = [
    "CalibrationDataError",
    "DeviceError",
    "IndivisibleDimensionError",
    "MtpModeError",
    "OutputVerificationError",
    "RecipeError",
    "SourceQuantizedError",
]


class RecipeError(MtpquantError):
    """A recipe is unknown, malformed, has an unknown key, or does not fit the source family."""

    exit_code = 2


class CalibrationDataError(MtpquantError):
    """Calibration data cannot be read or tokenised."""

    exit_code = 2


class MtpModeError(MtpquantError):
    """The requested MTP mode needs an MTP the source does not have (or has only in part)."""

    exit_code = 6


class SourceQuantizedError(MtpquantError):
    """The source is already quantized; convert needs the BF16 checkpoint."""

    exit_code = 6


class IndivisibleDimensionError(MtpquantError):
    """A Linear the recipe quantizes has an input dimension that is not a multiple of the block size."""

    exit_code = 7


class OutputVerificationError(MtpquantError):
    """The output failed verification (inspect verdict, index, tensor set) and was not published."""

    exit_code = 8


class DeviceError(MtpquantError):
    """The requested device is not available."""

    exit_code = 2
