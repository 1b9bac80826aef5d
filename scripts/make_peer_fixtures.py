"""Make the peer-quant test fixtures: the tiny models quantized by the peers' own tools.

Quants that other tools made are what people ask mtpquant about, so the tests run inspect, validate,
graft and the real vLLM engine on real outputs of those tools, committed under
``tests/fixtures/peers/`` (CI needs no peer install). This script rebuilds them:

- the peers (llm-compressor 0.14 with its compressed-tensors, AutoRound 0.15) are installed into a venv
  of their own outside the clone (their transformers pin differs from ours), with the same torchvision
  guard as the engine environment (``tests/support/vllm_env.py``), which AutoRound's processor
  loading needs;
- sources: the shipped trained tiny Qwen3.5 (dense) and ``mtpquant tiny --variant qwen3_5_moe`` (MoE),
  each with the ``preprocessor_config.json`` every real Qwen3.5 checkpoint ships (AutoRound loads the
  processor of a multimodal model);
- each tool runs in that venv through ``scripts/peers/quantize.py`` exactly as its docs show;
- ``modelopt-hfptq``: our own nvidia-modelopt, the way ModelOpt's ``examples/hf_ptq`` keeps the MTP
  (the BF16 ``mtp.*`` tensors passed to ``export_hf_checkpoint(..., extra_state_dict=...)`` and
  ``model._mtp_layer_prefixes`` set, so ``_add_mtp_exclusions`` adds ``prefix*`` exclusions).

``tests/fixtures/peers/manifest.json`` records, per fixture, the tool, the source and the versions.

    python scripts/make_peer_fixtures.py [--only NAME ...] [--peers-env DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.vllm_env import TORCH_VERSION, patch_torchvision  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "peers"
PEER_PACKAGES = ("llmcompressor==0.14.0.1", "auto-round==0.15.1", "torchvision==0.28.0")
DEFAULT_PEERS_ENV = Path.home() / ".cache" / "mtpquant" / "peers-llmc0.14-ar0.15"
# Qwen2-VL-style image processor settings, as real Qwen3.5 checkpoints ship them.
PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
# fixture name -> (tool, source variant)
PLAN = {
    "llmcompressor-nvfp4-dense": ("llmcompressor-nvfp4", "dense"),
    "llmcompressor-nvfp4-moe": ("llmcompressor-nvfp4", "moe"),
    "autoround-nvfp4-llmc-dense": ("autoround-nvfp4-llmc", "dense"),
    "autoround-nvfp4-llmc-moe": ("autoround-nvfp4-llmc", "moe"),
    "autoround-nvfp4-native-dense": ("autoround-nvfp4-native", "dense"),
    "modelopt-hfptq-dense": ("modelopt-hfptq", "dense"),
    "modelopt-hfptq-moe": ("modelopt-hfptq", "moe"),
}
SOURCES = {"dense": "the shipped trained tiny Qwen3.5 (mtpquant/assets/tiny-qwen3_5-mtp)", "moe": "tiny qwen3_5_moe"}


def peers_python(env: Path) -> Path:
    """The peers' venv, built when missing."""
    py = env / "bin" / "python"
    if not (env / ".ready").is_file():
        shutil.rmtree(env, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PEER_PACKAGES], check=True)
        patch_torchvision(py)
        (env / ".ready").write_text("\n".join(PEER_PACKAGES) + "\n")
    return py


def make_source(variant: str, root: Path) -> Path:
    """A copy of the source checkpoint with the processor config real checkpoints have."""
    from mtpquant.synth.tiny import make_tiny_checkpoint
    from mtpquant.synth.train import TINY_MTP_ASSET

    out = root / f"src-{variant}"
    if variant == "dense":
        shutil.copytree(TINY_MTP_ASSET, out)
    else:
        make_tiny_checkpoint(out, "qwen3_5_moe")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    return out


def calibration_text(root: Path) -> Path:
    """Real text for the peers' calibration: mtpquant's offline corpus (pydoc topics + stdlib source)."""
    from mtpquant.text.corpus import offline_documents

    docs = [text[:2000] for _, text in offline_documents("mixed")][:80]
    path = root / "calibration.txt"
    path.write_text("\n\n".join(docs), encoding="utf-8")
    return path


def modelopt_hfptq(src: Path, out: Path, calib: Path) -> dict[str, str]:
    """NVFP4 with modelopt, keeping the BF16 MTP the way ModelOpt's hf_ptq example does."""
    import importlib.metadata as md

    import modelopt.torch.quantization as mtq
    import torch
    import transformers
    from modelopt.torch.export import export_hf_checkpoint

    from mtpquant.checkpoint.table import Checkpoint

    ckpt = Checkpoint.open(src)
    model = getattr(transformers, ckpt.spec.architecture).from_pretrained(str(src), dtype=torch.bfloat16)
    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    rows = [tok(t, return_tensors="pt").input_ids[:, :128] for t in calib.read_text().split("\n\n")[:16]]

    def loop(m: torch.nn.Module) -> None:
        for ids in rows:
            m(input_ids=ids)

    with torch.no_grad():
        mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, loop)
    mtp = {e.name: ckpt.read_tensor(e.name) for e in ckpt.mtp_tensors()}
    # hf_ptq's load_mtp_weights: one prefix per MTP layer plus the layer-less MTP modules
    layers = sorted({".".join(n.split(".")[:3]) for n in mtp if n.startswith("mtp.layers.")})
    model._mtp_layer_prefixes = [*layers, "mtp"]
    with torch.inference_mode():
        export_hf_checkpoint(model, export_dir=str(out), extra_state_dict=mtp)
    tok.save_pretrained(str(out))
    return {p: md.version(p) for p in ("nvidia-modelopt", "transformers", "torch")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(PLAN), help="rebuild only these fixtures")
    parser.add_argument("--peers-env", type=Path, default=DEFAULT_PEERS_ENV)
    args = parser.parse_args()
    names = args.only or sorted(PLAN)
    manifest_path = FIXTURES / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        calib = calibration_text(root)
        sources = {v: make_source(v, root) for v in {PLAN[n][1] for n in names}}
        for name in names:
            tool, variant = PLAN[name]
            out = root / name
            if tool == "modelopt-hfptq":
                versions = modelopt_hfptq(sources[variant], out, calib)
            else:
                py = peers_python(args.peers_env)
                cmd = [str(py), str(ROOT / "scripts" / "peers" / "quantize.py"), tool, str(sources[variant]), str(out)]
                subprocess.run([*cmd, str(calib)], check=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
                versions = json.loads((out / "peer_versions.json").read_text())["versions"]
                (out / "peer_versions.json").unlink()
            for f in out.iterdir():
                f.chmod(0o644)  # some tools write 0600 shards
            shutil.rmtree(FIXTURES / name, ignore_errors=True)
            shutil.copytree(out, FIXTURES / name)
            manifest[name] = {"tool": tool, "source": SOURCES[variant], "versions": versions}
            print(f"{name}: {sum(f.stat().st_size for f in out.iterdir())} bytes", flush=True)
    manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
