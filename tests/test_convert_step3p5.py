"""convert and validate on Step-3.5-Flash (``step3p5``: three appended MTP layers ``model.layers.{N..N+2}``, each with
its own head ``shared_head.output``): ``--mtp keep`` and ``--mtp quantize`` on the tiny checkpoint, inspect healthy,
carried bytes exact, the MTP quantized as vLLM's Step3p5MTP builds it, and validate's AL equal to a greedy replay
of the engines' drafting loop.

What vLLM 0.32 builds (``model_executor/models/step3p5_mtp.py``): ``eh_proj`` a plain ``nn.Linear`` (never quantized),
the norms ``GemmaRMSNorm``, the block (``Step3p5DecoderLayer``: q/k/v packed into ``qkv_proj``, the head-wise gate
``g_proj``, ``o_proj``, the MLP's ``gate_up_proj`` / ``down_proj``) and each layer's head
(``ParallelLMHead(prefix="{layer}.shared_head.head")``) with the draft quant config, so the head stays BF16 by its
exclusion under vLLM's name, as ``lm_head`` does.
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
LAYERS = ("model.layers.2.", "model.layers.3.", "model.layers.4.")
# what --mtp quantize makes NVFP4 in each MTP layer: what vLLM's Step3p5DecoderLayer builds with the quant config
BLOCK = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.g_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
MTP_QUANTIZED = {p + m for p in LAYERS for m in BLOCK}


def is_mtp(name: str) -> bool:
    return name.startswith(LAYERS)


def raw(ckpt: Checkpoint, name: str) -> tuple[str, tuple[int, ...], bytes]:
    e = ckpt.tensors[name]
    return e.dtype, tuple(e.shape), ckpt.read_raw(e)


def quantized(ckpt: Checkpoint) -> set[str]:
    return {n[: -len(".weight_scale")] for n in ckpt.tensors if n.endswith(".weight_scale")}


@pytest.fixture(scope="module")
def outputs(
    tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], tuple[Path, ConvertResult]]]:
    root = tmp_path_factory.mktemp("step3p5-convert")
    done: dict[str, tuple[Path, ConvertResult]] = {}

    def get(mode: str) -> tuple[Path, ConvertResult]:
        if mode not in done:
            out = root / mode
            extra: dict[str, Any] = {"mtp_out": root / "extract-mtp"} if mode == "extract" else {}
            opts = ConvertOptions(src=str(tiny_factory("step3p5")), out=out, mtp=mode, **extra, **CALIB)
            done[mode] = (out, convert(opts))
        return done[mode]

    yield get


@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_convert_is_healthy_and_carries_the_sources_bytes(
    mode: str, tiny_factory: Callable[[str], Path], outputs: Callable[[str], tuple[Path, ConvertResult]]
) -> None:
    out, result = outputs(mode)
    source, ckpt = Checkpoint.open(tiny_factory("step3p5"), strict=True), Checkpoint.open(out, strict=True)
    assert result.plan.recipe.name == "step3p5-nvfp4"
    report = inspect_checkpoint(out)
    assert report.healthy, report.verdicts
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 3 and len(config["layer_types"]) == 5  # the padded lists kept
    q = quantized(ckpt)
    main_q = {m for m in q if not is_mtp(m)}
    # the main model is NVFP4 (attention with its gate, the dense MLP, the experts); the router, norms, head BF16
    assert {"model.layers.0.self_attn.g_proj", "model.layers.0.mlp.down_proj"} <= main_q
    assert any(".mlp.experts." in m for m in main_q) and not any(m.endswith((".mlp.gate", "lm_head")) for m in q)
    carried = [n for n in source.tensors if n.rsplit(".", 1)[0] not in q]
    assert set(carried) <= set(ckpt.tensors)
    assert [n for n in carried if raw(ckpt, n) != raw(source, n)] == []  # every tensor not quantized: bit-identical
    mtp_src = sorted(n for n in source.tensors if is_mtp(n))
    assert len(mtp_src) == 3 * 17
    if mode == "keep":
        assert sorted(n for n in ckpt.tensors if is_mtp(n)) == mtp_src and not {m for m in q if is_mtp(m)}
        assert result.verdicts["vllm"] == "vLLM: MTP loads (BF16)"
    else:
        assert {m for m in q if is_mtp(m)} == MTP_QUANTIZED
        assert all(f"{m}.input_scale" in ckpt.tensors for m in MTP_QUANTIZED)  # W4A4: calibrated by the MTP forward
        # each layer's own head, eh_proj and norms stay BF16 byte for byte (in carried above); the head is excluded by
        # the name vLLM builds it under
        exclusions = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
        assert {p + leaf for p in LAYERS for leaf in ("eh_proj", "shared_head.head")} <= set(exclusions)
        assert result.verdicts["vllm"] == "vLLM: MTP loads (mixed: BF16, NVFP4)"


def test_quantize_calibrates_every_mtp_layer_and_shares_packed_scales(
    outputs: Callable[[str], tuple[Path, ConvertResult]],
) -> None:
    """Each of the three layers ran during calibration (its own input scales), and q/k/v and gate/up share one
    weight_scale_2 and one input_scale each (vLLM's packed qkv_proj and gate_up_proj)."""
    out, _ = outputs("quantize")
    ckpt = Checkpoint.open(out, strict=True)
    for p in LAYERS:
        for group in (("q", "k", "v"), ("gate", "up")):
            names = [f"{p}{'self_attn' if len(group) == 3 else 'mlp'}.{x}_proj" for x in group]
            for leaf in ("weight_scale_2", "input_scale"):
                assert len({ckpt.read_raw(ckpt.tensors[f"{m}.{leaf}"]) for m in names}) == 1, (names, leaf)
    per_layer = [float(ckpt.read_tensor(f"{p}self_attn.o_proj.input_scale")) for p in LAYERS]
    assert all(s > 0 for s in per_layer) and len(set(per_layer)) == 3


def test_drop_cuts_the_padded_lists_and_graft_puts_them_back(
    outputs: Callable[[str], tuple[Path, ConvertResult]], tmp_path: Path
) -> None:
    """Without its MTP the config lists the trunk's layers only (transformers' Step3p7TextConfig refuses a
    ``layer_types`` longer than the layers it builds); graft of the extracted MTP restores the release's padded list:
    the config is keep's again."""
    from mtpquant.graft.run import GraftOptions, graft

    keep, _ = outputs("keep")
    for mode in ("drop", "extract"):
        out, _ = outputs(mode)
        config = json.loads((out / "config.json").read_text())
        assert config["num_nextn_predict_layers"] == 0 and len(config["layer_types"]) == 2, mode
        assert inspect_checkpoint(out).healthy, mode
    extract, _ = outputs("extract")
    grafted = tmp_path / "grafted"
    graft(GraftOptions(quant=str(extract), source=str(extract.parent / "extract-mtp"), out=grafted))
    assert json.loads((grafted / "config.json").read_text()) == json.loads((keep / "config.json").read_text())


# ---- validate ----------------------------------------------------------------------------------------------------


def test_validate_al_is_the_greedy_replay_of_the_engines_loop(
    tiny_factory: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate's drafts (its batched chains over every row, ``chain_logits``) are, row by row, the engines' loop
    (``draft_chain``: step 0 over the rows so far, then layer i at draft step i with its own head), and its AL at
    k = 1..3 is the replay (``replay_greedy``) of the target's greedy sequences with those drafts."""
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
    path = tiny_factory("step3p5")
    hidden_file = tmp_path / "hidden.safetensors"
    opts = ValidateOptions(reference=str(path), num_prompts=4, max_len=48, k=3, device="cpu", progress=False,
                           save_hidden=hidden_file)  # fmt: skip
    report = validate(opts).report
    ours = report.reference.acceptance_by_sampling[0].al
    runs, _ = load_hidden(hidden_file)
    ckpt = Checkpoint.open(path)
    mtp: Any = reference_mtp(ckpt.config, {e.name: ckpt.read_tensor(e.name) for e in ckpt.mtp_tensors()},
                             dtype=torch.float32)  # fmt: skip
    table, head = ckpt.read_tensor("model.embed_tokens.weight").float(), ckpt.read_tensor("lm_head.weight").float()
    sequences = runs["ref"].sequences
    assert len(calls) == len(sequences) == 4
    chains: list[dict[int, list[int]]] = []
    for seq, (rows, drafted) in zip(sequences, calls):
        mine = {}
        for t in rows:  # the engines' loop from row t: the rows 0..t in one pass, then the chain of 3
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
