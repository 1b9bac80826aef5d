"""A stand-in for ``python -m sglang.launch_server`` that fails to start as SGLang 0.5.x does on a CPU without AMX.

No SGLang server can start on this machine (``tests/test_validate_sglang.py`` says why), so ``--engine sglang`` is
started with this package first on ``PYTHONPATH``. Its ``launch_server`` goes through SGLang's start-up in order,
as far as the two refusals a user meets with the tiny Qwen3.5:

1. the processor of the vision-language architecture: transformers' own ``AutoImageProcessor.from_pretrained`` on
   ``--model-path`` (SGLang calls ``AutoProcessor``, which loads the image processor first): a checkpoint without
   ``preprocessor_config.json`` raises transformers' real error, as uncaught as in SGLang's main process;
2. the scheduler's NEXTN draft backend: SGLang chooses ``torch_native`` attention on a CPU without AMX, and its
   ``DraftBackendFactory`` (``sglang/srt/speculative/draft_utils.py``) raises ``ValueError("EAGLE is not supported
   in decode attention backend torch_native")`` (with ``--speculative-num-steps`` above 1: the multi-step decode
   backend; with 1 step, the draft-extend backend's ``"EAGLE is not supported in attention backend ..."``). The
   scheduler logs it (``Scheduler hit an exception: ...``), sends SIGQUIT to the launcher, whose handler logs
   ``Received sigquit from a child process. It usually means the child failed.`` and kills the process tree
   (``kill_process_tree``): the server dies of SIGKILL.

The log of step 2 is reconstructed from those source lines (SGLang's own words), not recorded from a server.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["fake_sglang", "scheduler_refusal"]

_SCHEDULER_REFUSAL = """\
[2026-12-01 19:07:54] Scheduler hit an exception: Traceback (most recent call last):
  ...
  File "sglang/srt/speculative/draft_utils.py", in _create_backend
    raise ValueError(error_template.format(backend_type=backend_type))
ValueError: EAGLE is not supported in {backend_kind}attention backend torch_native

[2026-12-01 19:07:55] Received sigquit from a child process. It usually means the child failed.
"""

_LAUNCH_SERVER = '''\
import os
import signal
import sys

from transformers import AutoImageProcessor

path = sys.argv[sys.argv.index("--model-path") + 1]
steps = int(sys.argv[sys.argv.index("--speculative-num-steps") + 1])
AutoImageProcessor.from_pretrained(path)  # SGLang's AutoProcessor: the image processor first
sys.stdout.write(SCHEDULER_REFUSAL.format(backend_kind="decode " if steps > 1 else ""))
sys.stdout.flush()
os.kill(os.getpid(), signal.SIGKILL)  # the launcher's sigquit handler: kill_process_tree
'''


def scheduler_refusal(steps: int) -> str:
    """The log of step 2 for a NEXTN chain of ``steps`` drafts."""
    return _SCHEDULER_REFUSAL.format(backend_kind="decode " if steps > 1 else "")


def fake_sglang(root: Path) -> Path:
    """Write the stand-in ``sglang`` package under ``root``; returns the directory to put on ``PYTHONPATH``."""
    package = root / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(f"SCHEDULER_REFUSAL = {_SCHEDULER_REFUSAL!r}\n" + _LAUNCH_SERVER)
    return root
