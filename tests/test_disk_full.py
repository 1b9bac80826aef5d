"""A really full disk: convert on a small tmpfs (mounted in a private mount namespace, ``unshare``) ends with exit 19
and one line naming OUT's filesystem, whatever the library that hit it (modelopt's export writes through safetensors,
whose error is not an OSError), and leaves neither a temporary directory nor a lock behind. An error while copying
names the file being written, never the file copied from.

Where a mount namespace cannot be made (no ``unshare``, no user namespaces), the tmpfs tests are skipped; the
injected-fault tests (``tests/test_reliability.py``, ``tests/test_writer.py``) still run.
"""

from __future__ import annotations

import errno
import functools
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint import writer
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.errors import FilesystemError

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]
REPO = Path(__file__).resolve().parents[1]


@functools.cache
def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def _on_small_disk(size: str, mount: Path, *command: str) -> tuple[int, str, list[str]]:
    """Run ``command`` with a tmpfs of ``size`` at ``mount``; returns its exit code, its last stderr line and what it
    left on the tmpfs."""
    if not _can_mount():
        pytest.skip("no mount namespace here (unshare --mount --map-root-user)")
    mount.mkdir(parents=True, exist_ok=True)
    script = (
        f'mount -t tmpfs -o size={size} tmpfs "{mount}" || exit 99; "$@" 2>"{mount}.err"; echo "EXIT $?"; '
        f'ls -A "{mount}"'
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", script, "sh", *command],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "TQDM_DISABLE": "1", "HOME": str(mount.parent), "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    code = int(next(line for line in lines if line.startswith("EXIT "))[5:])
    left = lines[lines.index(f"EXIT {code}") + 1 :]
    err = [line for line in Path(f"{mount}.err").read_text().splitlines() if line.startswith("mtpquant: error:")]
    return code, (err[-1] if err else ""), left


@pytest.mark.slow
@pytest.mark.parametrize(("size", "doing"), [("64k", " while exporting the quantized model"), ("4k", "")])
def test_convert_on_a_full_disk_names_the_filesystem_and_leaves_nothing(
    size: str, doing: str, tiny_factory: Factory, tmp_path: Path
) -> None:
    src = tiny_factory("qwen3_5")
    mount = tmp_path / "small"
    code, err, left = _on_small_disk(
        size, mount, sys.executable, "-m", "mtpquant", "-q", "convert", str(src), str(mount / "out"), "--keep-mtp",
        "--calib-samples", "2", "--calib-seq-len", "32", "--device", "cpu",
    )
    assert code == 19
    assert re.fullmatch(
        rf"mtpquant: error: {re.escape(str(mount / 'out'))}: No space left on device \(the filesystem mounted at "
        rf"{re.escape(str(mount))}, [\d.]+ k?B free\){doing}; nothing was put in place",
        err,
    ), err
    assert left == []  # no temporary directory, no lock, no resume state


_COPY = """
import sys
from pathlib import Path
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.errors import FilesystemError
od = OutputDir(Path(sys.argv[1]) / "out")
try:
    od.link_file(Path(sys.argv[2]), "big.bin", link=False)
except FilesystemError as exc:
    print(exc, file=sys.stderr)
    od.abort()
    sys.exit(19)
"""


def test_a_copy_onto_a_full_disk_names_the_file_written(tmp_path: Path) -> None:
    big = tmp_path / "source-big.bin"
    big.write_bytes(b"x" * 200_000)
    mount = tmp_path / "small"
    if not _can_mount():
        pytest.skip("no mount namespace here (unshare --mount --map-root-user)")
    mount.mkdir()
    script = f'mount -t tmpfs -o size=64k tmpfs "{mount}" && "$@"; echo "EXIT $?"; ls -A "{mount}"'
    proc = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", script, "sh", sys.executable, "-c", _COPY, str(mount),
         str(big)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.splitlines() == ["EXIT 19"]  # and nothing left on the small disk
    assert re.fullmatch(
        rf"{re.escape(str(mount / 'out' / 'big.bin'))}: No space left on device \(the filesystem mounted at "
        rf"{re.escape(str(mount))}, [\d.]+ k?B free\); nothing was put in place\n",
        proc.stderr,
    ), proc.stderr
    assert str(big) not in proc.stderr


def test_any_copy_error_names_the_file_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 100)

    def failing(a: Path, b: Path) -> None:  # shutil reports a failed copy with the *source* as the filename
        raise OSError(errno.EIO, "Input/output error", str(a), None, str(b))

    monkeypatch.setattr(writer.shutil, "copyfile", failing)
    od = OutputDir(tmp_path / "out")
    with pytest.raises(FilesystemError) as exc:
        od.link_file(src, "copy.bin", link=False)
    od.abort()
    written = tmp_path / "out" / "copy.bin"
    assert str(exc.value) == f"{written}: Input/output error (writing it; nothing was put in place)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.bin"]
