"""heal: the MTP self-distilled to the quantized target, written back (only its bytes) when it is better.

The tests use the trained tiny model (``mtpquant/assets``), converted with ``--keep-mtp`` (BF16 MTP) and
``--mtp quantize`` (NVFP4 MTP) (``tests/support/heal.py``, shared with the engine test). The mechanics tests heal
with a schedule of seconds (and ``force`` where it cannot improve); the proof that the default heal improves
acceptance beyond noise takes CPU-minutes per mode and runs in the nightly lane (``MTPQUANT_NIGHTLY=1``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mtpquant.checkpoint.lock import OutputLock
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main as cli
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode, HealNotBetterError, HealRefusedError
from mtpquant.families import FAMILIES, family, is_mtp_name
from mtpquant.heal.options import HealOptions
from mtpquant.heal.precision import export_mtp, master_weights, mtp_storage
from mtpquant.heal.run import heal
from mtpquant.heal.support import check_family
from mtpquant.heal.train import _chain_outputs, chain_mask, distill_loss
from mtpquant.measure.weights import CheckpointWeights
from mtpquant.mtp.drafting import draft_chain
from mtpquant.mtp.module import KVCache, MtpConfig, MtpLayer
from mtpquant.records.evidence import UnitCounts, better_beyond_noise
from mtpquant.records.provenance import PROVENANCE_FILE, HealAl, HealRecord, Provenance, Step, read_provenance
from mtpquant.surgery.inplace import clean_stale
from mtpquant.synth.train import TINY_MTP_ASSET
from tests.support.cli import one_error
from tests.support.heal import CALIB, SMALL, HealedTiny, proof
from tests.test_graft import leftovers, private_copy, tensor_digests, tree_state

pytestmark = pytest.mark.slow

Factory = Callable[[str], Path]

# Smaller still: the kill test runs heal three times in fresh processes.
TINY = {**SMALL, "samples": 4, "steps": 1, "check_prompts": 5,
        "sizes": dataclasses.replace(SMALL["sizes"], new_tokens=8, check_len=16)}


def layout(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (e.dtype, tuple(e.shape)) for n, e in Checkpoint.open(path).tensors.items()}


# ---------------------------------------------------------------------------------------------- training pieces


def _tiny_layer(seed: int = 0) -> tuple[MtpLayer, torch.Tensor, torch.Tensor]:
    cfg = MtpConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                    partial_rotary_factor=0.5, rope_theta=10000.0, vocab_size=50, intermediate_size=48)
    torch.manual_seed(seed)
    layer = MtpLayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    return layer.eval(), torch.randn(50, 32), torch.randn(50, 32)


def test_chained_training_rows_are_the_engines_chain() -> None:
    """Chain step 2 of row t is what draft_chain computes from rows 0..t when its first draft is x_{t+2}."""
    layer, embed_w, head = _tiny_layer()
    T = 9
    tokens = torch.randint(0, 50, (1, T))
    hidden = torch.randn(1, T, 32)

    def embed(x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, embed_w)

    with torch.no_grad():
        outputs, teachers = _chain_outputs(layer, tokens, hidden, embed, 2)
        L = T - 1
        step2 = outputs[L:]
        assert torch.equal(teachers[:L], hidden[0, 1:]) and torch.equal(teachers[L:], hidden[0, 2:])
        for t in range(L - 1):
            out, cache = layer(hidden[:, : t + 1], embed(tokens[:, 1 : t + 2]))
            # the engine's step 2 from row t: its own output, the next token (here the accepted draft x_{t+2})
            chained = draft_chain(layer, out[:, -1:], tokens[:, t + 2 : t + 3], embed, head, 1,
                                  past_kv=KVCache(cache.key, cache.value), positions=torch.tensor([t + 1]))
            torch.testing.assert_close(step2[t], chained.mtp_out[0, 0], rtol=1e-5, atol=1e-5)


def test_chain_mask() -> None:
    mask = chain_mask(3, 3)[0, 0]
    assert mask.tolist() == [
        [True, False, False, True, False, False, True, False, False],
        [True, True, False, False, True, False, False, True, False],
        [True, True, True, False, False, True, False, False, True],
    ]


def test_chunked_kl_gradient_equals_the_whole_computation() -> None:
    layer, _, head = _tiny_layer(1)
    x = torch.randn(13, 32)
    teacher = torch.randn(13, 32)
    w = torch.randn(32, 32, requires_grad=True)
    loss = distill_loss(x @ w, teacher, head, chunk_rows=4)
    assert w.grad is not None
    chunked = w.grad.clone()
    w.grad = None
    logp = torch.log_softmax(teacher @ head.T, -1)
    logq = torch.log_softmax((x @ w) @ head.T, -1)
    full = (logp.exp() * (logp - logq)).sum(-1).mean()
    full.backward()
    assert float(loss) == pytest.approx(float(full.detach()), rel=1e-6)
    torch.testing.assert_close(chunked, w.grad)
    del layer


def test_better_beyond_noise() -> None:
    """heal's decision is validate's paired bootstrap (validate.evidence), per held-out sequence."""

    def counts(steps: tuple[int, ...], accepted: tuple[int, ...]) -> UnitCounts:
        return UnitCounts(steps, accepted, ((),) * len(steps), ((),) * len(steps))

    same = counts((10,) * 12, (6,) * 12)
    better, change = better_beyond_noise(same, same)
    assert not better and change.low == change.high == 0.0
    up = counts((10,) * 12, tuple(7 + (i % 2) for i in range(12)))
    better, change = better_beyond_noise(same, up)
    assert better and 0.1 <= change.low <= 0.15 <= change.high <= 0.2
    noisy = counts((10,) * 12, (*(6 + (1 if i % 2 else -1) for i in range(11)), 7))
    assert not better_beyond_noise(same, noisy)[0]
    few = counts((10,) * 4, (9,) * 4)
    assert better_beyond_noise(counts((10,) * 4, (1,) * 4), few)[0] is False  # too few prompts to decide


def test_heal_record_in_the_provenance_round_trips() -> None:
    record = HealRecord("NVFP4 (W4A4)", "offline text", 64, 12288, 32, 0.7, 100, 1e-3, 8, 2, 0, 64,
                        (HealAl(1, 1.6, 1.65, 0.01, 0.05), HealAl(2, 1.9, 2.0, float("nan"), 0.2)), True)
    step = Step("heal", ("mtpquant", "heal"), heal=record)
    data = Provenance((Step("convert"), step)).to_json()
    assert "heal" not in data["steps"][0] and data["steps"][1]["heal"]["by_k"][1]["low"] is None
    back = Provenance.from_json(json.loads(json.dumps(data)))
    assert back.heal is not None and back.heal.by_k[0] == record.by_k[0] and back.heal.chain == 2
    assert Provenance((step, Step("graft"))).heal is None  # a later graft replaced the healed MTP


# ---------------------------------------------------------------------------------------------- plan and refusals


def test_dry_run_states_memory_and_disk(healed_tiny: HealedTiny, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    quant = healed_tiny.quant("keep")
    before = tree_state(quant)
    code = cli(["-q", "heal", str(quant), "--from", str(TINY_MTP_ASSET), "--out", str(tmp_path / "o"), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "MTP BF16, 15 tensors" in out and "64 prompts of 64 tokens" in out and "100 steps x 8" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for key in ("memory", "placement", "peak", "training", "disk"):
        assert key in lines, out
    assert "6.39 MB of hidden states (64 x 192 tokens" in lines["disk"]
    assert not (tmp_path / "o").exists() and tree_state(quant) == before
    code = cli(["-q", "heal", str(quant), "--from", str(TINY_MTP_ASSET), "--out", str(tmp_path / "o"), "--dry-run",
                "--max-memory", "cpu=4MB"])
    capped = capsys.readouterr().out
    assert code == 0 and "--max-memory cpu=4MB" in capped and "disk" in capped.split("placement")[1]


def test_refusals_are_one_line_and_write_nothing(healed_tiny: HealedTiny, tiny_factory: Factory, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    keep = healed_tiny.quant("keep")
    drop = tmp_path / "drop"
    convert(ConvertOptions(src=str(TINY_MTP_ASSET), out=drop, mtp="drop", device="cpu", progress=False,
                           calib_samples=CALIB["calib_samples"], calib_seq_len=CALIB["calib_seq_len"]))
    (tmp_path / "exists").mkdir()
    cases = [
        ([str(drop), "--from", str(TINY_MTP_ASSET), "--out", str(tmp_path / "a")], ExitCode.HEAL_REFUSED,
         "has no MTP (no mtp.* tensors), so there is nothing to heal"),
        ([str(keep), "--from", str(TINY_MTP_ASSET), "--out", str(tmp_path / "exists")], ExitCode.OUTPUT_EXISTS,
         "output already exists"),
        ([str(keep), "--from", str(tiny_factory("qwen3_5_moe")), "--out", str(tmp_path / "b")], ExitCode.LINEAGE,
         "lineage mismatch"),
        ([str(keep), "--from", str(TINY_MTP_ASSET), "--out", str(tmp_path / "c"), "--steps", "0"], ExitCode.USAGE,
         "--steps must be >= 1"),
        ([str(keep), "--from", str(TINY_MTP_ASSET), "--out", str(tmp_path / "d"), "--max-memory", "cpu=1200kB"],
         ExitCode.MEMORY, "first weights"),  # the embedding would be on disk: refused before any work
    ]
    for argv, code, text in cases:
        got, err = one_error(capsys, "-q", "heal", *argv)
        assert got == code and text in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drop", "exists"]


def test_every_family_heals_and_a_family_flagged_off_is_refused_in_one_line() -> None:
    """Every Qwen family's MTP trains (Qwen4-Exp's two-stream one too) and GLM-4.5's and DeepSeek-V3's appended
    layers; a family whose MTP heal does not train (``Family.mtp_heal`` off) is refused by name before any work."""
    assert sorted(f.key for f in FAMILIES if f.mtp_heal) == [
        "deepseek_v3", "glm4_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp"
    ]
    off = dataclasses.replace(family("qwen4_exp"), mtp_heal=False)
    with pytest.raises(HealRefusedError) as refused:
        check_family(off, "./q")
    assert str(refused.value) == (
        "./q: heal does not train the Qwen3.8-Flash-Next (Qwen4-Exp) MTP yet; the quant is left as it is"
    )


# ---------------------------------------------------------------------------------------------- the format


@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_written_back_in_the_quants_own_layout(healed_tiny: HealedTiny, mode: str) -> None:
    """Unchanged weights come back as QUANT's exact bytes: the export is QUANT's layout and convert's math."""
    quant = healed_tiny.quant(mode)
    q, src = Checkpoint.open(quant), Checkpoint.open(TINY_MTP_ASSET)
    storage = mtp_storage(q, CheckpointWeights(q).formats)
    assert (storage.fmt, storage.activations) == (("bf16", False) if mode == "keep" else ("nvfp4", True))
    master, origin = master_weights(q, src, storage)
    assert origin == (q.label if mode == "keep" else src.label)
    for t in export_mtp(q, src, storage, master):
        assert t.produce() == q.read_raw(q.tensors[t.name]), t.name


# ---------------------------------------------------------------------------------------------- the write


@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_heal_changes_only_the_mtp_and_records_the_heal(healed_tiny: HealedTiny, mode: str) -> None:
    quant = healed_tiny.quant(mode)
    out, result = healed_tiny.small(mode)
    check = result.check
    assert result.action in ("healed", "forced") and check is not None and check.sequences == 6
    assert [c.k for c in check.by_k] == [1, 2, 3]
    # only mtp.* bytes changed: every other tensor and file is QUANT's
    assert tensor_digests(out, mtp=False) == tensor_digests(quant, mtp=False)
    assert tensor_digests(out, mtp=True) != tensor_digests(quant, mtp=True)
    assert layout(out) == layout(quant)  # same names, dtypes, shapes: the MTP keeps its format
    changed = {k for k, v in tree_state(out).items() if tree_state(quant).get(k) != v}
    assert {PROVENANCE_FILE, *result.new_shards} <= changed <= {"model.safetensors.index.json", PROVENANCE_FILE,
                                                                 *result.new_shards}
    assert inspect_checkpoint(out).verdicts == inspect_checkpoint(quant).verdicts
    if mode == "quantize":  # QUANT's input scales are kept byte for byte
        q, o = Checkpoint.open(quant), Checkpoint.open(out)
        scales = [n for n in q.tensors if is_mtp_name(n) and n.endswith(".input_scale")]
        assert len(scales) == 7 and all(o.read_raw(o.tensors[n]) == q.read_raw(q.tensors[n]) for n in scales)
    record = read_provenance(out).heal
    assert record is not None and record.better == check.better and record.forced == (not check.better)
    assert [(r.k, r.before, r.after) for r in record.by_k] == [
        (c.k, round(c.before, 6), round(c.after, 6)) for c in check.by_k
    ]  # the record keeps 6 decimals
    assert (record.steps, record.chain, record.seed, record.sequences, record.check_sequences) == (3, 2, 0, 8, 6)
    assert record.precision == ("BF16" if mode == "keep" else "NVFP4 (W4A4)")
    assert [s.tool for s in read_provenance(out).steps] == ["convert", "heal"]


# ---------------------------------------------------------------------------------------------- the proof


@proof
@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_default_heal_improves_held_out_acceptance(healed_tiny: HealedTiny, mode: str) -> None:
    quant = healed_tiny.quant(mode)
    out, result = healed_tiny.healed(mode)
    check = result.check
    assert result.action == "healed" and check is not None and check.sequences == 64
    assert [c.k for c in check.by_k] == [1, 2, 3]
    for c in check.by_k:  # better beyond noise at every k
        assert c.better and c.low > 0 and c.after > c.before, c
    assert tensor_digests(out, mtp=False) == tensor_digests(quant, mtp=False) and layout(out) == layout(quant)
    record = read_provenance(out).heal
    assert record is not None and record.better and not record.forced
    assert (record.steps, record.chain, record.seed, record.sequences) == (100, 2, 0, 64)


# ---------------------------------------------------------------------------------------------- no gain: nothing


def test_a_heal_that_does_not_help_writes_nothing(healed_tiny: HealedTiny, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    quant = private_copy(healed_tiny.quant("keep"), tmp_path / "q")
    before = tree_state(quant)
    code, err = one_error(capsys, "-q", "heal", str(quant), "--from", str(TINY_MTP_ASSET), "--in-place", "--device",
                          "cpu", "--steps", "1", "--lr", "1e-9", "--samples", "4", "--check-prompts", "8")
    assert code == ExitCode.HEAL_NOT_BETTER
    assert "not better beyond noise at the served k = 3 on 8 held-out prompts" in err
    assert "nothing written" in err
    assert tree_state(quant) == before and leftovers(tmp_path) == []
    with pytest.raises(HealNotBetterError):
        heal(HealOptions(quant=quant, source=TINY_MTP_ASSET, out=tmp_path / "o", lr=1e-9, **TINY))
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_heal_is_deterministic_and_force_writes_with_the_record(healed_tiny: HealedTiny, tmp_path: Path) -> None:
    quant = healed_tiny.quant("keep")
    first, a = healed_tiny.small("keep")
    b = heal(HealOptions(quant=quant, source=TINY_MTP_ASSET, out=tmp_path / "b", force=True, **SMALL))
    assert tensor_digests(first, mtp=True) == tensor_digests(tmp_path / "b", mtp=True)
    assert tensor_digests(first, mtp=True) != tensor_digests(quant, mtp=True)
    assert a.check == b.check and a.training is not None and b.training is not None
    assert (a.training.first_loss, a.training.last_loss) == (b.training.first_loss, b.training.last_loss)
    record = read_provenance(first).heal
    assert record is not None and record.forced == (not a.check.better)  # type: ignore[union-attr]
    # the peak RSS when each phase ended, in phase order: it names the phase that raised the peak
    assert list(b.peak_rss_after) == [k for k in b.timings if k != "total"]
    peaks = list(b.peak_rss_after.values())
    assert peaks == sorted(peaks) and 0 < peaks[-1] <= b.peak_rss_bytes


def _record_allocator_settings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the glibc allocator settings heal applies (each still applied), in order."""
    from mtpquant.runtime import memory

    chosen: list[str] = []
    for name in ("keep_freed_memory", "return_freed_memory"):
        real = getattr(memory, name)
        monkeypatch.setattr(memory, name, lambda real=real, name=name: chosen.append(name) or real())
    return chosen


def test_heal_under_a_memory_cap_reads_the_rest_of_the_target_from_disk(
    healed_tiny: HealedTiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-memory below QUANT's target: the plan leaves part of it on disk (read from QUANT's files and dequantized
    when its layer runs), and the heal is the same, byte for byte. Layers streamed from disk set glibc to return
    freed memory (convert's setting); a resident target (the bfloat16 test below) keeps it."""
    first, a = healed_tiny.small("keep")
    chosen = _record_allocator_settings(monkeypatch)
    b = heal(HealOptions(quant=healed_tiny.quant("keep"), source=TINY_MTP_ASSET, out=tmp_path / "b", force=True,
                         max_memory="cpu=4MB", **SMALL))
    assert b.plan.memory.disk_bytes > 0 and b.plan.memory.caps is not None
    assert chosen == ["return_freed_memory"]
    assert tensor_digests(tmp_path / "b", mtp=True) == tensor_digests(first, mtp=True)
    assert b.check == a.check


def test_a_head_trained_in_bfloat16_is_checked_in_the_compute_dtype(
    healed_tiny: HealedTiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vocabulary too large for a float32 head in training (the limit set to 0 here) trains against a bfloat16
    embedding and LM head; the held-out check still computes in float32: QUANT's MTP measures exactly as in a heal
    that trained in float32."""
    from mtpquant.heal import plan as heal_plan

    first, a = healed_tiny.small("keep")
    monkeypatch.setattr(heal_plan, "HEAD_FULL_PRECISION_LIMIT", 0)
    chosen = _record_allocator_settings(monkeypatch)
    b = heal(HealOptions(quant=healed_tiny.quant("keep"), source=TINY_MTP_ASSET, out=tmp_path / "b", force=True,
                         **SMALL))
    assert (a.plan.head_dtype, b.plan.head_dtype) == ("float32", "bfloat16")
    assert b.plan.memory.disk_bytes == 0 and chosen == ["keep_freed_memory"]
    assert a.check is not None and b.check is not None
    assert [c.before for c in b.check.by_k] == [c.before for c in a.check.by_k]
    assert tensor_digests(tmp_path / "b", mtp=True) != tensor_digests(first, mtp=True)  # trained against another head


# ---------------------------------------------------------------------------------------------- other families


@pytest.mark.parametrize(("variant", "mode"), [("qwen3_5_moe", "quantize"), ("qwen3_next", "keep")])
def test_moe_and_qwen3_next_heal_without_error(tiny_factory: Factory, tmp_path: Path, variant: str,
                                               mode: str) -> None:
    """Random weights: the mechanics (training, the layout written back, verification), not gains (forced)."""
    src = tiny_factory(variant)
    quant = tmp_path / "quant"
    convert(ConvertOptions(src=str(src), out=quant, mtp=mode, device="cpu", progress=False, calib_samples=4,
                           calib_seq_len=32))
    result = heal(HealOptions(quant=quant, source=src, out=tmp_path / "out", force=True, **SMALL))
    out = tmp_path / "out"
    assert result.record is not None and result.record.steps == 3
    assert tensor_digests(out, mtp=False) == tensor_digests(quant, mtp=False)
    assert tensor_digests(out, mtp=True) != tensor_digests(quant, mtp=True)
    assert layout(out) == layout(quant)
    assert inspect_checkpoint(out).verdicts == inspect_checkpoint(quant).verdicts


# ---------------------------------------------------------------------------------------------- kills

_DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys
    import mtpquant.surgery.inplace as inplace
    from mtpquant.heal.options import HealOptions, HealSizes
    from mtpquant.heal.run import heal

    args = json.loads(sys.argv[1])
    real = inplace.exchange_dirs

    def exchange(a, b):  # kill -9 just before or just after the atomic exchange of QUANT and the result
        commit = os.path.samefile(b, args["options"]["quant"])  # (not the probe of the filesystem's support)
        if commit and args["kill"] == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(a, b)
        if commit and args["kill"] == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    inplace.exchange_dirs = exchange
    heal(HealOptions(**args["options"] | {"sizes": HealSizes(**args["options"]["sizes"])}))
    """
)


def test_kill_during_an_in_place_heal_leaves_the_old_or_the_new_quant(healed_tiny: HealedTiny,
                                                                      tmp_path: Path) -> None:
    """kill -9 at the two moments that matter (graft's kill tests cover the shared write steps, graft/write.py, at
    random points, and the rerun): just before the exchange QUANT is as it was; just after it QUANT is the healed
    quant; either way the next in-place run's cleaning removes what the kill left beside it."""
    base = healed_tiny.quant("keep")
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)

    def run(quant: Path, kill: str) -> subprocess.CompletedProcess[str]:
        options = {"quant": str(quant), "source": str(TINY_MTP_ASSET), "in_place": True, "force": True, **TINY,
                   "sizes": dataclasses.asdict(TINY["sizes"])}
        return subprocess.run([sys.executable, str(script), json.dumps({"options": options, "kill": kill})],
                              capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])

    for kill in ("before", "after"):
        quant = private_copy(base, tmp_path / kill / "quant")
        before = tree_state(quant)
        killed = run(quant, kill)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert leftovers(quant.parent) != []  # the result (before) or the old quant (after), beside QUANT
        if kill == "before":
            assert tree_state(quant) == before
        else:  # the healed quant: only the MTP shard and the provenance changed
            changed = {k for k, v in tree_state(quant).items() if before.get(k) != v}
            assert changed == {"mtp-00001-of-00001.safetensors", PROVENANCE_FILE}
            assert tensor_digests(quant, mtp=False) == tensor_digests(base, mtp=False)
            assert [s.tool for s in read_provenance(quant).steps] == ["convert", "heal"]
        with OutputLock.acquire(quant):
            clean_stale(quant)
        assert leftovers(quant.parent) == []


# ---------------------------------------------------------------------------------------------- convert --heal, publish


def test_convert_heal_runs_heal_after_the_conversion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A heal that cannot help (one step at a tiny learning rate): OUT stays as converted and the exit says why.
    With --heal-force the same convert writes the healed MTP: only mtp.* bytes differ from the converted OUT."""
    out, forced = tmp_path / "out", tmp_path / "forced"
    common = ["--keep-mtp", "--device", "cpu", "--calib-samples", "2", "--calib-seq-len", "32", "--heal",
              "--heal-steps", "1", "--heal-samples", "4", "--heal-check-prompts", "8"]
    capsys.readouterr()
    code = cli(["-q", "convert", str(TINY_MTP_ASSET), str(out), *common, "--heal-lr", "1e-9"])
    assert code == ExitCode.HEAL_NOT_BETTER
    captured = capsys.readouterr()
    assert captured.out.startswith(f"wrote {out}")  # convert's summary first
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and f"{out} was written as converted, not healed: " in err
    assert "not better beyond noise at the served k = 3 on 8 held-out prompts" in err
    assert [s.tool for s in read_provenance(out).steps] == ["convert"] and leftovers(tmp_path) == []

    assert cli(["-q", "convert", str(TINY_MTP_ASSET), str(forced), *common, "--heal-force"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {forced}")
    assert "wrote the healed MTP (--force: not better beyond noise)" in printed
    provenance = read_provenance(forced)
    assert [s.tool for s in provenance.steps] == ["convert", "heal"]
    assert provenance.heal is not None and provenance.heal.forced  # type: ignore[union-attr]
    assert "--heal-force" in provenance.steps[1].command
    # convert is deterministic; heal leaves the rest
    assert tensor_digests(forced, mtp=False) == tensor_digests(out, mtp=False)
    changed = tensor_digests(forced, mtp=True)
    assert changed.keys() == tensor_digests(out, mtp=True).keys() and changed != tensor_digests(out, mtp=True)


def test_the_healed_checkpoint_does_not_show_the_unhealed_quants_report(
    healed_tiny: HealedTiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a user saw: heal linked QUANT's validation/ into the healed checkpoint, so its card showed the unhealed
    quant's numbers as "measured this checkpoint". heal leaves the report behind (it measured QUANT), and a report
    that predates the checkpoint's last change anyway (copied by hand, or carried by an earlier mtpquant) is named
    as such on the card, its figures not shown."""
    from mtpquant.validate.run import ValidateOptions, validate

    quant = private_copy(healed_tiny.quant("keep"), tmp_path / "quant")
    validate(ValidateOptions(quant, num_prompts=2, max_len=24, k=2, device="cpu", report_dir=quant / "validation",
                             progress=False))
    out = tmp_path / "healed"
    result = heal(HealOptions(quant=quant, source=TINY_MTP_ASSET, out=out, force=True, **TINY))
    assert not (out / "validation").exists() and (quant / "validation" / "report.json").exists()
    assert ("validation/: not carried over: its report measured QUANT before this heal (validate the result for a "
            "report on it)") in result.warnings

    def card() -> str:
        capsys.readouterr()
        assert cli(["-q", "publish", str(out), "--repo", "org/tiny-healed", "--dry-run"]) == 0
        return capsys.readouterr().out

    assert "No validation report was found in this checkpoint" in card()
    shutil.copytree(quant / "validation", out / "validation")  # the unhealed quant's report, as heal carried it
    created = json.loads((out / "validation" / "report.json").read_text())["created"]
    healed_at = read_provenance(out).steps[-1].created
    assert created < healed_at
    text = card()
    assert (f"A validation report is included ([`validation/report.md`](validation/report.md)), but it was made "
            f"({created}) before `mtpquant heal` changed this checkpoint ({healed_at}): its figures describe the "
            "checkpoint as it was then, not this one, so this card does not show them") in text
    assert "measured this checkpoint" not in text and "Speculation profile" not in text
    assert "the largest k the validation report measured" not in text  # nor the serve command's k


def test_publish_card_shows_the_heal(healed_tiny: HealedTiny, capsys: pytest.CaptureFixture[str]) -> None:
    out, result = healed_tiny.small("keep")
    capsys.readouterr()
    assert cli(["-q", "publish", str(out), "--repo", "org/tiny-healed", "--dry-run"]) == 0
    card = capsys.readouterr().out
    assert "## MTP healed to this quantized model" in card and "mtp-healed" in card
    assert result.check is not None
    for c in result.check.by_k:
        assert f"| {c.k} | {c.before:.3f} | {c.after:.3f} | {c.change:+.3f} | [{c.low:+.3f}, {c.high:+.3f}] |" in card
    assert "6 held-out prompts" in card and "3 steps of 4 sequences" in card
