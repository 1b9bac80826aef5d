"""LocalHub's write API: preupload, NDJSON commits (staging and applying operations), branches, PR discussions."""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.support.hubserver.http import (
    _CHUNK,
    _PR_RE,
    _clean_repo_path,
    _HttpError,
    _iso,
    _json_response,
    _Request,
    _Response,
    _Rev,
    _Stat,
)


class CommitsMixin:
    """The write side of the Hub API (mixed into LocalHub)."""

    def _preupload(self, req: _Request, repo_id: str, revision: str) -> _Response:
        data = req.json() or {}
        try:
            rev: _Rev | None = self._resolve_rev(repo_id, revision)
        except _HttpError as e:
            if e.code != "RevisionNotFound":
                raise
            rev = None
        files = []
        for item in data.get("files", []):
            path = item.get("path")
            st = rev.files.get(path) if rev is not None else None
            # as the Hub: LFS for what .gitattributes marks (and large files), inline ("regular") for the rest;
            # the oid of what is there already: sha256 for an LFS file, the git blob sha1 for a regular one
            mode = "lfs" if self.is_lfs_path(rev, str(path), item.get("size")) else "regular"
            kind = "sha256" if mode == "lfs" else "sha1git"
            oid = self._digest(st, kind) if st is not None and self.hash_contents else None
            files.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return _json_response({"files": files, "commitOid": rev.sha if rev is not None else None})

    def _commit(self, req: _Request, repo_id: str, revision: str) -> _Response:
        lines = []
        for raw in req.body.splitlines():
            if raw.strip():
                try:
                    lines.append(json.loads(raw))
                except ValueError as e:
                    raise _HttpError(400, f"Invalid NDJSON line in commit payload: {e}") from e
        header = next((ln.get("value") or {} for ln in lines if ln.get("key") == "header"), {})
        ops = [ln for ln in lines if ln.get("key") != "header"]
        summary = str(header.get("summary") or "Commit")
        description = str(header.get("description") or "")
        with self._lock:
            base = self._resolve_rev(repo_id, revision)
            parent = header.get("parentCommit")
            if parent and parent != base.sha:
                raise _HttpError(412, f"Parent commit {parent} is not the head of {base.name} ({base.sha})")
            state, touched = self._stage(base, ops)
            pr_num: int | None = None
            if req.flag("create_pr"):
                pr_num = self._next_discussion_num(repo_id)
                target_name = f"refs/pr/{pr_num}"
                target_dir = self.repo_dir(repo_id, target_name)
                self._clone_dir(base.dir, target_dir)
                self._discussions.setdefault(repo_id, {})[pr_num] = self._discussion_record(
                    pr_num, summary, description, is_pr=True, base=base.name
                )
            else:
                target_name, target_dir = base.name, base.dir
                if (m := _PR_RE.fullmatch(target_name)) is not None:
                    pr_num = int(m[1])
            self._apply(target_dir, base.files, state, touched)
            new = self._resolve_rev(repo_id, target_name)
            self._commits.setdefault((repo_id, target_name), []).insert(
                0, self._commit_entry(new.sha, summary, description, time.time())
            )
        out: dict[str, Any] = {
            "success": True,
            "commitOid": new.sha,
            "commitUrl": f"{self.endpoint}/{repo_id}/commit/{new.sha}",
            "hookOutput": "",
        }
        if pr_num is not None:
            out["pullRequestUrl"] = f"{self.endpoint}/{repo_id}/discussions/{pr_num}"
        return _json_response(out)

    def _stage(self, base: _Rev, ops: list[dict[str, Any]]) -> tuple[dict[str, _Stat | bytes], set[str]]:
        """Validate commit operations against `base`: returns the final {path: content} and touched paths."""
        state: dict[str, _Stat | bytes] = dict(base.files)
        touched: set[str] = set()
        for op in ops:
            key = op.get("key")
            value = op.get("value") or {}
            if key == "file":
                path = _clean_repo_path(value.get("path"))
                content = value.get("content") or ""
                if value.get("encoding", "base64") == "base64":
                    try:
                        state[path] = base64.b64decode(content, validate=True)
                    except ValueError as e:
                        raise _HttpError(400, f"Invalid base64 content for {path}: {e}") from e
                else:
                    state[path] = str(content).encode("utf-8")
                touched.add(path)
            elif key == "lfsFile":
                path = _clean_repo_path(value.get("path"))
                source = self._find_lfs_object(base.repo_id, str(value.get("oid")), value.get("size"))
                if source is None:
                    raise _HttpError(
                        400,
                        f"LFS object {value.get('oid')} for {path} was never uploaded",
                    )
                state[path] = source
                touched.add(path)
            elif key == "deletedFile":
                path = _clean_repo_path(value.get("path"))
                if path not in state:
                    raise _HttpError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del state[path]
                touched.add(path)
            elif key == "deletedFolder":
                path = _clean_repo_path(value.get("path"), allow_root=True)
                prefix = f"{path}/" if path else ""
                victims = [p for p in state if p.startswith(prefix)]
                if not victims:
                    raise _HttpError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for victim in victims:
                    del state[victim]
                touched.update(victims)
            else:
                raise _HttpError(400, f"Unsupported commit operation {key!r} (LocalHub)")
        for path in state:
            parts = path.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in state:
                    raise _HttpError(400, f"Path conflict: {'/'.join(parts[:i])} is both a file and a folder")
        return state, touched

    def _find_lfs_object(self, repo_id: str, oid: str, size: Any) -> _Stat | None:
        uploaded = self._lfs_object(oid)
        if uploaded is not None:
            st = uploaded.stat()
            if size is None or st.st_size == size:
                return _Stat(str(uploaded), st.st_size, st.st_mtime_ns, st.st_ino)
        for name in self._revision_names(repo_id):
            for st in self._scan(self.repo_dir(repo_id, name)).values():
                if (size is None or st.size == size) and self._digest(st, "sha256") == oid:
                    return st
        return None

    def _apply(
        self,
        target: Path,
        base_files: Mapping[str, _Stat],
        state: Mapping[str, _Stat | bytes],
        touched: set[str],
    ) -> None:
        tmp_dir = self._tmp_dir()
        staged: list[tuple[str, str]] = []  # (tmp file, repo path)
        try:
            for path in sorted(touched):
                if path not in state:
                    continue
                content = state[path]
                fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix="commit-")
                with os.fdopen(fd, "wb") as f:
                    if isinstance(content, bytes):
                        f.write(content)
                    else:
                        with open(content.path, "rb") as src:
                            shutil.copyfileobj(src, f, _CHUNK)
                staged.append((tmp, path))
            for path in sorted(touched):
                if path in base_files and path not in state:
                    (target / path).unlink(missing_ok=True)
                    parent = (target / path).parent
                    while parent != target and parent.is_dir() and not any(parent.iterdir()):
                        parent.rmdir()
                        parent = parent.parent
            for tmp, path in staged:
                dest = target / path
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    Path(tmp).replace(dest)
                except OSError:  # e.g. repo dir symlinked onto another filesystem
                    shutil.move(tmp, dest)
        finally:
            for tmp, _ in staged:
                Path(tmp).unlink(missing_ok=True)

    def _branch(self, req: _Request, repo_id: str, branch: str) -> _Response:
        if not branch or branch.startswith("refs/") or (branch == "main" and req.method == "DELETE"):
            raise _HttpError(400, f"Invalid reference for a branch: {branch}")
        _clean_repo_path(branch)
        with self._lock:
            self._resolve_rev(repo_id, "main")  # 404 if the repo is missing
            dst = self.repo_dir(repo_id, branch)
            if req.method == "DELETE":
                if not dst.is_dir():
                    raise _HttpError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                shutil.rmtree(dst)
                return _json_response({})
            if dst.exists():
                raise _HttpError(409, f"Reference already exists: refs/heads/{branch}")
            data = req.json() or {}
            src = self._resolve_rev(repo_id, data.get("startingPoint") or "main")
            self._clone_dir(src.dir, dst)
        return _json_response({})

    def _next_discussion_num(self, repo_id: str) -> int:
        nums = set(self._discussions.get(repo_id, {}))
        for name in self._revision_names(repo_id):
            if (m := _PR_RE.fullmatch(name)) is not None:
                nums.add(int(m[1]))
        return max(nums, default=0) + 1

    def _discussion_record(self, num: int, title: str, description: str, *, is_pr: bool, base: str) -> dict[str, Any]:
        return {
            "num": num,
            "title": title,
            "description": description,
            "isPullRequest": is_pr,
            "status": "open",
            "createdAt": _iso(time.time()),
            "base": base,
        }

    def _create_discussion(self, req: _Request, repo_id: str) -> _Response:
        data = req.json() or {}
        is_pr = bool(data.get("pullRequest"))
        with self._lock:
            main = self._resolve_rev(repo_id, "main")
            num = self._next_discussion_num(repo_id)
            if is_pr:
                self._clone_dir(main.dir, self.repo_dir(repo_id, f"refs/pr/{num}"))
            self._discussions.setdefault(repo_id, {})[num] = self._discussion_record(
                num,
                str(data.get("title") or ""),
                str(data.get("description") or ""),
                is_pr=is_pr,
                base="main",
            )
        return _json_response({"num": num, "url": f"{self.endpoint}/{repo_id}/discussions/{num}"})

    def _discussion_details(self, repo_id: str, num_text: str) -> _Response:
        self._resolve_rev(repo_id, "main")
        try:
            num = int(num_text)
        except ValueError as e:
            raise _HttpError(400, f"Invalid discussion number: {num_text}") from e
        record = self._discussions.get(repo_id, {}).get(num)
        if record is None:
            if not self.repo_dir(repo_id, f"refs/pr/{num}").is_dir():
                raise _HttpError(404, f"Discussion #{num} not found in {repo_id}")
            record = self._discussion_record(num, f"PR #{num}", "", is_pr=True, base="main")
        details = {
            "num": num,
            "title": record["title"],
            "status": record["status"],
            "createdAt": record["createdAt"],
            "isPullRequest": record["isPullRequest"],
            "repo": {"name": repo_id, "type": "model"},
            "author": {"name": self.user},
            "events": [],
            "changes": {"base": f"refs/heads/{record['base']}"},
            "filesWithConflicts": [],
            "diff": "",
        }
        return _json_response(details)
