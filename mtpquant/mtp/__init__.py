"""Qwen's built-in MTP layer: the reference forward used for calibration and validation."""

from mtpquant.mtp.module import (
    DraftResult,
    KVCache,
    MtpConfig,
    MtpLayer,
    MtpLayoutError,
    TeacherForcedResult,
    draft_chain,
    mtp_logits,
    mtp_tensor_shapes,
    teacher_forced,
)

__all__ = [
    "DraftResult",
    "KVCache",
    "MtpConfig",
    "MtpLayer",
    "MtpLayoutError",
    "TeacherForcedResult",
    "draft_chain",
    "mtp_logits",
    "mtp_tensor_shapes",
    "teacher_forced",
]
