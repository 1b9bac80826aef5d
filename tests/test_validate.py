"""validate: greedy replay arithmetic, chained drafting from the cache, loaders, hidden files, report, CLI.

Fast tests on hand-made data and the random-weight tiny checkpoints; the trained model, ``convert``
and the before/after verdicts are in ``test_validate_tiny.py``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main
from mtpquant.errors import ExitCode, ValidateError
from mtpquant.formats.fp8 import quantize_fp8_per_tensor
from mtpquant.formats.nvfp4 import (
    dequantize_nvfp4,
    input_scale_from_amax,
    quantize_nvfp4,
    to_compressed_tensors,
)
from mtpquant.measure.drafter import MtpBundle, load_mtp
from mtpquant.measure.metrics import StepRecord, acceptance_stats
from mtpquant.measure.replay import SequenceRecord, TargetRun, evaluate_acceptance, replay_greedy
from mtpquant.measure.target import capture, load_target
from mtpquant.measure.weights import CheckpointWeights
from mtpquant.mtp.drafting import draft_chain
from mtpquant.mtp.module import KVCache, MtpConfig, MtpLayer
from mtpquant.public import public_checkpoint
from mtpquant.records.acceptance import Acceptance, AcceptanceRow
from mtpquant.records.sampling import SamplingSettings
from mtpquant.records.table import acceptance_table
from mtpquant.records.validation import (
    Agreement,
    Comparison,
    EngineInfo,
    KlSummary,
    MtpInfo,
    Report,
    Settings,
    Side,
    ValidationReport,
    Verdict,
    sides,
)
from mtpquant.render import acceptance_text
from mtpquant.text.prompts import (
    default_prompts,
    held_out_documents,
    load_prompts,
    plan_sequences,
    training_documents,
)
from mtpquant.validate.report import _acceptance_plot, render_markdown, write_report
from mtpquant.validate.run import ValidateOptions, validate

pytestmark = pytest.mark.dev

CPU = torch.device("cpu")


# ---- greedy replay on hand-computed examples ------------------------------------------------------
# tokens[0:2] is the prompt; the rest is the target's own greedy continuation.
TOKENS = [10, 11, 12, 13, 14, 15, 16, 17]
DRAFTS = {1: [13, 99, 15], 3: [15, 16, 17], 5: [42, 17, 0]}


def _drafts(t: int, n: int) -> list[int]:
    return DRAFTS[t][:n]


def test_replay_greedy_k1() -> None:
    # t=1 drafts 13 (= tokens[3]) ok -> t=3; 15 ok -> t=5; 42 != 17 -> t=6; nothing left to verify.
    records = replay_greedy(TOKENS, 2, 1, _drafts)
    # each step's context: the tokens known when it drafts from row t (tokens[0..t+1])
    assert records == [StepRecord(1, 1, context=3), StepRecord(1, 1, context=5), StepRecord(1, 0, context=7)]
    stats = acceptance_stats(records)
    assert stats.mean_acceptance_length == pytest.approx(1 + 2 / 3)
    assert stats.acceptance_rate == pytest.approx(2 / 3)


def test_replay_greedy_k2() -> None:
    # t=1: [13, 99] vs [13, 14] -> 1 accepted, t=3; [15, 16] vs [15, 16] -> 2, t=6; stop.
    records = replay_greedy(TOKENS, 2, 2, _drafts)
    assert records == [StepRecord(2, 1, context=3), StepRecord(2, 2, context=5)]
    stats = acceptance_stats(records)
    assert stats.mean_acceptance_length == 2.5
    assert stats.acceptance_per_position == (1.0, 0.5)


def test_replay_greedy_k3_truncates_at_the_end() -> None:
    # t=1: [13, 99, 15] -> 1 accepted (15 after a miss does not count), t=3; 3 left: all accepted.
    records = replay_greedy(TOKENS, 2, 3, _drafts)
    assert [(r.drafted, r.accepted) for r in records] == [(3, 1), (3, 3)]
    assert acceptance_stats(records).mean_acceptance_length == 3.0
    # Fewer tokens than k left to verify: the last step drafts only what can be checked.
    assert [(r.drafted, r.accepted) for r in replay_greedy(TOKENS[:7], 2, 3, _drafts)] == [(3, 1), (2, 2)]


def test_replay_greedy_drafts_k_at_the_last_steps_as_vllm_does() -> None:
    # vLLM (0.32, v1/core/sched/scheduler.py) schedules the full k drafts at a request's last steps and counts what
    # verification accepts before the output is cut at max_tokens. The request ends at 7 tokens (max_tokens 5); the
    # target's lookahead (token 17) verifies the third draft of the step from t=3: [15, 16, 17] all accepted.
    assert [(r.drafted, r.accepted) for r in replay_greedy(TOKENS, 2, 3, _drafts, end=7)] == [(3, 1), (3, 3)]
    # without the lookahead the same request drafted 2 at its last step and the engine's third acceptance was lost
    assert [(r.drafted, r.accepted) for r in replay_greedy(TOKENS[:7], 2, 3, _drafts)] == [(3, 1), (2, 2)]
    # steps stop where the request has max_tokens, not where the lookahead ends: end=6 stops after t=3's step
    assert [(r.drafted, r.accepted) for r in replay_greedy(TOKENS, 2, 1, _drafts, end=6)] == [(1, 1), (1, 1)]


def test_replay_greedy_too_short() -> None:
    assert replay_greedy([1, 2, 3], 2, 1, _drafts) == []
    with pytest.raises(ValueError):
        replay_greedy(TOKENS, 0, 1, _drafts)


# ---- chained drafting from the teacher-forced cache ----------------------------------------------
_SMALL = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 48,
    "vocab_size": 6,
    "partial_rotary_factor": 0.5,
}


def _small_bundle(seed: int) -> MtpBundle:
    cfg = MtpConfig.from_text_config(_SMALL)
    gen = torch.Generator().manual_seed(seed)
    layer = MtpLayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if p.dim() == 1 else 0.4))
    layer.eval()
    return MtpBundle(layer, torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen), {})


def _naive_acceptance(bundle: MtpBundle, seq: SequenceRecord, k: int) -> list[StepRecord]:
    """The engine loop written out: each step re-runs the MTP over the accepted rows, then chains; steps until the
    request has its max_tokens (``seq.end``), drafting k while the tokens (lookahead included) can verify them."""
    tokens, P = seq.tokens.tolist(), seq.prompt_len
    T, t = len(tokens), P - 1
    end = T if seq.end is None else seq.end
    records = []
    while end - t - 2 >= 1:
        n = min(k, T - t - 2)
        _, cache = bundle.layer(seq.hidden[None, :t], bundle.embed(seq.tokens[None, 1 : t + 1])) if t else (None, None)
        h, x, pos, d = seq.hidden[None, t : t + 1], seq.tokens[None, t + 1 : t + 2], t, []
        for _ in range(n):
            m, cache = bundle.layer(h, bundle.embed(x), torch.tensor([pos]), cache)
            x = (m @ bundle.lm_head_weight.T).argmax(-1)
            d.append(int(x))
            h, pos = m, pos + 1
        a = 0
        while a < n and d[a] == tokens[t + 2 + a]:
            a += 1
        records.append(StepRecord(n, a))
        t += a + 1
    return records


def test_acceptance_equals_naive_engine_loop() -> None:
    bundle = _small_bundle(0)
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for T, P in ((12, 3), (9, 1), (15, 6)):
        tokens = torch.randint(0, 6, (T,), generator=gen)
        seqs.append(SequenceRecord(tokens, P, torch.randn(T, 32, generator=gen)))
    run = TargetRun("synthetic", seqs)
    with torch.no_grad():
        result = evaluate_acceptance(bundle, run, 3, progress=False)
        for k in (1, 2, 3):
            naive = [r for s in seqs for r in _naive_acceptance(bundle, s, k)]
            assert result.by_k[k - 1] == acceptance_stats(naive)
        # teacher-forced agreement: one causal pass, row t's argmax against token t+2, over the continuation
        hits = total = 0
        for s in seqs:
            m, _ = bundle.layer(s.hidden[None, :-1], bundle.embed(s.tokens[None, 1:]))
            pred = (m[0] @ bundle.lm_head_weight.T).argmax(-1)
            hits += int((pred[s.prompt_len - 1 : -1] == s.tokens[s.prompt_len + 1 :]).sum())
            total += len(s.tokens) - s.prompt_len - 1
    assert result.teacher_forced_agreement == hits / total
    assert result.by_k[0].num_accepted > 0  # a 6-token vocabulary accepts some drafts


def test_acceptance_with_lookahead_equals_naive_engine_loop() -> None:
    """Sequences captured with a lookahead (``capture(lookahead=k - 1)``, validate's built-in path): the steps end
    at each request's ``end`` and draft k up to it, verified against the tokens after it; counts and tokens are the
    requests'."""
    bundle = _small_bundle(2)
    gen = torch.Generator().manual_seed(3)
    seqs = []
    for T, P in ((14, 3), (11, 1), (17, 6)):
        tokens = torch.randint(0, 6, (T,), generator=gen)
        seqs.append(SequenceRecord(tokens, P, torch.randn(T, 32, generator=gen), end=T - 2))
    run = TargetRun("synthetic", seqs)
    assert run.num_tokens == sum(len(s.tokens) - 2 for s in seqs)
    with torch.no_grad():
        result = evaluate_acceptance(bundle, run, 3, progress=False)
    for k in (1, 2, 3):
        naive = [r for s in seqs for r in _naive_acceptance(bundle, s, k)]
        assert all(r.drafted == k for r in naive)  # the lookahead covers every last step
        assert result.by_k[k - 1] == acceptance_stats(naive)


def test_truncated_teacher_forced_cache_equals_prefix_pass() -> None:
    bundle = _small_bundle(2)
    gen = torch.Generator().manual_seed(3)
    hidden, tokens = torch.randn(1, 10, 32, generator=gen), torch.randint(0, 6, (1, 11), generator=gen)
    with torch.no_grad():
        _, full = bundle.layer(hidden, bundle.embed(tokens[:, 1:]))
        for t in (1, 4, 9):
            _, prefix = bundle.layer(hidden[:, :t], bundle.embed(tokens[:, 1 : t + 1]))
            cut = KVCache(full.key[:, :, :t], full.value[:, :, :t])
            torch.testing.assert_close(cut.key, prefix.key, rtol=0, atol=1e-6)
            a = draft_chain(
                bundle.layer,
                hidden[:, t : t + 1],
                tokens[:, t + 1 : t + 2],
                bundle.embed,
                bundle.lm_head_weight,
                3,
                past_kv=cut,
            )
            b = draft_chain(
                bundle.layer,
                hidden[:, t : t + 1],
                tokens[:, t + 1 : t + 2],
                bundle.embed,
                bundle.lm_head_weight,
                3,
                past_kv=prefix,
            )
            torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)


# ---- loading quantized checkpoints ----------------------------------------------------------------
MTP_LINEARS = (
    "mtp.layers.0.self_attn.q_proj",
    "mtp.layers.0.self_attn.k_proj",
    "mtp.layers.0.self_attn.v_proj",
    "mtp.layers.0.self_attn.o_proj",
    "mtp.layers.0.mlp.gate_proj",
    "mtp.layers.0.mlp.up_proj",
    "mtp.layers.0.mlp.down_proj",
)


def _rewrite(src: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy a checkpoint into one ``model.safetensors`` after ``change`` edits its tensors."""
    shutil.copytree(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(dst.glob("*.safetensors")):
        tensors |= load_file(shard)
        shard.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _quantize_mtp(kind: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(t: dict[str, torch.Tensor]) -> None:
        for m in MTP_LINEARS:
            w = t.pop(f"{m}.weight")
            s_in = input_scale_from_amax(torch.tensor(3.0))
            if kind == "nvfp4":
                t |= {f"{m}.{k}": v for k, v in quantize_nvfp4(w).tensors().items()}
                t[f"{m}.input_scale"] = s_in
            elif kind == "nvfp4-ct":
                t |= {f"{m}.{k}": v for k, v in to_compressed_tensors(quantize_nvfp4(w), s_in).items()}
            elif kind == "fp8":
                q, s = quantize_fp8_per_tensor(w)
                t |= {f"{m}.weight": q, f"{m}.weight_scale": s, f"{m}.input_scale": torch.tensor(0.01)}
            else:  # fp8-block, 128x128 with a ragged edge
                rows, cols = w.shape
                scale = torch.rand((rows + 127) // 128, (cols + 127) // 128) * 0.01 + 0.001
                full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
                q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
                t |= {f"{m}.weight": q, f"{m}.weight_scale_inv": scale}

    return change


@pytest.fixture(scope="module")
def quantized_mtp(tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qmtp")
    src = tiny_factory("qwen3_5")
    return {k: _rewrite(src, root / k, _quantize_mtp(k)) for k in ("nvfp4", "nvfp4-ct", "fp8", "fp8-block")}


@pytest.mark.parametrize("kind", ["nvfp4", "nvfp4-ct", "fp8", "fp8-block"])
def test_dequantization_is_exact(
    kind: str, quantized_mtp: dict[str, Path], tiny_factory: Callable[[str], Path]
) -> None:
    weights = CheckpointWeights.open(quantized_mtp[kind])
    source = Checkpoint.open(tiny_factory("qwen3_5"))
    stored = load_file(quantized_mtp[kind] / "model.safetensors")
    assert set(weights.formats) == set(MTP_LINEARS)
    assert {f.kind.name for f in weights.formats.values()} == {kind}
    for m in MTP_LINEARS:
        got = weights.tensor(f"{m}.weight")
        if kind == "nvfp4":
            want = dequantize_nvfp4(stored[f"{m}.weight"], stored[f"{m}.weight_scale"], stored[f"{m}.weight_scale_2"])
            assert torch.equal(got, want)
        ref = source.read_tensor(f"{m}.weight").float()
        assert got.shape == ref.shape
        rel = float((got - ref).norm() / ref.norm())
        assert rel < (0.2 if kind.startswith("nvfp4") else 0.05), (m, rel)
    assert weights.precision_summary()["mtp"] == {kind: 7, "bf16": 1}  # fc stays BF16


def test_compressed_tensors_equals_modelopt(quantized_mtp: dict[str, Path]) -> None:
    a, b = CheckpointWeights.open(quantized_mtp["nvfp4"]), CheckpointWeights.open(quantized_mtp["nvfp4-ct"])
    for m in MTP_LINEARS:
        # 1 / (1 / s) may differ from s by one ulp: equal up to float32 rounding.
        torch.testing.assert_close(a.tensor(f"{m}.weight"), b.tensor(f"{m}.weight"), rtol=2e-7, atol=0)
        assert b.formats[m].input_scale == pytest.approx(a.formats[m].input_scale, rel=1e-6)


def test_activation_emulation_hooks(quantized_mtp: dict[str, Path]) -> None:
    weights = CheckpointWeights.open(quantized_mtp["nvfp4"])
    off, _ = load_mtp(weights)
    emu, _ = load_mtp(weights, activations="emulate")
    assert off is not None and emu is not None
    assert off.emulated == [] and sorted(emu.emulated) == sorted(MTP_LINEARS)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, 5, 128, generator=gen)
    x = torch.randint(0, 500, (1, 5), generator=gen)
    with torch.no_grad():
        a, _ = off.layer(h, off.embed(x))
        b, _ = emu.layer(h, emu.embed(x))
    assert not torch.equal(a, b)
    assert float((a - b).norm() / a.norm()) < 0.5


def test_missing_and_partial_mtp(
    tiny_factory: Callable[[str], Path], naive_export_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    bundle, reason = load_mtp(CheckpointWeights.open(naive_export_factory("qwen3_5")))
    assert bundle is None and reason is not None and "no mtp.* tensors" in reason

    def drop_fc(t: dict[str, torch.Tensor]) -> None:
        del t["mtp.fc.weight"]

    partial = _rewrite(tiny_factory("qwen3_5"), tmp_path / "partial", drop_fc)
    bundle, reason = load_mtp(CheckpointWeights.open(partial))
    assert bundle is None and reason is not None and "mtp.fc.weight" in reason


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3_5_moe", "qwen3_next", "qwen3_5-tied"])
def test_target_matches_transformers_from_pretrained(variant: str, tiny_factory: Callable[[str], Path]) -> None:
    """Re-fused experts, tied heads and the wrapper prefix give transformers' own model, exactly."""
    import transformers

    path = tiny_factory(variant)
    target = load_target(CheckpointWeights.open(path), device=CPU, dtype=torch.float32)
    config = json.loads((path / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    ref = cls.from_pretrained(path, dtype=torch.float32).eval()
    body: Any = ref.model.language_model if hasattr(ref.model, "language_model") else ref.model
    ids = torch.randint(0, 400, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = body(input_ids=ids).last_hidden_state
    torch.testing.assert_close(target.hidden(ids), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(target.lm_head_weight, ref.get_output_embeddings().weight, rtol=0, atol=0)
    seq = target.greedy(ids[:, :8], 6)
    assert torch.equal(seq[:, :8], ids[:, :8])
    # The continuation is the target's own greedy choice under a single causal pass.
    assert torch.equal(target.logits(target.hidden(seq))[0, 7:-1].argmax(-1), seq[0, 8:])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_batched_generation_equals_one_prompt_at_a_time(variant: str, tiny_factory: Callable[[str], Path]) -> None:
    """Prompts of one length generated together: the same tokens and acceptance; the same hidden states within
    float32 rounding (batched, every GEMM sees more rows and the CPU's kernels may block it differently: bit-equal on
    some CPUs, not on all; the MoE experts also group rows differently)."""
    path = tiny_factory(variant)
    weights = CheckpointWeights.open(path)
    target = load_target(weights, device=CPU, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    # Lengths 5, 9, 5, 20 (capped at max_len // 2 = 8), 5, 3: groups of 3, 2 and 1 prompts.
    prompts = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (5, 9, 5, 20, 5, 3)]
    plan = plan_sequences(prompts, 16)
    one = capture(target, plan, label="one", progress=False, batch_size=1)
    batched = capture(target, plan, label="batched", progress=False, batch_size=2)
    assert [s.prompt_len for s in batched.sequences] == [5, 8, 5, 8, 5, 3]
    # hidden states are O(1) (post-norm) and each is a float32 sum over 128-wide rows: rounding, however the rows
    # are blocked, stays far below 1e-5, while a wrong row or position (padding, cache) moves them by O(0.1)
    atol = 1e-5
    for a, b in zip(one.sequences, batched.sequences, strict=True):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        torch.testing.assert_close(a.hidden, b.hidden, rtol=0, atol=atol)
    on_one = capture(target, plan[:2], label="c", reference=one, progress=False, batch_size=1)
    on_batched = capture(target, plan[:2], label="c", reference=one, progress=False, batch_size=4)
    assert on_one.hidden_on_ref is not None and on_batched.hidden_on_ref is not None
    for a, b in zip(on_one.hidden_on_ref, on_batched.hidden_on_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    bundle, reason = load_mtp(weights)
    assert bundle is not None, reason
    assert evaluate_acceptance(bundle, one, 3, progress=False) == evaluate_acceptance(
        bundle, batched, 3, progress=False
    )
    # sampled: each prompt draws from its own generator, so its tokens do not depend on the batch either
    hot = SamplingSettings(0.9, top_p=0.95)
    sampled_one = capture(target, plan, label="s1", progress=False, batch_size=1, sampling=hot)
    sampled_batched = capture(target, plan, label="s4", progress=False, batch_size=4, sampling=hot)
    for a, b in zip(sampled_one.sequences, sampled_batched.sequences, strict=True):
        assert torch.equal(a.tokens, b.tokens)
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(one.sequences, sampled_one.sequences))


@pytest.mark.slow
def test_modelopt_export_loads(
    naive_export_factory: Callable[[str], Path], tiny_factory: Callable[[str], Path]
) -> None:
    """A real modelopt NVFP4 export (fused experts exported per expert) loads; outputs stay close."""
    ids = torch.randint(0, 400, (1, 16), generator=torch.Generator().manual_seed(0))
    src = load_target(CheckpointWeights.open(tiny_factory("qwen3_5_moe")), device=CPU, dtype=torch.float32)
    weights = CheckpointWeights.open(naive_export_factory("qwen3_5_moe"))
    assert {f.kind.name for f in weights.formats.values()} == {"nvfp4"}
    quant = load_target(weights, device=CPU, dtype=torch.float32)
    emulated = load_target(weights, device=CPU, dtype=torch.float32, activations="emulate")
    assert any(".mlp.experts" in m for m in emulated.emulated)
    a, b, c = src.hidden(ids), quant.hidden(ids), emulated.hidden(ids)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9
    assert not torch.equal(b, c)


# ---- hidden files, verdicts, report, CLI ----------------------------------------------------------
def test_save_and_reuse_hidden_states(tiny_factory: Callable[[str], Path], tmp_path: Path) -> None:
    ckpt = tiny_factory("qwen3_5")
    common: dict[str, Any] = {"num_prompts": 2, "max_len": 24, "device": "cpu", "progress": False}
    direct = validate(ValidateOptions(ckpt, save_hidden=tmp_path / "h.safetensors", **common))
    again = validate(ValidateOptions(ckpt, hidden=tmp_path / "h.safetensors", **common))
    assert direct.to_json()["reference"]["acceptance"] == again.to_json()["reference"]["acceptance"]
    assert again.to_json()["reference"]["target_source"].startswith("hidden file")
    # A pair against the reference target only: MTP-only comparison, identical MTPs.
    pair = validate(ValidateOptions(ckpt, ckpt, hidden=tmp_path / "h.safetensors", **common))
    assert pair.to_json()["comparison"]["mtp"]["kl"]["max"] == 0.0
    assert pair.to_json()["comparison"]["main"] is None
    save_file({"x": torch.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(Exception, match="not an mtpquant hidden-state file"):
        validate(ValidateOptions(ckpt, hidden=tmp_path / "other.safetensors", **common))
    # sampled runs travel too: one group per setting, and the same numbers replayed from the file
    sampled = {**common, "temperatures": (0.0, 0.9), "top_k": (0, 20)}
    direct = validate(ValidateOptions(ckpt, save_hidden=tmp_path / "s.safetensors", **sampled))
    again = validate(ValidateOptions(ckpt, hidden=tmp_path / "s.safetensors", **sampled))
    by_sampling = direct.to_json()["reference"]["acceptance_by_sampling"]
    assert [a["sampling"] for a in by_sampling] == [
        {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0},
        {"temperature": 0.9, "top_p": 1.0, "top_k": 20, "seed": 0},
    ]
    assert by_sampling == again.to_json()["reference"]["acceptance_by_sampling"]
    with pytest.raises(ValidateError, match=r"no reference target run at T=0\.5"):
        validate(ValidateOptions(ckpt, hidden=tmp_path / "s.safetensors", **{**common, "temperatures": (0.5,)}))


def _row(k: int, al: float, per_position: list[float] | None = None) -> AcceptanceRow:
    pos = tuple(per_position or [0.5] * k)
    return AcceptanceRow(
        k=k,
        num_steps=10,
        num_drafted=10 * k,
        num_accepted=round(10 * (al - 1)),
        acceptance_rate=(al - 1) / k,
        mean_acceptance_length=al,
        drafted_per_position=(10,) * k,
        accepted_per_position=(5,) * k,
        acceptance_per_position=pos,
    )


def _side(al: list[float] | None, err: str | None = None, per_position: list[list[float]] | None = None) -> Side:
    acc = (
        Acceptance(tuple(_row(k, a, (per_position or [None] * len(al))[k - 1]) for k, a in enumerate(al, 1)), 0.5)
        if al
        else None
    )
    return Side("x", "qwen3_5", {}, "model", 1, 8, 4, MtpInfo(al is not None, err, {"bf16": 8}), acc)


def test_report_files(tmp_path: Path) -> None:
    side = _side([1.5, 2.0, 2.5], per_position=[[0.6], [0.6, 0.4], [0.6, 0.4, 0.3]])
    cmp = Comparison(
        mtp=Agreement(4, 1.0, KlSummary(0.0, 0.0, 0.0, 0.0)),
        candidate_mtp_on_reference_target=side.acceptance,
        al_delta_by_k=(0.0, 0.1, 0.0),
        al_delta_from_mtp_by_k=(0.0, 0.0, 0.0),
        al_delta_from_target_by_k=(0.0, 0.1, 0.0),
        acceptance_delta_per_position=(0.0, 0.0, 0.0),
        main=Agreement(4, 0.5, KlSummary(0.1, 0.1, 0.2, 0.2)),
    )
    settings = Settings(3, 1, 8, "p", "cpu", "float32", "off", None, 0.1, 1.02)
    data = Report(
        "0", "now", "pair", settings, side, Verdict("pass", ("ok",)), side, cmp, {"total_s": 1.0}, ("a note",)
    )
    report = ValidationReport(
        data, mtp_kl=torch.zeros(4, dtype=torch.float64), main_kl=torch.tensor([0.1, 0.2, 0.1, 0.05])
    )
    write_report(report, tmp_path / "r")
    files = {p.name for p in (tmp_path / "r").iterdir()}
    assert files == {"report.json", "report.md", "acceptance.png", "kl.png", "speculation_profile.json"}
    for png in ("acceptance.png", "kl.png"):
        assert (tmp_path / "r" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "r" / "report.md").read_text()
    assert "![Acceptance](acceptance.png)" in md and "![KL distribution](kl.png)" in md
    written = json.loads((tmp_path / "r" / "report.json").read_text())
    assert written == data.to_json() and Report.from_json(written) == data  # the schema round-trips exactly
    assert "candidate    1  1.500" in acceptance_table(data, sides(data))
    # one acceptance table: the terminal's text and report.md's (and the card's) Markdown come from one function
    table = acceptance_table(data, sides(data), markdown=True)
    assert table.splitlines()[:4] == [
        "| | k | AL | 95 % CI | acceptance rate | per-position acceptance |",
        "|---|---|---|---|---|---|",
        "| reference | 1 | 1.500 | n/a | 50.0 % | 60.0 % |",
        "|  | 2 | 2.000 | n/a | 50.0 % | 60.0 % / 40.0 % |",
    ]
    assert f"## Acceptance\n\n{table}\n" in md
    assert "Teacher-forced MTP agreement with the target: 50.0 %." in md
    # report.md reads as prose: no Python reprs; the AL axis starts at 1 (a drop of 0.1 is not magnified)
    lines = md.splitlines()
    assert lines[lines.index("## Candidate: `x`") + 2] == (
        "Family qwen3_5; target from model; MTP precision: 8 Linears, all unquantized (BF16 8)."
    )
    assert ("Mode: pair; k = 1..3; 1 sequence of 8 tokens; prompts: p; device cpu (float32); activations NOT quantized "
            "(--activations off)." in lines)
    assert lines[-1] == "Time 1.0 s; mtpquant 0, schema mtpquant.validate/2."  # no import time measured: none named
    assert _acceptance_plot(data, sides(data)).axes[1].get_ylim() == (1.0, 2.625)
    engine = EngineInfo(
        "vllm",
        "0.32.0",
        "http://127.0.0.1:1",
        "tiny",
        3,
        "server",
        sampling={
            "settings": [SamplingSettings().to_json(), SamplingSettings(0.8, 0.9).to_json()],
            "rule": "vllm",
            "ignore_eos": True,
            "concurrency": 1,
        },
    )
    served = dataclasses.replace(side, mtp=MtpInfo(True))
    shown = dataclasses.replace(data, reference=served, candidate=served, engine=(engine,))
    md = render_markdown(shown, {}, sides(shown))
    assert "Family qwen3_5; target from model; MTP precision as the engine serves it." in md
    assert "Requests: T=0 (seed 0); T=0.8, top-p 0.9 (seed 0), rule vllm, ignore_eos on, 1 at a time." in md
    unusable = dataclasses.replace(side, mtp=MtpInfo(False, "no mtp.* tensors"), acceptance=None)
    unusable_report = dataclasses.replace(data, candidate=unusable)
    md = render_markdown(unusable_report, {}, sides(unusable_report))
    assert "Family qwen3_5; target from model; MTP precision not read (no usable MTP).\n\n**MTP unavailable:** " in md
    assert "None" not in md and "{" not in md
    # --compare-reference's rows are typed (Predicted) and write the published shape, byte for byte
    row = {
        "sampling": {"temperature": 0.8, "top_p": 0.9, "top_k": 0, "seed": 0},
        "label": "T=0.8, top-p 0.9",
        "k": 2,
        "predicted_al": 1.75,
        "engine_al": 1.5,
        "difference": -0.25,
        "predicted_acceptance_rate": 0.375,
        "engine_acceptance_rate": 0.25,
        "predicted_per_position": [0.5, 0.25],
        "engine_per_position": [0.375, 0.125],
        "engine_steps": 40,
    }
    published: dict[str, Any] = {}
    for key, value in data.to_json().items():  # report.json's order: predicted_vs_engine before timing
        if key == "timing":
            published["predicted_vs_engine"] = {"method": "built-in prediction", "reference": [row]}
        published[key] = value
    compared = Report.from_json(published)
    assert json.dumps(compared.to_json()) == json.dumps(published)
    assert compared.predicted is not None and compared.predicted.reference[0].difference == -0.25
    assert acceptance_text(compared).endswith(
        "reference T=0.8, top-p 0.9 k=2: engine AL 1.500, built-in prediction 1.750, difference -0.250; "
        "per position engine/predicted 37.5/50.0% 12.5/25.0%"
    )
    md = render_markdown(compared, {}, sides(compared))
    assert "| reference | T=0.8, top-p 0.9 | 2 | 1.500 | 1.750 | -0.250 | 37.5 % / 12.5 % | 50.0 % / 25.0 % |" in md


def test_a_report_replaces_an_earlier_one_whole(tmp_path: Path) -> None:
    """What a user saw: ``--report-dir`` kept what an earlier run left (another model's server logs, an old ``kl.png``),
    and publish uploaded it beside the new report. The directory is now replaced whole, in one step: the new run's
    files and nothing else, the engine's logs in ``logs/``, nothing left beside it."""
    side = _side([1.5, 2.0], per_position=[[0.6], [0.6, 0.4]])
    settings = Settings(2, 1, 8, "p", "cpu", "float32", "off", None, 0.1, 1.02)
    pair = Report("0", "now", "pair", settings, side, Verdict("pass", ("ok",)), side, Comparison())
    report_dir = tmp_path / "work" / "validation"
    write_report(ValidationReport(pair, mtp_kl=torch.tensor([0.1, 0.2])), report_dir)
    assert (report_dir / "kl.png").exists()
    (report_dir / "vllm-candidate-k3.log").write_text("another model's server\n")  # as mtpquant before logs/ left it
    (report_dir / "logs").mkdir()
    (report_dir / "logs" / "vllm-reference-k3.log").write_text("another model's server\n")
    logs = tmp_path / "server-logs"  # what server_logs gives the servers validate starts
    logs.mkdir()
    (logs / "vllm-reference-k1.log").write_text("this run's server\n")
    single = Report("0", "later", "single", settings, side, Verdict("pass", ("ok",)))
    write_report(ValidationReport(single), report_dir, logs=logs)
    files = sorted(p.relative_to(report_dir).as_posix() for p in report_dir.rglob("*"))
    assert files == [
        "acceptance.png", "logs", "logs/vllm-reference-k1.log", "report.json", "report.md", "speculation_profile.json"
    ]  # fmt: skip
    assert json.loads((report_dir / "report.json").read_text())["created"] == "later"
    assert (report_dir / "logs" / "vllm-reference-k1.log").read_text() == "this run's server\n"
    assert sorted(p.name for p in report_dir.parent.iterdir()) == ["validation"]  # no temporary directory, no lock


def test_a_report_dir_holding_other_files_is_refused_up_front(
    tiny_factory: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], no_target_runs: None
) -> None:
    """The report replaces its directory whole, so a directory holding anything validate does not write is refused
    before any work (exit 5), and left as it was: validate never removes a file it did not write."""
    ckpt = str(tiny_factory("qwen3_5"))
    for rel in ("notes.txt", "logs/notes.txt", "report.json/x"):
        report_dir = tmp_path / rel.replace("/", "-") / "r"
        (report_dir / rel).parent.mkdir(parents=True)
        (report_dir / rel).write_text("mine\n")
        code, err = _cli_err(capsys, ckpt, "--report-dir", str(report_dir))
        what = rel.split("/")[0] if rel.startswith("report.json") else rel
        assert (code, err) == (
            ExitCode.OUTPUT_EXISTS,
            f"mtpquant: error: {report_dir}: holds {what}, which validate did not write; the report replaces its "
            "directory whole, so not replacing it (choose another --report-dir, or move that out)",
        )
        assert (report_dir / rel).read_text() == "mine\n"
        assert sorted(p.name for p in report_dir.parent.iterdir()) == ["r"]


def test_report_md_names_every_servers_arguments_and_memory() -> None:
    """What a user saw: report.md listed the first of several servers' arguments, and the memory each started
    server was given came as unlabelled notes (which the card copied). Every server's now, by side and k, and the
    memory is the server's own record (``EngineInfo.memory``), not a note."""
    side = _side([1.5, 2.0], per_position=[[0.6], [0.6, 0.4]])
    settings = Settings(2, 1, 8, "p", "engine", "as served", "as served", None, 0.1, 1.02)
    engines = tuple(
        EngineInfo(
            "vllm", "0.32.0", f"http://127.0.0.1:{port}", "tiny", k, "server", side=label,
            server_args=(
                "--model", "tiny", "--port", str(port), "--speculative-config", f'{{"num_speculative_tokens":{k}}}'
            ),
            memory=f"engine memory (cpu): KV cache {k} MB" if label == "reference" else "",
        )
        for label, port, k in (("reference", 1, 1), ("reference", 2, 2), ("candidate", 3, 1))
    )  # fmt: skip
    report = Report("0", "now", "pair", settings, side, Verdict("pass", ("ok",)), side, Comparison(), engine=engines)
    md = render_markdown(report, {}, sides(report))
    args = md.split("Server arguments:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert args == [
        '- reference, k = 1: `--model tiny --port 1 --speculative-config {"num_speculative_tokens":1}`',
        '- reference, k = 2: `--model tiny --port 2 --speculative-config {"num_speculative_tokens":2}`',
        '- candidate, k = 1: `--model tiny --port 3 --speculative-config {"num_speculative_tokens":1}`',
    ]
    memory = md.split("Memory:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert memory == [
        "- reference, k = 1: engine memory (cpu): KV cache 1 MB",
        "- reference, k = 2: engine memory (cpu): KV cache 2 MB",
    ]  # a running server (the candidate's) was given nothing by validate
    assert Report.from_json(report.to_json()).engine == engines  # the memory is part of the record


def test_a_report_of_another_shape_is_refused_naming_the_place() -> None:
    """report.json is read strictly (its flat records by pydantic): the first problem, where it is, in one line."""
    side = _side([1.5])
    settings = Settings(1, 1, 8, "p", "cpu", "float32", "off", None, 0.1, 1.02)
    good = Report("0", "now", "single", settings, side, Verdict("pass", ("ok",))).to_json()
    assert Report.from_json(good).to_json() == good
    cases = [
        ({"settings": {**good["settings"], "k": "1"}}, "report.settings.k: input should be a valid integer"),
        ({"settings": {**good["settings"], "k": True}}, "report.settings.k: input should be a valid integer"),
        (
            {"settings": {**good["settings"], "sampling": [{"temperature": -1}]}},
            "report.settings.sampling[0]: value error, temperature must be >= 0, got -1.0",
        ),
        ({"reference": {**good["reference"], "mtp": {"error": None}}}, "report.reference.mtp.present: field required"),
        ({"settings": [1]}, "report.settings: input should be an object"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError) as refused:
            Report.from_json({**good, **change})
        assert str(refused.value) == message


def test_a_report_names_every_directory_one_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However a checkpoint was given, the report names a local directory by its name (a repo id as it is)."""
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    given = ["runs/tiny", "./runs/tiny", str(tmp_path / "runs" / "tiny"), "runs/tiny/"]
    assert [public_checkpoint(g) for g in given] == ["tiny"] * 4
    assert public_checkpoint("Qwen/Qwen3.5-0.8B") == "Qwen/Qwen3.5-0.8B"
    assert public_checkpoint("/models/served/qwen") == "qwen"  # a server's own path: by its name too


def test_cli_single_checkpoint_json(tiny_factory: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "-q",
            "validate",
            str(tiny_factory("qwen3_5")),
            "--num-prompts",
            "1",
            "--max-len",
            "16",
            "--device",
            "cpu",
            "--k",
            "2",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "single" and data["schema"] == "mtpquant.validate/2"
    assert len(data["reference"]["acceptance"]["by_k"]) == 2
    # a random-weight MTP drafts for nothing: AL ~1 on the one prompt
    assert data["verdict"]["status"] == "fail" and rc == ExitCode.VALIDATE_FAIL


def test_cli_missing_mtp_fails(naive_export_factory: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "-q",
            "validate",
            str(naive_export_factory("qwen3_5")),
            "--num-prompts",
            "1",
            "--max-len",
            "12",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert rc == ExitCode.VALIDATE_FAIL and "FAIL" in out and "no mtp.* tensors" in out


def test_bad_options() -> None:
    for kwargs in ({"k": 0}, {"max_len": 2}, {"activations": "w4"}, {"hidden": Path("a"), "save_hidden": Path("b")}):
        with pytest.raises(Exception, match="--"):
            validate(ValidateOptions("unused", **kwargs))


# ---- refused up front: nothing loaded, run or written ------------------------------------------------------------
@pytest.fixture
def no_target_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any target model loaded from here on fails the test: a refusal must come before the work."""

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a target model was loaded before the refusal")

    monkeypatch.setattr("mtpquant.validate.builtin.load_target", refuse)


def _cli_err(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["-q", "validate", *argv, "--num-prompts", "2", "--max-len", "16", "--device", "cpu"])
    return code, capsys.readouterr().err.strip()


def test_a_pair_of_different_models_is_refused_up_front(
    tiny_factory: Callable[[str], Path],
    tiny_copy: Callable[[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_target_runs: None,
) -> None:
    dense, moe = tiny_factory("qwen3_5"), tiny_factory("qwen3_5_moe")
    report = tmp_path / "r"
    code, err = _cli_err(capsys, str(dense), str(moe), "--report-dir", str(report))
    assert code == ExitCode.LINEAGE and "\n" not in err
    assert err.startswith(f"mtpquant: error: REFERENCE {dense} and CANDIDATE {moe} are not the same model: ")
    assert "REFERENCE is Qwen3.5" in err and "CANDIDATE is Qwen3.5" in err
    assert not report.exists()
    # the same architecture and shapes, another tokenizer: two tokens swapped in the vocabulary
    other = tiny_copy("qwen3_5")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    code, err = _cli_err(capsys, str(dense), str(other))
    assert code == ExitCode.LINEAGE
    assert err.endswith(f"tokenizer vocabularies differ (508 vs 508 entries; first difference {a!r})")


def test_missing_prompts_file_and_unwritable_report_dir_fail_first(
    tiny_factory: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], no_target_runs: None
) -> None:
    ckpt = str(tiny_factory("qwen3_5"))
    code, err = _cli_err(capsys, ckpt, "--prompts", str(tmp_path / "nope.txt"))
    assert (code, err) == (ExitCode.USAGE, f"mtpquant: error: --prompts {tmp_path / 'nope.txt'}: no such file")
    (tmp_path / "empty.jsonl").write_text("\n")
    code, err = _cli_err(capsys, ckpt, "--prompts", str(tmp_path / "empty.jsonl"))
    assert (code, err) == (ExitCode.USAGE, f"mtpquant: error: --prompts {tmp_path / 'empty.jsonl'}: no prompts")
    (tmp_path / "file").write_text("x")
    code, err = _cli_err(capsys, ckpt, "--report-dir", str(tmp_path / "file" / "r"))
    assert code == ExitCode.IO
    assert err == f"mtpquant: error: {tmp_path / 'file'}: not a directory, so the report cannot be written there"


# ---- prompts ------------------------------------------------------------------------------------
def test_default_prompts_are_held_out() -> None:
    held = {name for name, _ in held_out_documents()}
    train = {name for name, _ in training_documents()}
    assert held and train and not held & train
    assert {"stdlib:difflib", "stdlib:ipaddress"} <= held
    prompts = default_prompts(8)
    assert prompts == default_prompts(8) and len(prompts) == 8
    code = "".join(text for name, text in held_out_documents() if name.startswith("stdlib:"))
    prose = "".join(text for name, text in held_out_documents() if name.startswith("pydoc:"))
    assert all(p in code for p in prompts[0::2]) and all(p in prose for p in prompts[1::2])


def test_load_prompts(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text('{"text": "a b"}\n"plain"\n\n{"prompt": "c"}\n')
    assert load_prompts(tmp_path / "p.jsonl") == ["a b", "plain", "c"]
    (tmp_path / "p.txt").write_text("first\nprompt\n\nsecond\n")
    assert load_prompts(tmp_path / "p.txt", 1) == ["first\nprompt"]
    (tmp_path / "bad.jsonl").write_text("[1]\n")
    with pytest.raises(ValidateError, match=r"bad\.jsonl:1: expected a string"):  # a usage error: exit 2, one line
        load_prompts(tmp_path / "bad.jsonl")
