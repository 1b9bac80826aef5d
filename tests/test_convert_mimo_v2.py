"""convert and validate on MiMo-V2-Flash (``mimo_v2_flash``: the MTP under ``model.mtp.layers.{i}``, sliding attention
with its sink bias, a dense MLP): ``--mtp keep`` and ``--mtp quantize`` on the tiny checkpoint, inspect healthy,
carried bytes exact, the MTP quantized as vLLM's MiMoV2MTP builds it (``model_executor/models/mimo_v2_mtp.py``:
``eh_proj`` a ``ReplicatedLinear`` without the quant config, the attention and the MLP with it), and validate's drafts
and AL those of a greedy replay of the engines' loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.convert.result import ConvertResult
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.diagnose.report import inspect_checkpoint

pytestmark = pytest.mark.slow

CALIB = {"calib_samples": 4, "calib_seq_len": 32, "device": "cpu", "progress": False}
MTP = "model.mtp.layers.0."
MTP_QUANTIZED = {MTP + m for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip


def raw(ckpt: Checkpoint, name: str) -> tuple[str, tuple[int, ...], bytes]:
    e = ckpt.tensors[name]
    return e.dtype, tuple(e.shape), ckpt.read_raw(e)


def quantized(ckpt: Checkpoint) -> set[str]:
    return {n[: -len(".weight_scale")] for n in ckpt.tensors if n.endswith(".weight_scale")}


@pytest.fixture(scope="module")
def outputs(
    tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], tuple[Path, ConvertResult]]]:
    root = tmp_path_factory.mktemp("mimo-convert")
    done: dict[str, tuple[Path, ConvertResult]] = {}

    def get(mode: str) -> tuple[Path, ConvertResult]:
        if mode not in done:
            out = root / mode
            src = str(tiny_factory("mimo_v2_flash"))
            done[mode] = (out, convert(ConvertOptions(src=src, out=out, mtp=mode, **CALIB)))
        return done[mode]

    yield get


@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_convert_is_healthy_and_carries_the_sources_bytes(
    mode: str, tiny_factory: Callable[[str], Path], outputs: Callable[[str], tuple[Path, ConvertResult]]
) -> None:
    out, result = outputs(mode)
    source, ckpt = Checkpoint.open(tiny_factory("mimo_v2_flash"), strict=True), Checkpoint.open(out, strict=True)
    assert result.plan.recipe.name == "mimo_v2_flash-nvfp4"
    report = inspect_checkpoint(out)
    assert report.healthy, report.verdicts
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    q = quantized(ckpt)
    main_q = {m for m in q if not m.startswith(MTP)}
    assert {"model.layers.1.self_attn.q_proj", "model.layers.0.mlp.down_proj"} <= main_q
    assert any(".mlp.experts." in m for m in main_q) and not any(m.endswith((".mlp.gate", "lm_head")) for m in q)
    carried = [n for n in source.tensors if n.rsplit(".", 1)[0] not in q]
    assert set(carried) <= set(ckpt.tensors)
    assert [n for n in carried if raw(ckpt, n) != raw(source, n)] == []  # every tensor not quantized: bit-identical
    assert ckpt.tensors["model.layers.1.self_attn.attention_sink_bias"].dtype == "BF16"  # the sinks, carried
    mtp_src = sorted(n for n in source.tensors if n.startswith(MTP))
    assert len(mtp_src) == 14
    if mode == "keep":
        assert not {m for m in q if m.startswith(MTP)}
        assert result.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    else:
        assert {m for m in q if m.startswith(MTP)} == MTP_QUANTIZED
        assert all(f"{m}.input_scale" in ckpt.tensors for m in MTP_QUANTIZED)  # W4A4, from the MTP forward
        for group in (("q", "k", "v"), ("gate", "up")):  # vLLM's packed qkv_proj / gate_up_proj: one scale each
            names = [f"{MTP}{'self_attn' if len(group) == 3 else 'mlp'}.{x}_proj" for x in group]
            for leaf in ("weight_scale_2", "input_scale"):
                assert len({ckpt.read_raw(ckpt.tensors[f"{m}.{leaf}"]) for m in names}) == 1, (names, leaf)
        assert result.verdicts["vllm"] == "vLLM: MTP loads (mixed: BF16, NVFP4)"


def test_validate_al_is_the_greedy_replay_of_the_engines_loop(
    tiny_factory: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate's drafts (``chain_logits`` over every row) are, row by row, the engines' loop (``draft_chain``: layer 0
    at every step, its normed output recycled, the target's head), and its AL at k = 1..3 the replay of those drafts
    over the target's greedy sequences (``replay_greedy``)."""
    import torch
    import torch.nn.functional as F

    import mtpquant.measure.replay as replay
    from mtpquant.measure.hidden import load_hidden
    from mtpquant.mtp.build import reference_mtp
    from mtpquant.mtp.drafting import draft_chain
    from mtpquant.validate.run import ValidateOptions, validate

    calls: list[tuple[range, list[list[int]]]] = []
    real = replay.draft_rows

    def recording(layer: Any, teacher: Any, rows: range, *args: Any, **kwargs: Any) -> Any:
        out = real(layer, teacher, rows, *args, **kwargs)
        calls.append((rows, out.tolist()))
        return out

    monkeypatch.setattr(replay, "draft_rows", recording)
    path = tiny_factory("mimo_v2_flash")
    hidden_file = tmp_path / "hidden.safetensors"
    opts = ValidateOptions(reference=str(path), num_prompts=4, max_len=48, k=3, device="cpu", progress=False,
                           save_hidden=hidden_file)  # fmt: skip
    ours = validate(opts).report.reference.acceptance_by_sampling[0].al
    runs, _ = load_hidden(hidden_file)
    ckpt = Checkpoint.open(path)
    mtp: Any = reference_mtp(ckpt.config, {e.name: ckpt.read_tensor(e.name) for e in ckpt.mtp_tensors()},
                             dtype=torch.float32)  # fmt: skip
    table, head = ckpt.read_tensor("model.embed_tokens.weight").float(), ckpt.read_tensor("lm_head.weight").float()
    sequences = runs["ref"].sequences
    assert len(calls) == len(sequences) == 4
    chains = []
    for seq, (rows, drafted) in zip(sequences, calls):
        mine = {}
        for t in rows:
            rows_t, ids = seq.hidden[None, : t + 1].float(), seq.tokens[None, 1 : t + 2]
            mine[t] = draft_chain(mtp, rows_t, ids, lambda x: F.embedding(x, table), head, 3).tokens[0].tolist()
        assert [mine[t] for t in rows] == drafted
        chains.append(mine)
    assert len({d for c in chains for chain in c.values() for d in chain}) > 20  # varied drafts: the check has teeth
    for k in (1, 2, 3):
        records = [r for seq, mine in zip(sequences, chains)
                   for r in replay.replay_greedy(seq.tokens.tolist(), seq.prompt_len, k,
                                                 lambda t, n, mine=mine: mine[t][:n], seq.end)]  # fmt: skip
        assert ours[k - 1] == pytest.approx(1.0 + sum(r.accepted for r in records) / len(records), abs=1e-12), k
