"""Qwen's built-in MTP layer: the reference forward used for calibration and validation."""

from mtpquant.mtp.drafting import (
    DraftResult,
    TeacherForcedResult,
    draft_chain,
    draft_rows,
    mtp_logits,
    teacher_forced,
)
from mtpquant.mtp.module import KVCache, MtpConfig, MtpLayer, MtpLayoutError, mtp_tensor_shapes

__all__ = [
    "DraftResult",
    "KVCache",
    "MtpConfig",
    "MtpLayer",
    "MtpLayoutError",
    "TeacherForcedResult",
    "draft_chain",
    "draft_rows",
    "mtp_logits",
    "mtp_tensor_shapes",
    "teacher_forced",
]
