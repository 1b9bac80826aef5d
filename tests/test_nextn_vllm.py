"""The families beyond Qwen against vLLM 0.32 itself.

Without a server (vLLM's functions read from its source and run as they are, ``tests/support/vllm_source.py``):

- ``get_spec_layer_idx_from_weight_name`` (``model_executor/models/utils.py``): which checkpoint tensors the
  appended-layer drafters take as their MTP layer, against the registry's name test;
- ``_rewrite_spec_layer_name`` of ``DeepSeekMTP``, ``Glm4MoeMTP`` and ``Step3p5MTP``: glue versus decoder block,
  against the registry's names for the modules vLLM's draft builds (DeepSeek's and GLM's block under the layer's own
  name, ``DeepseekV2DecoderLayer(prefix=layer)``, its head ``{layer}.head``; Step's block under ``mtp_block``).

With the engine (marker ``engine``): vLLM's ``SpeculativeConfig.hf_config_override`` names each family's drafter as
the registry does; and the real vLLM CPU build serves a tiny GLM-4.7-style checkpoint (head_dim 32) with its MTP as
``Glm4MoeMTPModel`` and drafts, after graft put the lost MTP back and ``graft --fix-metadata`` indexed the MTP
file the index had forgotten, while the unrepaired one fails to start the way inspect says. DeepSeek's MLA does not
run on the CPU build (``kv_lora_rank + qk_rope_head_dim`` must be 320, 512 or 576, then "Unsupported block size"):
its serve check is ``scripts/nextn_serve_check.py`` (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.modules import module_of
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.families import family
from mtpquant.graft.run import GraftOptions, fix_metadata, graft
from tests.support.engine import EnginePool, prompt_ids
from tests.support.nextn_quants import make_nextn_quant
from tests.support.vllm_source import vllm_functions, vllm_method, vllm_source

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


@pytest.fixture(scope="module")
def spec_layer() -> Callable[[Any, str], int | None]:
    fns = vllm_functions(vllm_source("model_executor/models/utils.py"), {"get_spec_layer_idx_from_weight_name"}, {})
    return fns["get_spec_layer_idx_from_weight_name"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def quants(tmp_path_factory: pytest.TempPathFactory, tiny_factory: Factory) -> Iterator[Factory]:
    root = tmp_path_factory.mktemp("nextn-vllm")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_nextn_quant(kind, root / kind, tiny_factory("glm4_moe"))
        return made[kind]

    yield get


def _checkpoints(tiny_factory: Factory, quants: Factory) -> list[Path]:
    tinies = [tiny_factory(v) for v in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe", "glm4_moe-copies")]
    return [*tinies, quants("step-bf16"), quants("glm5-next-one-prefix")]


@pytest.mark.slow
def test_vllm_takes_exactly_the_registrys_mtp_layers(
    spec_layer: Callable[[Any, str], int | None], tiny_factory: Factory, quants: Factory
) -> None:
    checked = 0
    for path in _checkpoints(tiny_factory, quants):
        ckpt = Checkpoint.open(path)
        spec = ckpt.spec
        config = SimpleNamespace(num_hidden_layers=spec.text["num_hidden_layers"],
                                 num_nextn_predict_layers=spec.mtp.layers)
        for name in ckpt.tensors:
            got = spec_layer(config, name)
            assert (got is not None) == spec.is_mtp(name), (path.name, name)
            if got is not None:
                assert got == spec.mtp_names.first + spec.mtp_names.depth_of(name)  # type: ignore[operator]
                checked += 1
    assert checked > 200


@pytest.mark.parametrize(
    ("variant", "module", "cls"),
    [
        ("deepseek_v3", "model_executor/models/deepseek_mtp.py", "DeepSeekMTP"),
        # V3.2 and GLM-5: the CPU build's DeepseekV32MTP is DeepSeekMTP (models/deepseek_v32/__init__.py)
        ("deepseek_v32", "model_executor/models/deepseek_mtp.py", "DeepSeekMTP"),
        ("glm_moe_dsa", "model_executor/models/deepseek_mtp.py", "DeepSeekMTP"),
        ("glm4_moe-copies", "model_executor/models/glm4_moe_mtp.py", "Glm4MoeMTP"),
        ("step-bf16", "model_executor/models/step3p5_mtp.py", "Step3p5MTP"),
    ],
)
def test_the_drafts_module_names_are_vllms(
    variant: str, module: str, cls: str, tiny_factory: Factory, quants: Factory
) -> None:
    rewrite = vllm_method(vllm_source(module), cls, "_rewrite_spec_layer_name")
    ckpt = Checkpoint.open(quants(variant) if variant.startswith("step") else tiny_factory(variant))
    spec = ckpt.spec
    for entry in ckpt.mtp_tensors():
        layer = spec.mtp_names.first + spec.mtp_names.depth_of(entry.name)  # type: ignore[operator]
        param = rewrite(None, layer, entry.name)
        mod = module_of(entry.name)
        engine = spec.engine_mtp_name(mod)
        if param.startswith("model.embed_tokens"):  # vLLM shares the embedding copy as the draft's top-level one
            continue
        if cls == "Step3p5MTP":  # SharedHead(prefix=f"{prefix}.shared_head"), the block under mtp_block
            assert engine == module_of(param).replace("shared_head.output", "shared_head.head"), entry.name
        elif ".shared_head.head" in param:  # SharedHead(prefix=layer): ParallelLMHead(prefix=f"{layer}.head")
            assert engine == f"model.layers.{layer}.head"
        else:  # the block's param names gain mtp_block, its modules keep the layer's prefix
            assert engine == module_of(param).replace(".mtp_block.", "."), entry.name


_OVERRIDE_PROBE = r"""
import json, sys
from transformers import AutoConfig, PretrainedConfig
from vllm.config.speculative import SpeculativeConfig
out = {}
for path in sys.argv[1:]:
    try:  # MiMo-7B's model_type needs its remote code: its config as a plain one (the override reads attributes)
        cfg = AutoConfig.from_pretrained(path)
    except ValueError:
        cfg = PretrainedConfig(**json.load(open(path + "/config.json")))
    try:
        got = SpeculativeConfig.hf_config_override(cfg)
        out[path] = {"draft": got.architectures, "n_predict": getattr(got, "n_predict", None)}
    except Exception as exc:
        out[path] = {"error": str(exc)[:500]}
print("PROBE " + json.dumps(out))
"""


@pytest.mark.engine
def test_vllms_config_override_names_the_registrys_drafter(tiny_factory: Factory, quants: Factory) -> None:
    from tests.support.vllm_env import vllm_python

    py = vllm_python()
    if not Path(py).exists():
        pytest.skip("the vLLM test engine is not installed (python -m tests.support.vllm_env)")
    paths = [*_checkpoints(tiny_factory, quants), *(tiny_factory(v) for v in ("nemotron_h", "mimo_v2_flash", "mimo"))]
    run = subprocess.run([str(py), "-c", _OVERRIDE_PROBE, *map(str, paths)], capture_output=True, text=True,
                         timeout=300)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line is not None, run.stderr[-2000:]
    got = json.loads(line[len("PROBE ") :])
    for path in paths:
        spec = Checkpoint.open(path).spec
        assert got[str(path)]["draft"] == [spec.family.engine.drafters["vllm"]], (path.name, got[str(path)])


def _lost(src: Path, out: Path) -> Path:
    """``src`` without its MTP file and its index entries (still declared): what a quantizer that drops it leaves."""
    shutil.copytree(src, out, copy_function=shutil.copy)
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != "mtp.safetensors"}
    (out / INDEX_NAME).write_text(json.dumps(index))
    (out / "mtp.safetensors").unlink()
    return out


@pytest.mark.engine
def test_vllm_drafts_with_the_repaired_glm_and_refuses_the_unrepaired_as_inspect_said(
    vllm: EnginePool, tiny_factory: Factory, tmp_path: Path
) -> None:
    """One server: the MTP graft put back into a GLM-4.7-style checkpoint that lost it, whose index then forgot the
    MTP's file, indexed again by graft --fix-metadata. Before the repair vLLM must fail to start as inspect says."""
    src = tiny_factory("glm4_moe")
    grafted = graft(GraftOptions(quant=_lost(src, tmp_path / "lost"), source=src, out=tmp_path / "grafted"))
    shard = grafted.new_shards[0]
    forgot = tmp_path / "forgot"
    shutil.copytree(tmp_path / "grafted", forgot, copy_function=shutil.copy)
    index = json.loads((forgot / INDEX_NAME).read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != shard}
    (forgot / INDEX_NAME).write_text(json.dumps(index))
    report = inspect_checkpoint(forgot)
    said = "ValueError: Following weights were not initialized from checkpoint"
    assert report.verdicts["vllm"].endswith(said) and report.fixes == [
        f"mtpquant graft {forgot} --fix-metadata --out forgot-fixed"
    ]
    error = vllm.start_failure(forgot, 2)
    assert "Following weights were not initialized from checkpoint" in str(error)
    log = re.search(r"\(log: (.+)\)$", str(error))
    assert log is not None  # the error line is cut at 400 characters; the weights' set comes in any order
    assert "eh_proj" in Path(log.group(1)).read_text()  # the draft's MTP layer, not the trunk
    fixed = fix_metadata(forgot, out=tmp_path / "fixed")
    assert fixed.action == "metadata" and inspect_checkpoint(tmp_path / "fixed").healthy
    server = vllm.get(tmp_path / "fixed", 2)
    assert "Glm4MoeMTPModel" in server.server.log_path.read_text()
    prompts, lengths = prompt_ids(tmp_path / "fixed", 4, max_len=64)
    before = server.client.counters(server.model)
    done = server.client.complete(server.model, prompts, lengths)
    drafted = server.client.counters(server.model).minus(before)
    assert len(done) == 4 and all(len(c.tokens) == n for c, n in zip(done, lengths))
    assert drafted.drafts > 0 and drafted.draft_tokens >= 2 * drafted.drafts
    assert family("glm4_moe").engine.drafters["vllm"] == "Glm4MoeMTPModel"


@pytest.mark.slow
def test_gpu_serve_check_builds_its_cases_and_agrees_with_inspect(tmp_path: Path) -> None:
    """scripts/nextn_serve_check.py (the DeepSeek MTP serve check of scripts/gpu_check.sh) builds its cases on any
    machine; inspect's verdicts on them are the ones the GPU run compares vLLM with."""
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "nextn_serve_check.py"
    run = subprocess.run(
        [sys.executable, str(script), "--vllm-python", "none", "--dry-run", "--work", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-1000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert {r["case"]: r["inspect"].startswith("vLLM: MTP loads") for r in rows} == {
        "tiny-bf16": True, "mtp-lost": False, "mtp-grafted": True, "nextn-grafted": True
    }
    lost = next(r["inspect"] for r in rows if r["case"] == "mtp-lost")
    assert lost.endswith("ValueError: MTP speculative decoding layer 2 weights missing from checkpoint")
