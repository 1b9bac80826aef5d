"""LocalHub itself: lifecycle, counters of what was served, repo administration for tests, the client environment."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import threading
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from tests.support.hubserver.behaviour import DEFAULT_GITATTRIBUTES, BehaviourMixin
from tests.support.hubserver.commits import CommitsMixin
from tests.support.hubserver.http import (
    _HOST,
    RequestRecord,
    _clean_repo_path,
    _Request,
    _Response,
    _Server,
)
from tests.support.hubserver.routes import RoutesMixin
from tests.support.hubserver.store import StoreMixin


class LocalHub(StoreMixin, RoutesMixin, CommitsMixin, BehaviourMixin):
    """Threaded Hub-compatible HTTP server on 127.0.0.1 serving repos from ``root`` (see module docstring).

    Use as a context manager (or `start()` / `close()`)::

        with LocalHub(tmp_path / "hub") as hub:
            hub.create_repo("org/model", {"config.json": "{}"})
            hf_hub_download("org/model", "config.json", endpoint=hub.endpoint, cache_dir=tmp_path / "cache")

    Args:
        root: directory holding ``<org>/<name>/`` repo directories (created if missing).
        token: if set, every request must carry ``Authorization: Bearer <token>``, else 401.
        port: 0 picks a free ephemeral port.
        user: user name reported by ``whoami`` and used as namespace when ``create_repo`` gets none.
        lfs_threshold: files of at least this many bytes are reported as LFS files (``None``: never).
        hash_contents: content-hash file ids (default) or derive them from file stats (fast for huge repos).
        hardlink_threshold: when the server clones a revision (new PR / branch), files of at least this size
            are hard-linked instead of copied; the server itself only ever replaces files, never edits them in
            place, but a test that rewrites such a file in place changes it in every clone.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        token: str | None = None,
        port: int = 0,
        user: str = "local-user",
        lfs_threshold: int | None = 10 * 1024 * 1024,
        hash_contents: bool = True,
        hardlink_threshold: int = 16 * 1024 * 1024,
    ) -> None:
        self.root = Path(root).resolve()
        self.token = token
        self.user = user
        self.lfs_threshold = lfs_threshold
        self.hash_contents = hash_contents
        self.hardlink_threshold = hardlink_threshold
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()  # repo mutations
        self._stats_lock = threading.Lock()
        self._digests: dict[tuple[str, int, int, int, str], str] = {}
        self._generation = 0
        self._bytes_total = 0
        self._bytes_by_path: dict[str, int] = {}
        self._requests: list[RequestRecord] = []
        self._errors: list[str] = []
        self._commits: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._discussions: dict[str, dict[int, dict[str, Any]]] = {}
        self._private: dict[str, bool] = {}
        self._init_behaviour()
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> LocalHub:
        if self._server is not None:
            return self
        self._server = _Server(self, self._port)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="LocalHub", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._hang.set()  # release handlers held by a "hang" fault
        server.shutdown()
        server.close_connections()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("LocalHub is not started")
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """Base URL to pass as ``endpoint=`` / ``HF_ENDPOINT``, e.g. ``http://127.0.0.1:43121``."""
        return f"http://{_HOST}:{self.port}"

    # ------------------------------------------------------------------ counters

    @property
    def bytes_served(self) -> int:
        """Total response body bytes written since start / the last `reset_counters()`."""
        with self._stats_lock:
            return self._bytes_total

    @property
    def bytes_served_by_path(self) -> dict[str, int]:
        """Response body bytes per decoded URL path (e.g. ``/org/m/resolve/main/model.safetensors``)."""
        with self._stats_lock:
            return dict(self._bytes_by_path)

    def bytes_served_for(self, repo_id: str, filename: str, *, revision: str | None = None) -> int:
        """Body bytes of ``/resolve/`` responses for one file (any revision unless given)."""
        return sum(
            r.body_bytes
            for r in self.requests
            if r.kind == "resolve"
            and r.repo_id == repo_id
            and r.filename == filename
            and (revision is None or r.revision == revision)
        )

    @property
    def requests(self) -> list[RequestRecord]:
        """Copy of the request log (oldest first)."""
        with self._stats_lock:
            return list(self._requests)

    @property
    def errors(self) -> list[str]:
        """Tracebacks of internal server errors (answered with HTTP 500); empty when all went well."""
        with self._stats_lock:
            return list(self._errors)

    def reset_counters(self) -> None:
        with self._stats_lock:
            self._generation += 1
            self._bytes_total = 0
            self._bytes_by_path.clear()
            self._requests.clear()

    def _record(self, req: _Request, resp: _Response, sent: int) -> tuple[int, int]:
        record = RequestRecord(
            method=req.method,
            path=req.path,
            query=req.raw_query,
            status=resp.status,
            body_bytes=sent,
            range=req.headers.get("Range"),
            has_auth=req.headers.get("Authorization") is not None,
            kind=req.kind,
            repo_id=req.repo_id,
            revision=req.revision,
            filename=req.filename,
        )
        with self._stats_lock:
            self._bytes_total += sent
            self._bytes_by_path[req.path] = self._bytes_by_path.get(req.path, 0) + sent
            self._requests.append(record)
            return self._generation, len(self._requests) - 1

    def _uncount(self, ticket: tuple[int, int], path: str, unsent: int) -> None:
        """Take back body bytes counted by `_record` that could not be written (client went away)."""
        generation, index = ticket
        with self._stats_lock:
            if generation != self._generation:  # reset_counters() ran in between
                return
            self._bytes_total -= unsent
            self._bytes_by_path[path] = self._bytes_by_path.get(path, 0) - unsent
            record = self._requests[index]
            self._requests[index] = dataclasses.replace(record, body_bytes=record.body_bytes - unsent)

    def _record_error(self, req: _Request, exc: BaseException) -> None:
        text = f"{req.method} {req.path}?{req.raw_query}\n" + "".join(traceback.format_exception(exc))
        with self._stats_lock:
            self._errors.append(text)

    # ------------------------------------------------------------------ helpers for tests

    def repo_dir(self, repo_id: str, revision: str = "main") -> Path:
        """Directory holding ``revision`` of ``repo_id`` (whether or not it exists yet)."""
        org, name = self._split_repo_id(repo_id)
        if revision.startswith("refs/heads/"):
            revision = revision[len("refs/heads/") :]
        if revision == "main":
            return self.root / org / name
        return self.root / org / f"{name}@{quote(revision, safe='')}"

    def create_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | str | os.PathLike[str]] | None = None,
        *,
        revision: str = "main",
        exist_ok: bool = False,
        gitattributes: bool = True,
    ) -> Path:
        """Create (or with `exist_ok`, extend) a repo revision on disk.

        `files` maps repo paths to bytes, text, or a local file to copy; a new repo also gets the Hub's default
        ``.gitattributes`` (unless `gitattributes` is False or `files` has one). Returns the revision directory.
        """
        with self._lock:
            main = self.repo_dir(repo_id)
            if revision != "main" and not main.is_dir():
                main.mkdir(parents=True)
            target = self.repo_dir(repo_id, revision)
            if target.exists() and not exist_ok:
                raise FileExistsError(target)
            new = not target.exists()
            target.mkdir(parents=True, exist_ok=True)
            if new and gitattributes and ".gitattributes" not in (files or {}):
                (target / ".gitattributes").write_text(DEFAULT_GITATTRIBUTES, encoding="utf-8")
            for rel, content in (files or {}).items():
                dest = target / _clean_repo_path(rel)
                dest.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(content, bytes):
                    dest.write_bytes(content)
                elif isinstance(content, str):
                    dest.write_text(content, encoding="utf-8")
                else:
                    shutil.copyfile(content, dest)
            return target

    def create_branch(self, repo_id: str, branch: str, *, from_revision: str = "main") -> Path:
        """Create ``branch`` (or any ref, e.g. ``refs/pr/3``) as a copy of ``from_revision``."""
        with self._lock:
            src = self._resolve_rev(repo_id, from_revision)
            dst = self.repo_dir(repo_id, branch)
            if dst.exists():
                raise FileExistsError(dst)
            self._clone_dir(src.dir, dst)
            return dst

    def commit_sha(self, repo_id: str, revision: str = "main") -> str:
        """The sha the server currently reports for ``revision``."""
        return self._resolve_rev(repo_id, revision).sha

    def file_url(self, repo_id: str, filename: str, revision: str = "main") -> str:
        return f"{self.endpoint}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(filename)}"

    @contextlib.contextmanager
    def client_env(self, home: str | os.PathLike[str], *, token: str | None = None) -> Iterator[Path]:
        """Point ``huggingface_hub`` at this hub with an isolated ``HF_HOME`` for the duration of the block.

        Sets ``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_XET_CACHE``, ``HF_TOKEN_PATH``,
        ``HF_HUB_DISABLE_TELEMETRY=1``, ``HF_HUB_DISABLE_XET=1``, unsets ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``
        and sets ``HF_TOKEN`` to `token` (or unsets it). Because ``huggingface_hub`` reads these at import time, if it
        is already imported the matching ``huggingface_hub.constants`` values (``ENDPOINT`` together with
        ``HUGGINGFACE_CO_URL_TEMPLATE``, cache/token paths, ``HF_HUB_OFFLINE``) and the endpoint of the
        module-level ``huggingface_hub.hf_api.api`` singleton (behind ``huggingface_hub.model_info`` & co.)
        are set as well. Only configuration values are touched, never the HTTP machinery; all is restored
        on exit.
        """
        home_path = Path(home).resolve()
        home_path.mkdir(parents=True, exist_ok=True)
        paths = {
            "HF_HOME": str(home_path),
            "HF_HUB_CACHE": str(home_path / "hub"),
            "HF_ASSETS_CACHE": str(home_path / "assets"),
            "HF_XET_CACHE": str(home_path / "xet"),
            "HF_TOKEN_PATH": str(home_path / "token"),
        }
        env: dict[str, str | None] = {
            "HF_ENDPOINT": self.endpoint,
            **paths,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",  # LocalHub speaks Git LFS, not Xet (the Xet path is untested here)
            "HF_HUB_OFFLINE": None,
            "TRANSFORMERS_OFFLINE": None,
            "HUGGINGFACE_HUB_CACHE": None,
            "HUGGINGFACE_ASSETS_CACHE": None,
            "HUGGING_FACE_HUB_TOKEN": None,
            "HF_OIDC_RESOURCE": None,  # would trigger a token exchange with the real Hub
            "HF_TOKEN": token,
        }
        saved_env = {key: os.environ.get(key) for key in env}
        patched: list[tuple[object, str, object]] = []

        def _set(obj: object, attr: str, value: object) -> None:
            if hasattr(obj, attr):
                patched.append((obj, attr, getattr(obj, attr)))
                setattr(obj, attr, value)

        try:
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            constants = sys.modules.get("huggingface_hub.constants")
            if constants is not None:
                values: dict[str, object] = {
                    "ENDPOINT": self.endpoint,
                    "HUGGINGFACE_CO_URL_TEMPLATE": self.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
                    **paths,
                    "HUGGINGFACE_HUB_CACHE": paths["HF_HUB_CACHE"],
                    "HUGGINGFACE_ASSETS_CACHE": paths["HF_ASSETS_CACHE"],
                    "HF_STORED_TOKENS_PATH": str(home_path / "stored_tokens"),
                    "HF_HUB_OFFLINE": False,
                    "HF_HUB_DISABLE_TELEMETRY": True,
                    "HF_HUB_DISABLE_XET": True,
                }
                for attr, new_value in values.items():
                    _set(constants, attr, new_value)
            hf_api = sys.modules.get("huggingface_hub.hf_api")
            singleton = getattr(hf_api, "api", None) if hf_api is not None else None
            if singleton is not None:
                _set(singleton, "endpoint", self.endpoint)
            yield home_path
        finally:
            for obj, attr, original in reversed(patched):
                setattr(obj, attr, original)
            for key, saved in saved_env.items():
                if saved is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = saved

    # ------------------------------------------------------------------ storage
