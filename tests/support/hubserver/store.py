"""LocalHub's repo storage: revisions as directories, shas from file stats, content ids, LFS pointers, history."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote

from tests.support.hubserver.http import (
    _CHUNK,
    _LFS_POINTER,
    _NAME_RE,
    _SHA_PREFIX_RE,
    _HttpError,
    _iso,
    _Rev,
    _Stat,
)


class StoreMixin:
    """Repos on disk (mixed into LocalHub)."""

    @staticmethod
    def _split_repo_id(repo_id: str) -> tuple[str, str]:
        parts = repo_id.split("/")
        if len(parts) != 2 or not all(_NAME_RE.fullmatch(p) and ".." not in p for p in parts):
            raise _HttpError(404, f"Repository not found: {repo_id!r} (LocalHub needs '<org>/<name>')", "RepoNotFound")
        return parts[0], parts[1]

    def _revision_names(self, repo_id: str) -> list[str]:
        org, name = self._split_repo_id(repo_id)
        names = ["main"]
        org_dir = self.root / org
        prefix = f"{name}@"
        if org_dir.is_dir():
            names += sorted(
                unquote(p.name[len(prefix) :]) for p in org_dir.iterdir() if p.name.startswith(prefix) and p.is_dir()
            )
        return names

    def _scan(self, directory: Path) -> dict[str, _Stat]:
        out: dict[str, _Stat] = {}
        base = str(directory)
        for dirpath, dirnames, filenames in os.walk(base, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            rel_dir = os.path.relpath(dirpath, base).replace(os.sep, "/")
            for fn in filenames:
                full = os.path.join(dirpath, fn)
                try:
                    st = os.stat(full)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                rel = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                out[rel] = _Stat(full, st.st_size, st.st_mtime_ns, st.st_ino)
        return dict(sorted(out.items()))

    @staticmethod
    def _sha(repo_id: str, files: Mapping[str, _Stat]) -> str:
        h = hashlib.sha1(f"localhub:{repo_id}\n".encode())
        for rel, st in files.items():
            h.update(f"{rel}\0{st.signature}\n".encode())
        return h.hexdigest()

    def _resolve_rev(self, repo_id: str, revision: str | None) -> _Rev:
        main = self.repo_dir(repo_id)
        if not main.is_dir():
            raise _HttpError(404, f"Repository not found: {repo_id}", "RepoNotFound")
        name = revision or "main"
        if name.startswith("refs/heads/"):
            name = name[len("refs/heads/") :]
        directory = self.repo_dir(repo_id, name)
        if directory.is_dir():
            files = self._scan(directory)
            return _Rev(repo_id, name, directory, files, self._sha(repo_id, files))
        if _SHA_PREFIX_RE.fullmatch(name):
            for other in self._revision_names(repo_id):
                other_dir = self.repo_dir(repo_id, other)
                files = self._scan(other_dir)
                sha = self._sha(repo_id, files)
                if sha.startswith(name):
                    return _Rev(repo_id, other, other_dir, files, sha)
        raise _HttpError(404, f"Invalid rev id: {name}", "RevisionNotFound")

    def _digest(self, st: _Stat, kind: str) -> str:
        """'sha1git' (git blob id of the content) or 'sha256' of a file, cached by stat."""
        key = (st.path, st.size, st.mtime_ns, st.ino, kind)
        cached = self._digests.get(key)
        if cached is not None:
            return cached
        if self.hash_contents:
            h = hashlib.sha1(f"blob {st.size}\0".encode()) if kind == "sha1git" else hashlib.sha256()
            with open(st.path, "rb") as f:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    h.update(chunk)
            value = h.hexdigest()
        else:
            seed = f"{kind}:{st.path}:{st.signature}".encode()
            value = (hashlib.sha256 if kind == "sha256" else hashlib.sha1)(seed).hexdigest()
        self._digests[key] = value
        return value

    def _is_lfs(self, st: _Stat) -> bool:
        return self.lfs_threshold is not None and st.size >= self.lfs_threshold

    def _lfs_pointer(self, st: _Stat) -> bytes:
        return _LFS_POINTER.format(sha256=self._digest(st, "sha256"), size=st.size).encode()

    def _blob_oid(self, st: _Stat) -> str:
        if self._is_lfs(st):  # like git: the blob is the LFS pointer file
            pointer = self._lfs_pointer(st)
            return hashlib.sha1(f"blob {len(pointer)}\0".encode() + pointer).hexdigest()
        return self._digest(st, "sha1git")

    def _last_commit(self, rev: _Rev) -> dict[str, Any]:
        top = self._history(rev)[0]
        return {"id": top["id"], "title": top["title"], "date": top["date"]}

    def _history(self, rev: _Rev) -> list[dict[str, Any]]:
        with self._lock:
            recorded = list(self._commits.get((rev.repo_id, rev.name), []))
        if not recorded or recorded[0]["id"] != rev.sha:
            mtimes = [st.mtime_ns for st in rev.files.values()]
            ts = max(mtimes) / 1e9 if mtimes else rev.dir.stat().st_mtime
            title = "Initial commit" if not recorded else "Update files"
            recorded.insert(0, self._commit_entry(rev.sha, title, "", ts))
        return recorded

    def _commit_entry(self, sha: str, title: str, message: str, ts: float) -> dict[str, Any]:
        return {
            "id": sha,
            "title": title,
            "message": message,
            "authors": [{"user": self.user}],
            "date": _iso(ts),
        }

    def _file_entry(self, rev: _Rev, path: str, st: _Stat, expand: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": self._blob_oid(st), "size": st.size, "path": path}
        if self._is_lfs(st):
            entry["lfs"] = {
                "oid": self._digest(st, "sha256"),
                "size": st.size,
                "pointerSize": len(self._lfs_pointer(st)),
            }
        if expand:
            entry["lastCommit"] = self._last_commit(rev)
        return entry

    def _dir_entry(self, rev: _Rev, path: str, expand: bool) -> dict[str, Any]:
        h = hashlib.sha1(f"tree:{path}\n".encode())
        prefix = f"{path}/"
        for rel, st in rev.files.items():
            if rel.startswith(prefix):
                h.update(f"{rel}\0{st.signature}\n".encode())
        entry: dict[str, Any] = {"type": "directory", "oid": h.hexdigest(), "size": 0, "path": path}
        if expand:
            entry["lastCommit"] = self._last_commit(rev)
        return entry

    def _clone_dir(self, src: Path, dst: Path) -> None:
        def _link_or_copy(s: str, d: str) -> str:
            if Path(s).stat().st_size >= self.hardlink_threshold:
                try:
                    os.link(s, d)
                    return d
                except OSError:
                    pass
            return cast(str, shutil.copy2(s, d))

        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)

    def _tmp_dir(self) -> Path:
        tmp = self.root / ".localhub" / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp
