"""A bad value, an existing OUT or an unreachable Hub id is refused before torch, transformers or modelopt load.

Loading them takes seconds (1.3-10 s measured on a busy machine: `heal --steps 0`, `validate --k 0`, convert into
an existing OUT, a Hub id that cannot be reached), so a refusal that needs none of them must come first. Each case
runs the CLI in a fresh interpreter and reads its ``sys.modules`` when the command has returned: the libraries were
never imported, not merely imported fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpquant.engine.launch import free_port
from mtpquant.errors import ExitCode
from mtpquant.records.provenance import PROVENANCE_FILE, Provenance, Step
from mtpquant.synth.train import TINY_MTP_ASSET

pytestmark = pytest.mark.dev

REPO = Path(__file__).resolve().parents[1]
TINY = str(TINY_MTP_ASSET)
HEAVY = ("torch", "transformers", "modelopt")
_RUN = (
    "import json, sys\n"
    "from mtpquant.cli import main\n"
    "code = main(sys.argv[1:])\n"
    f"print(json.dumps({{'code': code, 'loaded': sorted(m for m in {HEAVY!r} if m in sys.modules)}}))\n"
)


def _cli(*argv: str, env: dict[str, str] | None = None) -> tuple[int, list[str], str]:
    """``mtpquant ARGV`` in a fresh interpreter: (exit code, the heavy libraries it loaded, its one stderr line)."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        timeout=120,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtpquant: error: "), proc.stderr
    return result["code"], result["loaded"], lines[0][len("mtpquant: error: ") :]


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (("heal", TINY, "--from", TINY, "--out", "{tmp}/healed", "--steps", "0"), ExitCode.USAGE,
         "--steps must be >= 1, got 0"),
        (("heal", TINY, "--from", TINY, "--out", "{tmp}/exists"), ExitCode.OUTPUT_EXISTS,
         "{tmp}/exists: output already exists; heal never overwrites (choose a new --out)"),
        (("validate", TINY, "--temperature", "-1"), ExitCode.USAGE,
         "--temperature/--top-p/--top-k/--rule: temperature must be >= 0, got -1.0"),
        (("validate", TINY, "--k", "0"), ExitCode.USAGE, "--k must be >= 1, got 0"),
        (("validate", TINY, TINY, "--report-dir", "{tmp}/exists/file/r"), ExitCode.IO,
         "{tmp}/exists/file: not a directory, so the report cannot be written there"),
        (("convert", TINY, "{tmp}/exists"), ExitCode.OUTPUT_EXISTS,
         f"{{tmp}}/exists: not a checkpoint mtpquant wrote (no readable {PROVENANCE_FILE}; it holds 1 entry: file); "
         "not replacing it (--overwrite replaces only a checkpoint mtpquant wrote): remove it yourself or choose "
         "another output"),
        (("convert", TINY, "{tmp}/ours"), ExitCode.OUTPUT_EXISTS,
         "{tmp}/ours: output already exists (use --overwrite to replace it)"),
        (("convert", TINY, "{tmp}/out", "--resume-every", "0"), ExitCode.USAGE, "--resume-every must be >= 1, got 0"),
    ],
    ids=["heal-steps", "heal-out-exists", "validate-temperature", "validate-k", "validate-report-dir",
         "convert-into-a-folder-not-ours", "convert-into-our-output", "convert-resume-every"],
)  # fmt: skip
def test_refused_before_the_libraries_load(
    argv: tuple[str, ...], code: int, message: str, tmp_path: Path
) -> None:
    """What the user saw took 1.3-10 s (the libraries loading first); the refusal is the same line, without them.
    Converting into a folder mtpquant did not write used to suggest --overwrite, which then refused it."""
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "file").write_text("x")
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / PROVENANCE_FILE).write_bytes(Provenance((Step("convert", ("mtpquant",)),)).to_bytes())
    before = sorted(p.name for p in tmp_path.iterdir())
    got = _cli(*(a.format(tmp=tmp_path) for a in argv))
    assert got == (code, [], message.format(tmp=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize(
    "argv",
    [("convert", "org/model", "{tmp}/out"), ("validate", "org/model"),
     ("heal", "org/model", "--from", "org/model", "--out", "{tmp}/out"),
     ("graft", "org/model", "--from", "org/model", "--out", "{tmp}/out")],
    ids=["convert", "validate", "heal", "graft"],
)  # fmt: skip
def test_an_unreachable_hub_id_is_refused_at_once(argv: tuple[str, ...], tmp_path: Path) -> None:
    """A Hub that refuses connections: exit 30 in one line, before any library loads (convert took 10 s, heal 3-10 s:
    its plan read QUANT's weights through torch before SRC was open)."""
    port = free_port()  # nothing listens there
    code, loaded, message = _cli(
        *(a.format(tmp=tmp_path) for a in argv), env={"HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    )
    assert (code, message) == (
        ExitCode.HUB_UNREACHABLE, f"org/model: cannot reach 127.0.0.1:{port} ([Errno 111] Connection refused)"
    )
    assert loaded == [] and list(tmp_path.iterdir()) == []


def test_a_silent_hub_gets_one_request_and_one_wait(tmp_path: Path) -> None:
    """A Hub that accepts connections and never answers: huggingface_hub's telemetry used to ask it for its agent
    harness list first (a second request, waited out up to its 3 s timeout before mtpquant's own request waited its
    MTPQUANT_HUB_TIMEOUT; on every run, nothing being cached). The CLI turns that telemetry off unless the user set
    HF_HUB_DISABLE_TELEMETRY: the Hub sees only mtpquant's request."""
    import time

    from tests.support.rawhttp import RawRequest, RawServer

    def silent(request: RawRequest, sock: object) -> None:
        time.sleep(10)

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_TELEMETRY"}  # as a user's shell has it
    with RawServer(silent) as hub:
        proc = subprocess.run(
            [sys.executable, "-m", "mtpquant", "inspect", "org/model"],
            capture_output=True, text=True, cwd=REPO, timeout=60,
            env={**env, "PYTHONPATH": str(REPO), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
                 "MTPQUANT_HUB_TIMEOUT": "1"},
        )  # fmt: skip
        paths = [r.path.split("?")[0] for r in hub.requests]
    assert proc.returncode == ExitCode.HUB_UNREACHABLE and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert paths == ["/api/models/org/model/tree/main"]
