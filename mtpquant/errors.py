"""Every error type a user can see, and the one exit-code table.

Each user-facing failure is an ``MtpquantError``, defined here: one line naming the file, tensor, repo or server
and what is wrong. The CLI prints ``str(error)`` and exits with ``error.exit_code``; each cause has its own code
(``ExitCode``), documented in docs/architecture.md and ``mtpquant --help``. (Internal exceptions that never leave
mtpquant, such as ``safejson.JsonLimitError`` or ``nethttp.BoundExceededError``, are caught where they are raised and
become one of these.)
"""
from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum, unique

__all__ = [
    "BaseModelError",
    "CalibrationDataError",
    "CheckpointError",
    "ConfigError",
    "DeviceError",
    "EngineAnswerError",
    "EngineModelError",
    "EngineSpecDecodeError",
    "EngineStartError",
    "EngineUnreachableError",
    "ExitCode",
    "FilesystemError",
    "GraftError",
    "HealNotBetterError",
    "HealRefusedError",
    "HiddenFileError",
    "HubAccessError",
    "HubRefusedError",
    "HubUnreachableError",
    "IndivisibleDimensionError",
    "LineageError",
    "MemoryPlanError",
    "MtpConfigError",
    "MtpModeError",
    "MtpNeverShippedError",
    "MtpquantError",
    "NotAnMtpError",
    "OutputBusyError",
    "OutputExistsError",
    "OutputVerificationError",
    "PublishRefusedError",
    "PublishUsageError",
    "RangeIgnoredError",
    "RecipeError",
    "ReplayError",
    "SourceQuantizedError",
    "TuneRefusedError",
    "UnsupportedArchitectureError",
    "UploadError",
    "UsageError",
    "ValidateError",
    "ValidateLoadError",
    "exit_code_table",
]


@unique
class ExitCode(IntEnum):
    """Process exit codes, one per cause."""

    OK = 0
    INTERNAL = 1  # an unexpected error (a bug): reported with its type
    USAGE = 2  # a bad flag, option, recipe, calibration data or device
    CHECKPOINT = 3  # a checkpoint is malformed or its config is missing / contradicts its tensors
    ARCHITECTURE = 4  # not one of the supported Qwen families
    OUTPUT_EXISTS = 5  # the output exists (or is the source) and may not be replaced
    MTP_MODE = 6  # the MTP mode needs an MTP the source does not have
    INDIVISIBLE = 7  # a Linear to quantize has an input dimension that is not a multiple of 16
    VERIFICATION = 8  # the finished output failed its own verification (nothing was put in place)
    LINEAGE = 9  # graft: SRC and QUANT (validate: REFERENCE and CANDIDATE) are not the same model
    INSPECT_MTP = 10  # inspect: MTP declared but missing / incomplete / present but undeclared
    INSPECT_EXCLUSIONS = 11  # inspect: exclusions disagree with the tensors (an engine will fail to load)
    INSPECT_INDEX = 12  # inspect: index corrupt (what loaders enforce)
    PUBLISH_REFUSED = 13  # publish: checks failed, a secret in a file, nothing publishable
    UPLOAD = 14  # publish: the Hub refused the upload
    SOURCE_QUANTIZED = 15  # convert: the source is already quantized
    GRAFT_REFUSED = 16  # graft: an existing different MTP, an unusable SRC MTP, an unsupported layout; graft, heal
    # and convert --heal (at its plan): an in-place write on a filesystem that cannot exchange directories
    VALIDATE_WARN = 17  # validate: acceptance dropped more than allowed
    VALIDATE_FAIL = 18  # validate: the MTP is missing or broken (acceptance ~0)
    IO = 19  # the operating system refused: disk full, permissions, ... (nothing half-written)
    INSPECT_FORMAT = 20  # inspect: an engine refuses the checkpoint's quantization format outright
    OUTPUT_BUSY = 21  # another mtpquant run is writing the same output (its pid is named)
    MEMORY = 22  # convert: the model cannot be placed under the memory caps (the needed and available sizes are named)
    VALIDATE_INCONCLUSIVE = 23  # validate: too few prompts to decide (how many would settle it is named)
    HEAL_NOT_BETTER = 24  # heal: the healed MTP is not better beyond noise on held-out prompts (nothing written)
    VALIDATE_BROKEN = 25  # validate: the candidate is broken (non-finite logits, main model disagrees, AL rises)
    MTP_NEVER_SHIPPED = 26  # the family declares an MTP its publisher never shipped (MiniMax-M2): nothing to repair
    HEAL_REFUSED = 27  # heal (convert --heal: at its plan): QUANT's MTP is missing, incomplete, of a family heal does
    # not train, or unwritable
    NOT_AN_MTP = 28  # the drafter is not an MTP mtpquant repairs (DeepSeek-V4.1's DSpark; DeepSeek-V4: recognised only)
    TUNE_REFUSED = 29  # tune-mtp: QUANT is not a local ModelOpt NVFP4 quant, or no quantized MTP configuration loads
    HUB_UNREACHABLE = 30  # the Hub (or mirror) cannot be reached or timed out
    HUB_ACCESS = 31  # the repo, revision or file does not exist, or is gated / private / needs a token
    HUB_REFUSED = 32  # the Hub refused the request or rate-limited it beyond the retries
    ENGINE_UNREACHABLE = 40  # the engine server cannot be reached
    ENGINE_ANSWER = 41  # the server is none of the engine table's, or answered something unexpected
    ENGINE_MODEL = 42  # the server serves another model than asked
    ENGINE_SPEC_DECODE = 43  # no MTP-chain speculative decoding: none, another drafter, a tree, adaptive k
    ENGINE_START = 44  # the engine server failed to start (its log is named)
    INTERRUPTED = 130  # Ctrl-C: nothing left behind


_MEANING = {
    ExitCode.OK: "success (inspect: healthy; validate: pass)",
    ExitCode.INTERNAL: "unexpected internal error",
    ExitCode.USAGE: "bad flag, option, recipe, calibration data or device",
    ExitCode.CHECKPOINT: "malformed checkpoint, or config missing / contradicting the tensors",
    ExitCode.ARCHITECTURE: "unsupported architecture",
    ExitCode.OUTPUT_EXISTS: "output exists (or is the source)",
    ExitCode.MTP_MODE: "MTP mode does not fit the source",
    ExitCode.INDIVISIBLE: "a Linear's input dimension is not a multiple of 16",
    ExitCode.VERIFICATION: "the finished output failed verification; nothing was put in place",
    ExitCode.LINEAGE: "graft: SRC and QUANT (validate: REFERENCE and CANDIDATE) are not the same model",
    ExitCode.INSPECT_MTP: "inspect: MTP declared but missing, incomplete, or present but undeclared",
    ExitCode.INSPECT_EXCLUSIONS: "inspect: exclusions disagree with the tensors",
    ExitCode.INSPECT_INDEX: "inspect: index corrupt",
    ExitCode.PUBLISH_REFUSED: "publish refused (checks failed, a secret in a file, nothing to publish)",
    ExitCode.UPLOAD: "the Hub refused the upload",
    ExitCode.SOURCE_QUANTIZED: "convert: the source is already quantized",
    ExitCode.GRAFT_REFUSED: "graft refused (different MTP present, unusable SRC MTP)",
    ExitCode.VALIDATE_WARN: "validate: acceptance dropped more than allowed",
    ExitCode.VALIDATE_FAIL: "validate: MTP missing or broken",
    ExitCode.IO: "operating-system error (disk full, permissions)",
    ExitCode.INSPECT_FORMAT: "inspect: an engine refuses the quantization format",
    ExitCode.OUTPUT_BUSY: "another mtpquant run is writing the same output (its pid is named)",
    ExitCode.MEMORY: "convert: the model does not fit under the memory caps",
    ExitCode.VALIDATE_INCONCLUSIVE: "validate: inconclusive, the sample is too small to decide",
    ExitCode.HEAL_NOT_BETTER: "heal: the healed MTP is not better beyond noise; nothing written",
    ExitCode.VALIDATE_BROKEN: "validate: the candidate is broken (non-finite, disagreeing, or AL too high)",
    ExitCode.MTP_NEVER_SHIPPED: "MTP declared but never shipped by its publisher (MiniMax-M2): nothing to repair",
    ExitCode.HEAL_REFUSED: "heal refused (MTP missing, incomplete, or in a format heal cannot write)",
    ExitCode.NOT_AN_MTP: "not an MTP mtpquant repairs (DeepSeek-V4.1's DSpark drafter; DeepSeek-V4 recognised only)",
    ExitCode.TUNE_REFUSED: "tune-mtp refused (QUANT not a local ModelOpt NVFP4 quant, nothing to choose from)",
    ExitCode.HUB_UNREACHABLE: "Hub unreachable or timed out",
    ExitCode.HUB_ACCESS: "Hub repo/file not found, gated, private, or bad token",
    ExitCode.HUB_REFUSED: "Hub refused the request or rate-limited it",
    ExitCode.ENGINE_UNREACHABLE: "engine server unreachable",
    ExitCode.ENGINE_ANSWER: "not a vLLM or SGLang server, or an unexpected answer",
    ExitCode.ENGINE_MODEL: "the server serves another model",
    ExitCode.ENGINE_SPEC_DECODE: "the server does not draft with the MTP as a k-step chain (none, a tree, ...)",
    ExitCode.ENGINE_START: "the engine server failed to start",
    ExitCode.INTERRUPTED: "interrupted",
}


def exit_code_table(codes: Iterable[ExitCode] | None = None) -> str:
    """The exit codes as ``--help`` prints them: all of them, or those of one command (in the table's order)."""
    chosen = set(ExitCode if codes is None else codes)
    return "\n".join(f"  {int(code):>3}  {_MEANING[code]}" for code in ExitCode if code in chosen)


class MtpquantError(Exception):
    """Base class; the CLI prints ``str(error)`` as one line and exits with ``exit_code``."""

    exit_code: int = ExitCode.INTERNAL


class UsageError(MtpquantError):
    """A flag or option is invalid, or options contradict each other."""

    exit_code = ExitCode.USAGE


class RecipeError(UsageError):
    """A recipe is unknown, malformed, has an unknown key, or does not fit the source family."""


class CalibrationDataError(UsageError):
    """Calibration data cannot be read or tokenised."""


class DeviceError(UsageError):
    """The requested device is not available."""


class ValidateError(UsageError):
    """Validation cannot run (bad options, mismatched hidden-state file, ...)."""


class HiddenFileError(UsageError):
    """A file given as --hidden is not a hidden-state file (or does not fit the checkpoint)."""


class ReplayError(UsageError):
    """Nothing to evaluate (no sequence long enough to draft on)."""


class CheckpointError(MtpquantError):
    """A checkpoint is malformed: bad header, bad index, missing shard, refused pickle, ..."""

    exit_code = ExitCode.CHECKPOINT


class ValidateLoadError(CheckpointError):
    """A checkpoint cannot be loaded for evaluation (unknown quantization layout, bad shapes, ...)."""


class ConfigError(MtpquantError):
    """A config is missing, unreadable or contradicts the tensors."""

    exit_code = ExitCode.CHECKPOINT


class MtpConfigError(ConfigError, ValueError):
    """The config describes an MTP the reference forward cannot compute (raised at plan time, before any load)."""


class UnsupportedArchitectureError(MtpquantError):
    """The checkpoint is not one of the supported Qwen families."""

    exit_code = ExitCode.ARCHITECTURE


class OutputExistsError(MtpquantError):
    """The output path exists (and ``--overwrite`` was not given), or is the source."""

    exit_code = ExitCode.OUTPUT_EXISTS


class OutputBusyError(MtpquantError):
    """Another live mtpquant run holds the output's lock (the message names its pid)."""

    exit_code = ExitCode.OUTPUT_BUSY


class FilesystemError(MtpquantError):
    """The operating system refused a write (disk full, quota, permissions): the message names the file being written
    (or the output) and, when space ran out, its filesystem; nothing was put in place."""

    exit_code = ExitCode.IO


class MemoryPlanError(MtpquantError):
    """The model cannot be placed under the memory caps (or the caps leave no room for one layer)."""

    exit_code = ExitCode.MEMORY


class MtpModeError(MtpquantError):
    """The requested MTP mode needs an MTP the source does not have (or has only in part)."""

    exit_code = ExitCode.MTP_MODE


class MtpNeverShippedError(MtpquantError):
    """The family declares an MTP whose weights its publisher never released (MiniMax-M2): nothing to graft or fix."""

    exit_code = ExitCode.MTP_NEVER_SHIPPED


class NotAnMtpError(MtpquantError):
    """The checkpoint's drafter is not an MTP mtpquant repairs: another kind of drafter under the MTP's names
    (DeepSeek-V4.1's DSpark), or an MTP mtpquant recognises without modelling (DeepSeek-V4)."""

    exit_code = ExitCode.NOT_AN_MTP


class IndivisibleDimensionError(MtpquantError):
    """A Linear the recipe quantizes has an input dimension that is not a multiple of the block size."""

    exit_code = ExitCode.INDIVISIBLE


class OutputVerificationError(MtpquantError):
    """The output failed verification (inspect verdict, index, tensor set) and was not published."""

    exit_code = ExitCode.VERIFICATION


class LineageError(MtpquantError):
    """SRC and QUANT are not the same model (architecture, dimensions or MTP shapes differ)."""

    exit_code = ExitCode.LINEAGE


class SourceQuantizedError(MtpquantError):
    """The source is already quantized; convert needs the BF16 checkpoint."""

    exit_code = ExitCode.SOURCE_QUANTIZED


class GraftError(MtpquantError):
    """graft refuses: SRC's MTP unusable, QUANT already has a different one, an unsupported layout."""

    exit_code = ExitCode.GRAFT_REFUSED


class HealNotBetterError(MtpquantError):
    """heal: the healed MTP is not better than QUANT's beyond noise on held-out prompts; nothing was written."""

    exit_code = ExitCode.HEAL_NOT_BETTER


class HealRefusedError(MtpquantError):
    """heal refuses: QUANT's MTP is missing or incomplete, or stored in a format heal cannot write back."""

    exit_code = ExitCode.HEAL_REFUSED


class TuneRefusedError(MtpquantError):
    """tune-mtp refuses: QUANT is not a local ModelOpt NVFP4 quant, or the engines load no quantized MTP of it."""

    exit_code = ExitCode.TUNE_REFUSED


class PublishRefusedError(MtpquantError):
    """publish refuses: OUT is not publishable (checks failed, a secret in a file, nothing to upload)."""

    exit_code = ExitCode.PUBLISH_REFUSED


class UploadError(MtpquantError):
    """The Hub refused the upload."""

    exit_code = ExitCode.UPLOAD


class HubUnreachableError(MtpquantError):
    """The Hub (or the mirror in HF_ENDPOINT) cannot be reached, or did not answer in time."""

    exit_code = ExitCode.HUB_UNREACHABLE


class HubAccessError(MtpquantError):
    """The repo, revision or file does not exist, or is gated / private / needs a (valid) token."""

    exit_code = ExitCode.HUB_ACCESS


class BaseModelError(UsageError):
    """``--base-model`` is not a Hub model id (or ``--base-model-revision`` is not a revision)."""


class PublishUsageError(UsageError):
    """publish's options are malformed: a repo id the Hub would refuse, ``--create-pr`` with a branch, ..."""


class HubRefusedError(MtpquantError):
    """The Hub refused the request (an error status, an answer that is not what it should be, rate limits)."""

    exit_code = ExitCode.HUB_REFUSED


class EngineUnreachableError(MtpquantError):
    """The engine server cannot be reached."""

    exit_code = ExitCode.ENGINE_UNREACHABLE


class EngineAnswerError(MtpquantError):
    """The server is neither a vLLM nor an SGLang server, or answered something unexpected."""

    exit_code = ExitCode.ENGINE_ANSWER


class EngineModelError(MtpquantError):
    """The server serves another model than the one asked for."""

    exit_code = ExitCode.ENGINE_MODEL


class EngineSpecDecodeError(MtpquantError):
    """The server does not draft with the checkpoint's MTP as a k-step chain: no speculative decoding (counters
    absent or still), another drafter, a draft tree, or a k that changes as it runs."""

    exit_code = ExitCode.ENGINE_SPEC_DECODE


class EngineStartError(MtpquantError):
    """The engine server failed to start (the message names its log)."""

    exit_code = ExitCode.ENGINE_START


class RangeIgnoredError(HubRefusedError):
    """The server answered a ranged read with the whole file (it ignores ``Range``)."""
