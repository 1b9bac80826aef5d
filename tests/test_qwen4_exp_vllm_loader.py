"""vLLM's own Qwen4-Exp loader rules, run on CPU against mtpquant's registry and verdicts.

vLLM cannot build this family on CPU (hyper-connection, PLE and QSA ops are Triton-only; QSA needs
FlashAttention), and importing its model module pulls those in. The rules that decide whether an MTP loads are
plain functions, though: this test reads them from the installed vLLM 0.32 (the test engine's environment,
``tests/support/vllm_env.py``) and runs them unchanged:

- ``_remap_ignored_layers`` / ``_remap_quantized_layers`` / ``_remap_mtp_weight_name``
  (``vllm/models/qwen4_exp/nvidia/mtp.py``): the MTP layer-index remap of names, exclusion and
  quantized_layers entries, and which checkpoint tensors the draft model accepts;
- ``ModelOptMixedPrecisionConfig._resolve_quant_algo`` (``quantization/modelopt.py``): the per-module
  quant_algo of a MIXED_PRECISION checkpoint, and ``_BLOCK_FP8_MOE_ALGOS``.

Each is compared with mtpquant's registry (``MtpLayout.engine_name``, the MTP inventory) and inspect's
``mixed_algo`` on every published-layout fixture. The real serve check is in ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.report import _engine_view
from mtpquant.engine.loading import BLOCK_FP8_MOE_ALGOS, engine_modules, mixed_algo
from mtpquant.families import family
from tests.support.qwen4_exp_quants import QUANT_KINDS, make_qwen4_exp_quant
from tests.support.vllm_source import vllm_functions as _functions
from tests.support.vllm_source import vllm_source as _vllm_source

pytestmark = pytest.mark.dev


@pytest.fixture(scope="module")
def vllm_mtp() -> dict[str, Any]:
    tree = _vllm_source("models/qwen4_exp/nvidia/mtp.py")
    fns = _functions(tree, {"_remap_ignored_layers", "_remap_quantized_layers", "_remap_mtp_weight_name"}, {"re": re})
    mapping = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name == "Qwen4ExpMTP"
        for n in n.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "packed_modules_mapping"
    )
    fns["packed_modules_mapping"] = ast.literal_eval(mapping.value)
    return fns


@pytest.fixture(scope="module")
def vllm_resolve() -> tuple[Callable[..., Any], tuple[str, ...]]:
    """``ModelOptMixedPrecisionConfig._resolve_quant_algo`` bound to a plain object holding the checkpoint's
    quantized_layers and the draft's packed_modules_mapping (the only state it reads)."""
    tree = _vllm_source("model_executor/layers/quantization/modelopt.py")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelOptMixedPrecisionConfig")
    methods = [
        n
        for n in cls.body
        if isinstance(n, ast.FunctionDef) and n.name in ("_resolve_quant_algo", "_quantized_layer_prefix_candidates")
    ]
    algos = next(
        n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_BLOCK_FP8_MOE_ALGOS"
    )
    for m in methods:
        m.decorator_list = []
    ns: dict[str, Any] = {}
    exec(compile(ast.Module(body=methods, type_ignores=[]), "<vllm>", "exec"), ns)

    def resolve(prefix: str, layers: dict[str, Any], packed: dict[str, list[str]]) -> Any:
        shim = SimpleNamespace(quantized_layers=layers, packed_modules_mapping=packed)
        shim._quantized_layer_prefix_candidates = ns["_quantized_layer_prefix_candidates"]
        return ns["_resolve_quant_algo"](shim, prefix)

    return resolve, ast.literal_eval(algos.value)


@pytest.fixture(scope="module")
def quants(tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q4vllm")
    return {k: make_qwen4_exp_quant(tiny_factory("qwen4_exp"), root / k, k) for k in QUANT_KINDS}


def test_layer_remap_is_vllms(vllm_mtp: dict[str, Any], quants: dict[str, Path]) -> None:
    layout = family("qwen4_exp").mtp
    patterns = [
        "mtp*",
        "mtp.layers.0*",
        "mtp.layers.0.mlp.experts.3.down_proj",
        "mtp.fc_hidden",
        "lm_head",
        "*layers.0*",
    ]
    for n in (4, 48):
        assert vllm_mtp["_remap_ignored_layers"](patterns, n) == [layout.engine_name(p, n) for p in patterns]
    for kind, path in quants.items():
        meta = Checkpoint.open(path).quant_metadata
        assert meta is not None, kind
        layers = dict(meta.quantized_layers)
        assert vllm_mtp["_remap_quantized_layers"](layers, 4) == {
            layout.engine_name(k, 4): v for k, v in layers.items()
        }
        assert vllm_mtp["_remap_ignored_layers"](list(meta.exclude), 4) == [
            layout.engine_name(p, 4) for p in meta.exclude
        ]


def test_every_mtp_tensor_of_the_inventory_reaches_the_draft_model(
    vllm_mtp: dict[str, Any], tiny_factory: Callable[[str], Path]
) -> None:
    ckpt = Checkpoint.open(tiny_factory("qwen4_exp"))
    names = [e.name for e in ckpt.mtp_tensors()]
    assert len(names) == 31
    mapped = {n: vllm_mtp["_remap_mtp_weight_name"](n) for n in names}
    assert all(v == "model." + n[len("mtp.") :] for n, v in mapped.items())
    # the draft model ignores every main-model tensor except the shared embedding and lm_head
    assert vllm_mtp["_remap_mtp_weight_name"]("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert vllm_mtp["_remap_mtp_weight_name"]("lm_head.weight") == "lm_head.weight"
    assert vllm_mtp["_remap_mtp_weight_name"]("model.language_model.layers.0.mlp.gate.weight") is None


def test_mixed_precision_resolution_is_vllms(
    vllm_mtp: dict[str, Any], vllm_resolve: tuple[Callable[..., Any], tuple[str, ...]], quants: dict[str, Path]
) -> None:
    resolve, block_algos = vllm_resolve
    assert tuple(block_algos) == BLOCK_FP8_MOE_ALGOS
    rules = family("qwen4_exp").engine
    packed = vllm_mtp["packed_modules_mapping"]
    checked = 0
    for kind in ("nvidia-mixed", "nvidia-mixed-old-label", "nvidia-mixed-refreshed", "nvidia-mixed-engine-index"):
        ckpt = Checkpoint.open(quants[kind])
        meta, n = _engine_view(ckpt, ckpt.quant_metadata)
        assert meta is not None
        layout = ckpt.spec.family.mtp
        for mod in engine_modules(linear_modules({e.name: e for e in ckpt.mtp_tensors()}), rules):
            prefix = layout.engine_name(mod.prefix, n)
            want = resolve(prefix, dict(meta.quantized_layers), packed)
            assert mixed_algo(prefix, meta, rules.packed) == want, (kind, prefix)
            checked += 1
    assert checked > 40


def test_serve_check_script_still_runs() -> None:
    """scripts/qwen4_exp_serve_check.py (the GPU serve check) imports and parses its flags on any machine."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "qwen4_exp_serve_check.py"
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--vllm-python" in run.stdout, run.stderr[-500:]


_VLLM_CONFIG_PROBE = r"""
import json, sys
from vllm.engine.arg_utils import EngineArgs
out = {}
for path in sys.argv[1:]:
    try:
        args = EngineArgs(model=path, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                          enforce_eager=True, dtype="bfloat16", max_model_len=1024,
                          limit_mm_per_prompt={"image": 0, "video": 0})
        cfg = args.create_engine_config()
        d = cfg.speculative_config.draft_model_config.hf_config
        out[path] = {"draft": d.architectures, "n_predict": d.n_predict,
                     "quant": cfg.quant_config.get_name() if cfg.quant_config else None}
    except Exception as exc:
        out[path] = {"error": str(exc)[:3000]}
print("PROBE " + json.dumps(out))
"""


@pytest.mark.engine
def test_vllms_config_path_accepts_the_mtp_and_refuses_the_day0_label(
    quants: dict[str, Path], tiny_factory: Callable[[str], Path]
) -> None:
    """vLLM's own engine-config path (EngineArgs.create_engine_config: speculative.py's qwen4_exp -> Qwen4ExpMTP
    rewrite, the quantization config) on CPU. Building the MTP itself, even on the meta device, stops at vLLM 0.32
    models/qwen4_exp/nvidia/qsa.py 253: NotImplementedError("Qwen4Exp QSA requires FlashAttention")."""
    import json
    import subprocess

    from tests.support.vllm_env import vllm_python

    py = vllm_python()
    if not Path(py).exists():
        pytest.skip("the vLLM test engine is not installed (python -m tests.support.vllm_env)")
    paths = [str(tiny_factory("qwen4_exp")), *(str(quants[k]) for k in ("nvidia-mixed", "nvfp4-mtp-excluded", "alias"))]
    run = subprocess.run([str(py), "-c", _VLLM_CONFIG_PROBE, *paths], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line is not None, run.stderr[-2000:]
    got = json.loads(line[len("PROBE ") :])
    mtp = {"draft": ["Qwen4ExpMTP"], "n_predict": 1}
    assert got[paths[0]] == {**mtp, "quant": None}
    assert got[paths[1]] == {**mtp, "quant": "modelopt_mixed"}
    assert got[paths[2]] == {**mtp, "quant": "modelopt_fp4"}
    assert "qwen3_8_flash_next" in got[paths[3]]["error"]  # transformers in vLLM's env does not know the label
