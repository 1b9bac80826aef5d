"""Resumable layer-wise calibration: the state modelopt keeps per finished layer, beside OUT.

modelopt's layer-wise calibration (``layerwise.checkpoint_dir``) saves each finished layer's
quantizer state and the next layer's inputs, and on restart continues after the last saved
layer. convert gives it ``.<OUT>.mtpquant-resume-<key>/``, where the key is a digest of everything
the calibration depends on: SRC's files (names, sizes, inodes, mtimes), the resolved recipe
(calibration settings included), the calibration rows by their content (a digest of the token ids:
the text of a file edited at the same path, a dataset's revision, the tokenizer and its chat template
all show there), the device, the MTP mode, and the mtpquant / modelopt / torch / transformers
versions. A rerun with the same SRC, OUT, recipe and calibration finds its state and resumes; any
change gives another key, and the state of the old key is removed, never reused. The state is
removed when the output is in place.

The files are modelopt's own (``torch.save``; modelopt loads them with pickle). mtpquant never
loads pickle from a checkpoint; it only hands modelopt a directory it created itself, mode 0700,
owned by the current user, whose ``key.json`` matches. A directory that fails those checks is
removed and calibration starts from the first layer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ACTIVATIONS_SHARE", "RESUME_MARK", "ResumeState", "resume_interval", "resume_key"]

log = logging.getLogger(__name__)

RESUME_MARK = ".mtpquant-resume-"
_KEY_FILE = "key.json"
_MANIFEST = "manifest.json"  # modelopt's: {"last_completed_layer": i, "num_layers": n, ...}


ACTIVATIONS_SHARE = 0.05  # of the estimated output: what the saved layer inputs may add to the bytes written
NVFP4_SHARE = 4.5 / 16  # NVFP4 output bytes per BF16 byte (4-bit values + one fp8 scale per 16)


def resume_interval(layers: int, activation_bytes: int, model_bytes: int) -> int:
    """How many layers modelopt calibrates between commits of the resume state (its ``save_every``).

    Each commit saves the next layer's inputs: ``activation_bytes`` (every calibration row's hidden state). They
    are written for every commit (then pruned), so commit every N layers with N the smallest that keeps them
    within ``ACTIVATIONS_SHARE`` of the output (estimated from the main model's ``model_bytes``): on a large
    model that is every layer or few, on a small one with a large calibration set rarely (its calibration is
    short to redo). A kill resumes after the last commit.
    """
    if layers <= 1 or activation_bytes <= 0:
        return 1
    budget = ACTIVATIONS_SHARE * NVFP4_SHARE * model_bytes
    commits = max(1, int(budget // activation_bytes))
    return max(1, min(layers, -(-layers // commits)))


def resume_key(inputs: Mapping[str, Any]) -> str:
    """The digest of the calibration's inputs (a JSON-able mapping)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def source_stamp(root: Path) -> list[tuple[str, int, int, int]]:
    """(relative name, size, inode, mtime_ns) of every file of a local checkpoint directory."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        try:
            st = p.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((rel.as_posix(), st.st_size, st.st_ino, st.st_mtime_ns))
    return out


@dataclass
class ResumeState:
    """The resume directory of one (OUT, key)."""

    path: Path
    key: str
    start_layer: int = 0  # the first layer this run calibrates
    num_layers: int = 0
    _found_bytes: int = 0  # on disk when this run opened it (an earlier run's)
    _pruned_bytes: int = 0  # deleted by ``prune`` during this run

    @classmethod
    def open(cls, out: Path, inputs: Mapping[str, Any]) -> ResumeState:
        """Find (or create) the state for ``inputs``; remove every other state of OUT.

        Call it holding OUT's lock: no other live run can own a resume directory of OUT then.
        """
        out = Path(out).absolute()
        key = resume_key(inputs)
        path = out.parent / f".{out.name}{RESUME_MARK}{key[:16]}"
        for other in sorted(out.parent.glob(f".{out.name}{RESUME_MARK}*")):
            if other != path:
                log.info("discarding the resume state of an earlier run with another source, recipe or mode: %s",
                         other)
                shutil.rmtree(other, ignore_errors=True)
        state = cls(path, key)
        if path.exists() and not state._trusted():
            log.warning("%s: not a resume directory this user created; removing it and starting afresh", path)
            shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            path.mkdir(mode=0o700)
            try:
                (path / _KEY_FILE).write_text(json.dumps({"key": key, "inputs": inputs}, default=str, indent=1))
            except BaseException:  # a disk too full for its key: no half-made state left behind
                shutil.rmtree(path, ignore_errors=True)
                raise
        state._read_progress()
        state._found_bytes = state.bytes_on_disk()
        return state

    def _trusted(self) -> bool:
        try:
            st = self.path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                return False
            return bool(json.loads((self.path / _KEY_FILE).read_text()).get("key") == self.key)
        except (OSError, ValueError, AttributeError):
            return False

    def _read_progress(self) -> None:
        try:
            manifest = json.loads((self.path / _MANIFEST).read_text())
            last, total = int(manifest["last_completed_layer"]), int(manifest["num_layers"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if 0 <= last + 1 < total:
            self.start_layer, self.num_layers = last + 1, total

    @property
    def checkpoint_dir(self) -> str:
        """What modelopt's ``layerwise.checkpoint_dir`` gets."""
        return str(self.path)

    def prune(self) -> None:
        """Delete the layer inputs no resume can need any more (only the last saved layer's are read)."""
        try:
            last = int(json.loads((self.path / _MANIFEST).read_text())["last_completed_layer"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        for layer_dir in self.path.glob("layer_*"):
            try:
                index = int(layer_dir.name.split("_", 1)[1])
            except ValueError:
                continue
            inputs = layer_dir / "next_inputs.pt"
            if index < last and inputs.is_file():
                self._pruned_bytes += inputs.stat().st_size
                inputs.unlink()

    def bytes_on_disk(self) -> int:
        """Current size of the state."""
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def bytes_written(self) -> int:
        """What this run has written into the state: what is there now, less what it found, plus what it pruned."""
        return max(0, self.bytes_on_disk() - self._found_bytes) + self._pruned_bytes

    def remove(self) -> None:
        """The output is in place: the state is no longer needed."""
        shutil.rmtree(self.path, ignore_errors=True)
