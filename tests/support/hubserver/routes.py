"""LocalHub's read API: routing, auth, resolve (ranges), model info, tree, paths-info, refs, whoami, repo admin."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from tests.support.hubserver.behaviour import DEFAULT_GITATTRIBUTES
from tests.support.hubserver.http import (
    _TRUE,
    _HttpError,
    _iso,
    _json_response,
    _parse_range,
    _Request,
    _Response,
    _Rev,
    _split_revision,
)


class RoutesMixin:
    """The read side of the Hub API (mixed into LocalHub)."""

    # ------------------------------------------------------------------ routing

    def _dispatch(self, req: _Request) -> _Response:
        s = req.segs
        if s[:1] == ["api"]:
            req.kind = "api"
            self._check_auth(req)
            return self._route_api(req, s[1:])
        if len(s) >= 4 and s[2] == "resolve":
            req.kind = "resolve"
            req.repo_id = f"{s[0]}/{s[1]}"
            self._check_auth(req)
            rev, rest = _split_revision(s[3:])
            req.revision = rev
            req.filename = "/".join(rest)
            self._check_access(req)
            return self._before(req) or self._resolve_file(req)
        if len(s) == 6 and s[1].endswith(".git") and s[2:5] == ["info", "lfs", "objects"] and req.method == "POST":
            req.kind = f"lfs_{s[5]}"
            req.repo_id = f"{s[0]}/{s[1][: -len('.git')]}"
            self._check_auth(req)
            if s[5] == "batch":
                return self._lfs_batch(req)
            if s[5] == "verify":
                return self._lfs_verify(req)
        if len(s) == 2 and s[0] == ".localhub-lfs":
            req.kind = "lfs_upload"
            return self._lfs_put(req, s[1])
        self._check_auth(req)
        raise _HttpError(501, f"LocalHub does not implement {req.method} {req.path}")

    def _check_auth(self, req: _Request) -> None:
        if self.token is None:
            return
        auth = req.headers.get("Authorization")
        if auth is None:
            raise _HttpError(401, "Authentication required: send 'Authorization: Bearer <token>'")
        if auth != f"Bearer {self.token}":
            raise _HttpError(401, "Invalid credentials in Authorization header")

    def _route_api(self, req: _Request, s: list[str]) -> _Response:
        get = req.method in ("GET", "HEAD")
        post = req.method == "POST"
        if s == ["whoami-v2"] and get:
            req.kind = "whoami"
            return self._whoami(req)
        if s == ["validate-yaml"] and post:
            req.kind = "validate_yaml"
            return _json_response({"errors": [], "warnings": []})
        if s == ["repos", "create"] and post:
            req.kind = "create_repo"
            return self._create_repo(req)
        if s == ["repos", "delete"] and req.method == "DELETE":
            req.kind = "delete_repo"
            return self._delete_repo(req)
        if len(s) >= 3 and s[0] == "models":
            repo_id = req.repo_id = f"{s[1]}/{s[2]}"
            rest = s[3:]
            head, tail = (rest[0], rest[1:]) if rest else ("", [])
            self._check_access(req)
            if not rest and get:
                req.kind = "model_info"
                return self._before(req) or self._model_info(req, repo_id, None)
            if head == "revision" and tail and get:
                req.kind = "model_info"
                req.revision = "/".join(tail)
                return self._before(req) or self._model_info(req, repo_id, req.revision)
            if head == "tree" and tail and get:
                req.kind = "tree"
                req.revision, path_segs = _split_revision(tail)
                return self._before(req) or self._tree(req, repo_id, req.revision, "/".join(path_segs))
            if head == "paths-info" and tail and post:
                req.kind = "paths_info"
                req.revision = "/".join(tail)
                return self._before(req) or self._paths_info(req, repo_id, req.revision)
            if head == "preupload" and tail and post:
                req.kind = "preupload"
                req.revision = "/".join(tail)
                return self._preupload(req, repo_id, req.revision)
            if head == "commit" and tail and post:
                req.kind = "commit"
                req.revision = "/".join(tail)
                return self._commit(req, repo_id, req.revision)
            if head == "commits" and tail and get:
                req.kind = "commits"
                req.revision = "/".join(tail)
                rev = self._resolve_rev(repo_id, req.revision)
                return _json_response(self._history(rev))
            if head == "refs" and not tail and get:
                req.kind = "refs"
                return self._refs(repo_id)
            if head == "branch" and tail and req.method in ("POST", "DELETE"):
                req.kind = "branch"
                return self._branch(req, repo_id, "/".join(tail))
            if head == "discussions" and not tail and post:
                req.kind = "discussions"
                return self._create_discussion(req, repo_id)
            if head == "discussions" and len(tail) == 1 and get:
                req.kind = "discussions"
                return self._discussion_details(repo_id, tail[0])
        elif s[:1] and s[0] in ("datasets", "spaces", "kernels", "buckets"):
            raise _HttpError(404, f"LocalHub serves model repos only: {req.path}", "RepoNotFound")
        raise _HttpError(501, f"LocalHub does not implement {req.method} {req.path}")

    # ------------------------------------------------------------------ read endpoints

    def _resolve_file(self, req: _Request) -> _Response:
        if req.method not in ("GET", "HEAD"):
            raise _HttpError(405, f"Method {req.method} not allowed on /resolve/")
        assert req.repo_id is not None and req.filename is not None
        rev = self._resolve_rev(req.repo_id, req.revision)
        commit = {"X-Repo-Commit": rev.sha}
        st = rev.files.get(req.filename)
        if st is None:
            raise _HttpError(404, f"Entry not found: {req.filename}", "EntryNotFound", headers=commit)
        headers = {**commit, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if self._is_lfs(st):
            sha256 = self._digest(st, "sha256")
            headers.update({"ETag": f'"{sha256}"', "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(st.size)})
        else:
            headers["ETag"] = f'"{self._digest(st, "sha1git")}"'
        range_header = req.headers.get("Range")
        if range_header:
            parsed = _parse_range(range_header, st.size)
            if parsed is False:
                raise _HttpError(
                    416,
                    f"Range not satisfiable: {range_header}",
                    headers={**headers, "Content-Range": f"bytes */{st.size}"},
                )
            if isinstance(parsed, tuple) and (self.ignore_range_from is None or parsed[0] < self.ignore_range_from):
                start, end = parsed
                headers["Content-Range"] = f"bytes {start}-{end}/{st.size}"
                return _Response(206, headers, file=(st.path, start, end - start + 1))
        return _Response(200, headers, file=(st.path, 0, st.size))

    def _model_info(self, req: _Request, repo_id: str, revision: str | None) -> _Response:
        rev = self._resolve_rev(repo_id, revision)
        blobs = req.flag("blobs")
        query = req.query
        expand = query.get("expand", []) + query.get("expand[]", [])
        siblings = []
        for rel, st in rev.files.items():
            sibling: dict[str, Any] = {"rfilename": rel, "size": st.size}
            if blobs:
                sibling["blobId"] = self._blob_oid(st)
                if self._is_lfs(st):
                    sibling["lfs"] = {
                        "size": st.size,
                        "sha256": self._digest(st, "sha256"),
                        "pointerSize": len(self._lfs_pointer(st)),
                    }
            siblings.append(sibling)
        org = repo_id.split("/")[0]
        mtimes = [st.mtime_ns for st in rev.files.values()]
        last_modified = max(mtimes) / 1e9 if mtimes else rev.dir.stat().st_mtime
        info: dict[str, Any] = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": org,
            "sha": rev.sha,
            "lastModified": _iso(last_modified),
            "createdAt": _iso(self.repo_dir(repo_id).stat().st_mtime),
            "private": self._private.get(repo_id, False),
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(st.size for st in rev.files.values()),
        }
        if not expand or "safetensors" in expand:
            safetensors = self._safetensors_summary(rev)
            if safetensors is not None:
                info["safetensors"] = safetensors
        if not expand or "config" in expand:
            config = self._config_summary(rev)
            if config is not None:
                info["config"] = config
        if expand:
            info = {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
        return _json_response(info)

    @staticmethod
    def _safetensors_summary(rev: _Rev) -> dict[str, Any] | None:
        params: dict[str, int] = {}
        found = False
        for rel, st in rev.files.items():
            if not rel.endswith(".safetensors"):
                continue
            try:
                with open(st.path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    if n > 100_000_000:
                        continue
                    header = json.loads(f.read(n))
            except (OSError, ValueError, struct.error):
                continue
            found = True
            for name, tensor in header.items():
                if name == "__metadata__" or not isinstance(tensor, dict):
                    continue
                dtype = str(tensor.get("dtype"))
                params[dtype] = params.get(dtype, 0) + math.prod(tensor.get("shape") or [])
        return {"parameters": params, "total": sum(params.values())} if found else None

    @staticmethod
    def _config_summary(rev: _Rev) -> dict[str, Any] | None:
        st = rev.files.get("config.json")
        if st is None or st.size > 10_000_000:
            return None
        try:
            config = json.loads(Path(st.path).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict):
            return None
        return {k: config[k] for k in ("architectures", "model_type") if k in config}

    def _tree(self, req: _Request, repo_id: str, revision: str, path: str) -> _Response:
        rev = self._resolve_rev(repo_id, revision)
        path = path.strip("/")
        recursive = req.flag("recursive")
        expand = req.flag("expand")
        prefix = f"{path}/" if path else ""
        under = [(rel, st) for rel, st in rev.files.items() if rel.startswith(prefix)]
        if path and not under:
            raise _HttpError(404, f"Entry not found: {path} (not a folder of {revision})", "EntryNotFound")
        entries: dict[str, dict[str, Any]] = {}
        for rel, st in under:
            parts = rel[len(prefix) :].split("/")
            depth = len(parts) if recursive else 1
            for i in range(1, min(depth, len(parts) - 1) + 1):
                folder = prefix + "/".join(parts[:i])
                if folder not in entries:
                    entries[folder] = self._dir_entry(rev, folder, expand)
            if recursive or len(parts) == 1:
                entries[rel] = self._file_entry(rev, rel, st, expand)
        listing = list(entries.values())
        size = self.tree_page_size
        if size is None:
            return _json_response(listing)
        cursor = int((req.query.get("cursor") or ["0"])[-1] or 0)
        page = listing[cursor : cursor + size]
        headers = {}
        if cursor + size < len(listing):
            query = "&".join(p for p in req.raw_query.split("&") if p and not p.startswith("cursor="))
            url = f"{self.endpoint}{quote(req.path)}?{query}{'&' if query else ''}cursor={cursor + size}"
            headers["Link"] = f'<{url}>; rel="next"'
        return _json_response(page, headers=headers)

    def _paths_info(self, req: _Request, repo_id: str, revision: str) -> _Response:
        rev = self._resolve_rev(repo_id, revision)
        content_type = (req.headers.get("Content-Type") or "").lower()
        if "json" in content_type:
            data = req.json() or {}
            paths, expand = data.get("paths", []), bool(data.get("expand"))
        else:
            form = parse_qs(req.body.decode("utf-8"), keep_blank_values=True)
            paths = form.get("paths", [])
            expand = (form.get("expand") or ["false"])[-1].lower() in _TRUE
        if isinstance(paths, str):
            paths = [paths]
        out = []
        for raw in paths:
            path = str(raw).strip("/")
            if path in rev.files:
                out.append(self._file_entry(rev, path, rev.files[path], expand))
            elif path and any(rel.startswith(f"{path}/") for rel in rev.files):
                out.append(self._dir_entry(rev, path, expand))
        return _json_response(out)

    def _refs(self, repo_id: str) -> _Response:
        out: dict[str, list[dict[str, str]]] = {
            "branches": [],
            "converts": [],
            "tags": [],
            "pullRequests": [],
        }
        for name in self._revision_names(repo_id):
            sha = self._resolve_rev(repo_id, name).sha
            if name.startswith("refs/pr/"):
                out["pullRequests"].append({"name": name, "ref": name, "targetCommit": sha})
            elif name.startswith("refs/tags/"):
                out["tags"].append({"name": name[len("refs/tags/") :], "ref": name, "targetCommit": sha})
            elif name.startswith("refs/convert/"):
                out["converts"].append({"name": name[len("refs/convert/") :], "ref": name, "targetCommit": sha})
            else:
                out["branches"].append({"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha})
        return _json_response(out)

    def _whoami(self, req: _Request) -> _Response:
        if req.headers.get("Authorization") is None:
            raise _HttpError(401, "Invalid user token")
        return _json_response(
            {
                "type": "user",
                "id": hashlib.sha1(self.user.encode()).hexdigest()[:24],
                "name": self.user,
                "fullname": self.user,
                "email": f"{self.user}@localhost",
                "emailVerified": True,
                "isPro": False,
                "canPay": False,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "localhub", "role": "write"}},
            }
        )

    # ------------------------------------------------------------------ write endpoints

    def _create_repo(self, req: _Request) -> _Response:
        data = req.json() or {}
        repo_type = data.get("type") or "model"
        if repo_type != "model":
            raise _HttpError(400, f"LocalHub serves model repos only, not {repo_type!r}")
        org = data.get("organization") or self.user
        repo_id = req.repo_id = f"{org}/{data.get('name')}"
        try:
            self._split_repo_id(repo_id)
        except _HttpError as e:
            raise _HttpError(400, f"Invalid repo name: {repo_id!r}") from e
        url = f"{self.endpoint}/{repo_id}"
        with self._lock:
            main = self.repo_dir(repo_id)
            if main.exists():
                # create_repo(exist_ok=True) reads "url" from the 409 body.
                raise _HttpError(409, "You already created this model repo", extra={"url": url})
            main.mkdir(parents=True)
            (main / ".gitattributes").write_text(DEFAULT_GITATTRIBUTES, encoding="utf-8")  # as the Hub does
            self._private[repo_id] = bool(data.get("private")) or data.get("visibility") == "private"
        return _json_response({"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self, req: _Request) -> _Response:
        data = req.json() or {}
        repo_id = req.repo_id = f"{data.get('organization') or self.user}/{data.get('name')}"
        with self._lock:
            names = self._revision_names(repo_id)
            if not self.repo_dir(repo_id).is_dir():
                raise _HttpError(404, f"Repository not found: {repo_id}", "RepoNotFound")
            for name in reversed(names):
                shutil.rmtree(self.repo_dir(repo_id, name), ignore_errors=True)
            self._discussions.pop(repo_id, None)
            for key in [k for k in self._commits if k[0] == repo_id]:
                del self._commits[key]
        return _json_response({})
