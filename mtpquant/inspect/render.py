"""Human-readable form of an InspectReport: a compact table, then verdicts and findings."""

from __future__ import annotations

from mtpquant.inspect.report import InspectReport
from mtpquant.units import format_bytes

__all__ = ["render_text"]


def render_text(r: InspectReport) -> str:
    """The report as a compact text table."""
    q = r.quantization
    main = r.main_model
    rows = [
        ("checkpoint", r.checkpoint),
        ("family", f"{r.family} ({r.architecture})"),
        ("MTP declared", r.mtp_declaration),
        (
            "MTP present",
            f"{r.mtp_present_tensors}/{r.mtp_expected_tensors} tensors, {format_bytes(r.mtp_bytes)}"
            + (f" in {', '.join(r.mtp_shards)}" if r.mtp_shards else ""),
        ),
        ("MTP precision", r.mtp_precision),
        (
            "quantization",
            "none"
            if q["method"] is None
            else f"{q['method']} {q['algorithm']} (vLLM: {q['vllm_method']}), group {q['group_size']}, "
            f"KV cache {q['kv_cache'] or 'unquantized'}",
        ),
        (
            "main Linears",
            f"{main['quantized']} quantized, {main['unquantized']} unquantized "
            + ", ".join(f"{k}: {v}" for k, v in main["precisions"].items()),
        ),
        (
            "vision tower",
            ("present, " + ", ".join(f"{k}: {v}" for k, v in r.vision["precisions"].items()))
            if r.vision["present"]
            else ("MISSING" if r.vision["expected"] else "none (text-only)"),
        ),
        (
            "index",
            f"{r.index['shards']} shards, {r.index['tensors']} tensors, "
            + ("intact" if r.index["intact"] else "CORRUPT"),
        ),
        ("read", f"{format_bytes(r.bytes_fetched)} of {format_bytes(r.checkpoint_bytes)} in {r.seconds:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if r.mtp_modules:
        lines.append("")
        lines.append(f"{'MTP module (as vLLM builds it)'.ljust(44)} {'on disk'.ljust(10)} {'vLLM builds'.ljust(12)} ok")
        for m in r.mtp_modules:
            built = "refused" if m.vllm_quantized is None else ("quantized" if m.vllm_quantized else "unquantized")
            ok = "yes" if m.consistent else "NO: " + m.reason
            lines.append(f"{m.module.ljust(44)} {m.disk.ljust(10)} {built.ljust(12)} {ok}")
    if r.mtp_missing:
        lines.append(
            f"missing MTP tensors: {', '.join(r.mtp_missing[:5])}" + (" ..." if len(r.mtp_missing) > 5 else "")
        )
    if r.mtp_unexpected:
        lines.append(
            f"unexpected MTP tensors: {', '.join(r.mtp_unexpected[:5])}" + (" ..." if len(r.mtp_unexpected) > 5 else "")
        )
    lines.append("")
    names = {"vllm": "vLLM", "sglang": "SGLang"}
    lines += [
        v if v.lower().startswith(engine) else f"{names.get(engine, engine)}: {v}" for engine, v in r.verdicts.items()
    ]
    for f in r.failures:
        lines.append(f"FAIL  {f.message}")
    for f in r.warnings:
        lines.append(f"WARN  {f.message}")
    if r.serve_commands:
        lines.append("")
        lines += [f"serve ({names.get(engine, engine)}): {cmd}" for engine, cmd in r.serve_commands.items()]
    lines.append("")
    lines.append("verdict: healthy" if r.healthy else f"verdict: {len(r.failures)} problem(s)")
    return "\n".join(lines)
