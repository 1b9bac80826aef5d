"""heal of Qwen3.8-Flash-Next (``qwen4_exp``): its two-stream MTP trained by the same path as the Qwen3 MTP.

The trained tiny Qwen4-Exp (``mtpquant/assets/tiny-qwen4_exp-mtp``) converted with ``--keep-mtp`` (BF16 MTP) and
``--mtp quantize`` (NVFP4 MTP, its experts per expert): a seconds-long forced heal of each shows what is written
(only ``mtp.*`` bytes, in QUANT's names, dtypes, shapes and scales); the default heal's gain (held-out AL at
k = 3 beyond noise, none worse, and validate's AL of the healed quant above the unhealed one's) takes CPU-minutes per
mode and runs in the nightly lane (``MTPQUANT_NIGHTLY=1``), as does the keep quant's default heal through the CLI
(issue 43: written under the served-k rule; ``scripts/bench_heal.py`` records the same numbers in docs/BENCHMARKS.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main as cli
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.families import is_mtp_name
from mtpquant.heal.precision import export_mtp, master_weights, mtp_storage
from mtpquant.measure.weights import CheckpointWeights
from mtpquant.records.provenance import PROVENANCE_FILE, read_provenance
from mtpquant.synth.train import TINY_MTP_ASSETS
from mtpquant.validate.run import ValidateOptions, validate
from tests.support.heal import HealedTiny, proof
from tests.test_graft import tensor_digests, tree_state
from tests.test_heal import layout

ASSET = TINY_MTP_ASSETS["qwen4_exp"]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_written_back_in_the_quants_own_layout(healed_tiny_qwen4: HealedTiny, mode: str) -> None:
    """QUANT's MTP read as training's weights (fused experts) and exported unchanged is QUANT's MTP, byte for byte:
    per-expert experts stay per expert, the NVFP4 groups and scales are convert's."""
    quant = healed_tiny_qwen4.quant(mode)
    q, src = Checkpoint.open(quant), Checkpoint.open(ASSET)
    storage = mtp_storage(q, CheckpointWeights(q).formats)
    assert (storage.fmt, storage.activations) == (("bf16", False) if mode == "keep" else ("nvfp4", True))
    master, _ = master_weights(q, src, storage)
    written = export_mtp(q, src, storage, master)
    assert sorted(t.name for t in written) == sorted(n for n in q.tensors if is_mtp_name(n))
    for t in written:
        assert t.produce() == q.read_raw(q.tensors[t.name]), t.name


@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_heal_changes_only_the_mtp_and_inspects_healthy(healed_tiny_qwen4: HealedTiny, mode: str) -> None:
    quant = healed_tiny_qwen4.quant(mode)
    out, result = healed_tiny_qwen4.small(mode)
    check = result.check
    assert result.action in ("healed", "forced") and check is not None and check.sequences == 6
    assert [c.k for c in check.by_k] == [1, 2, 3]
    assert tensor_digests(out, mtp=False) == tensor_digests(quant, mtp=False)  # every other tensor bit-identical
    assert tensor_digests(out, mtp=True) != tensor_digests(quant, mtp=True)
    assert layout(out) == layout(quant)  # same names, dtypes, shapes
    changed = {k for k, v in tree_state(out).items() if tree_state(quant).get(k) != v}
    assert {PROVENANCE_FILE, *result.new_shards} <= changed <= {"model.safetensors.index.json", PROVENANCE_FILE,
                                                                 *result.new_shards}
    healed, before = inspect_checkpoint(out), inspect_checkpoint(quant)
    assert healed.verdicts == before.verdicts and healed.verdicts["vllm"].startswith("vLLM: MTP loads"), healed.verdicts
    if mode == "quantize":  # QUANT's input scales kept byte for byte, the experts per expert
        q, o = Checkpoint.open(quant), Checkpoint.open(out)
        scales = [n for n in q.tensors if is_mtp_name(n) and n.endswith(".input_scale")]
        assert scales and all(o.read_raw(o.tensors[n]) == q.read_raw(q.tensors[n]) for n in scales)
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in o.tensors if is_mtp_name(n))
    record = read_provenance(out).heal
    assert record is not None and record.precision == ("BF16" if mode == "keep" else "NVFP4 (W4A4)")
    assert [s.tool for s in read_provenance(out).steps] == ["convert", "heal"]


@pytest.mark.nightly(
    reason="a default heal through the CLI (CPU-minutes): the full lane runs the Qwen3.5 keep quant's default heal "
    "measured by vLLM (tests/test_engine_heal.py) and through the demo (tests/test_demo.py), the served-k rule on "
    "planted checks (tests/test_heal_decision.py), and this family's heal mechanics with the small schedule above"
)
def test_default_heal_of_the_keep_quant_is_written(healed_tiny_qwen4: HealedTiny, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """issue 43: ``mtpquant heal`` with default flags on the keep quant exits 0 and writes only ``mtp.*`` bytes. Its
    held-out check moves k = 1 within noise and k = 2, 3 well beyond it (+0.27 at k = 3 measured): the served k = 3 is
    better and no k worse, so it is written (the rule before it wanted every k better and threw the gain away)."""
    quant = healed_tiny_qwen4.quant("keep")
    out = tmp_path / "healed"
    assert cli(["heal", str(quant), "--from", str(ASSET), "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    record = read_provenance(out).heal
    assert record is not None and record.better and not record.forced
    assert (record.served_k, record.strict) == (3, False)
    assert [r.k for r in record.by_k] == [1, 2, 3]
    assert record.by_k[-1].low > 0 and all(r.high >= 0 for r in record.by_k), record.by_k
    # the decision line names each k's verdict
    line = next(x for x in printed.splitlines() if x.startswith("healed the MTP into "))
    assert "better beyond noise at the served k = 3 and worse beyond noise at no k: k=1 " in line
    assert "k=3 better: " in line and "; k=2 " in line
    assert tensor_digests(out, mtp=False) == tensor_digests(quant, mtp=False) and layout(out) == layout(quant)
    changed = {k for k, v in tree_state(out).items() if tree_state(quant).get(k) != v}
    new_shards = {n for n in changed if n.endswith(".safetensors")}
    assert new_shards and changed - new_shards <= {"model.safetensors.index.json", PROVENANCE_FILE}
    written = Checkpoint.open(out)
    assert {n for n, t in written.tensors.items() if t.shard in new_shards} == {
        n for n in written.tensors if is_mtp_name(n)}  # the new shards hold the MTP and nothing else


@proof
@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_default_heal_improves_acceptance(healed_tiny_qwen4: HealedTiny, tmp_path: Path, mode: str) -> None:
    """The default heal (the CLI, exit 0): better beyond noise at the served k = 3 and worse at no k on heal's
    held-out check, and validate (the built-in replay, unhealed quant vs healed quant on validate's own prompts)
    measures a higher AL at each k."""
    quant = healed_tiny_qwen4.quant(mode)
    out = tmp_path / "healed"
    assert cli(["-q", "heal", str(quant), "--from", str(ASSET), "--out", str(out), "--device", "cpu"]) == 0
    record = read_provenance(out).heal
    assert record is not None and record.better and not record.forced
    assert [r.k for r in record.by_k] == [1, 2, 3]
    assert record.by_k[-1].low > 0 and all(r.high >= 0 and r.after > r.before for r in record.by_k), record.by_k
    assert tensor_digests(out, mtp=False) == tensor_digests(quant, mtp=False) and layout(out) == layout(quant)
    report = validate(ValidateOptions(quant, out, num_prompts=32, k=3, device="cpu", progress=False)).to_json()
    before = [r["mean_acceptance_length"] for r in report["reference"]["acceptance"]["by_k"]]
    after = [r["mean_acceptance_length"] for r in report["candidate"]["acceptance"]["by_k"]]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
