"""LocalHub's "the Hub as it really behaves" side: gated and private repos, rate limits, LFS uploads, faults.

- **Access.** ``hub.set_access(repo, "gated" | "private" | "public", granted=tokens)``. A private repo
  answers 401 ``RepoNotFound`` to anyone without a granted token (the Hub does not reveal it exists); a
  gated one lists and describes itself to anyone, but ``/resolve/`` answers 401 ``GatedRepo`` without a
  token and 403 ``GatedRepo`` with one that was not granted access, with the Hub's error headers.
- **Rate limits.** ``hub.rate_limit(kinds, times=N, retry_after=S)``: the next N requests of those kinds
  get 429 with ``Retry-After: S``.
- **Pagination.** ``hub.tree_page_size = K``: tree listings come in pages of K with a
  ``Link: <...>; rel="next"`` header, as the Hub's do (1,000 there).
- **LFS.** Every new repo gets the Hub's default ``.gitattributes``; preupload answers ``lfs`` for the
  paths it marks ``filter=lfs`` (and for files of ``lfs_threshold`` bytes or more), and the Git LFS batch
  API (basic transfer: PUT, then verify) stores the objects the commit then references. Xet is not
  offered (tests run with ``HF_HUB_DISABLE_XET=1``).
- **Faults.** ``hub.fault(mode, kinds)`` for requests of those kinds: ``"html"`` (200 with a captive
  portal's HTML), ``"hang"`` (accept, never answer), ``"drop"`` (headers, half the body, then close);
  ``hub.ignore_range_from = N`` makes ``/resolve/`` ignore ``Range`` for ranges starting at byte N or
  later (a mirror without range support; 0: always). ``LocalHub.refusing_endpoint()`` is an address where
  nothing listens.
"""

from __future__ import annotations

import fnmatch
import hashlib
import socket
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.support.hubserver.http import _HOST, _Hangup, _HttpError, _json_response, _Request, _Response

# The .gitattributes the Hub writes into every new model repo (the LFS part of it).
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
        "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
        "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
        "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*",
    )
)
PORTAL_HTML = b"<!doctype html><html><head><title>Sign in</title></head><body>Wi-Fi login</body></html>"


class BehaviourMixin:
    """Access control, rate limits, pagination, LFS and faults (mixed into LocalHub)."""

    def _init_behaviour(self) -> None:
        self._access: dict[str, str] = {}
        self._granted: dict[str, set[str]] = {}
        self._limits: dict[str, list[Any]] = {}  # kind -> [remaining, retry_after]
        self._faults: dict[str, set[str]] = {}  # mode -> kinds
        self.ignore_range_from: int | None = None
        self.tree_page_size: int | None = None
        self._hang = threading.Event()

    # ------------------------------------------------------------------ configuration (tests)

    def set_access(self, repo_id: str, access: str, *, granted: Iterable[str] = ()) -> None:
        """``public`` | ``gated`` | ``private``; ``granted``: tokens that may read it."""
        if access not in ("public", "gated", "private"):
            raise ValueError(access)
        self._access[repo_id] = access
        self._granted[repo_id] = set(granted)
        self._private[repo_id] = access == "private"  # type: ignore[attr-defined]

    def rate_limit(self, kinds: Iterable[str], *, times: int, retry_after: int = 1) -> None:
        for kind in kinds:
            self._limits[kind] = [times, retry_after]

    def fault(self, mode: str, kinds: Iterable[str] = ("*",)) -> None:
        if mode not in ("html", "hang", "drop"):
            raise ValueError(mode)
        self._faults[mode] = set(kinds)

    def clear_faults(self) -> None:
        self._faults.clear()
        self._limits.clear()
        self.ignore_range_from = None
        self._hang.set()
        self._hang = threading.Event()

    @staticmethod
    def refusing_endpoint() -> str:
        """A local address where nothing listens (connections are refused)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((_HOST, 0))
            port = s.getsockname()[1]
        return f"http://{_HOST}:{port}"

    # ------------------------------------------------------------------ hooks called by the HTTP layer

    def _faulty(self, mode: str, kind: str) -> bool:
        kinds = self._faults.get(mode)
        return kinds is not None and ("*" in kinds or kind in kinds)

    def _before(self, req: _Request) -> _Response | None:
        """After routing has set ``req.kind``: a fault or rate limit answers instead of the route."""
        if self._faulty("hang", req.kind):
            self._hang.wait(600)
            raise _Hangup
        if self._faulty("html", req.kind):
            return _Response(200, {"Content-Type": "text/html; charset=utf-8"}, PORTAL_HTML)
        limit = self._limits.get(req.kind)
        if limit is not None and limit[0] > 0:
            limit[0] -= 1
            raise _HttpError(429, "You have been rate-limited; retry later", headers={"Retry-After": str(limit[1])})
        return None

    def _check_access(self, req: _Request) -> None:
        repo = req.repo_id
        access = self._access.get(repo or "", "public")
        if access == "public":
            return
        auth = req.headers.get("Authorization") or ""
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        if token is not None and token in self._granted.get(repo or "", set()):
            return
        if access == "private":
            raise _HttpError(401, "Repository Not Found", "RepoNotFound")
        if req.kind == "resolve":  # gated: the files are behind the gate, the listing is not
            message = (
                f"Access to model {repo} is restricted. You must have access to it and be authenticated to access it."
                if token is None
                else f"Access to model {repo} is restricted and you are not in the authorized list."
            )
            raise _HttpError(401 if token is None else 403, message, "GatedRepo")

    # ------------------------------------------------------------------ LFS

    def _lfs_dir(self) -> Path:
        path = self.root / ".localhub" / "lfs"  # type: ignore[attr-defined]
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _lfs_object(self, oid: str) -> Path | None:
        if len(oid) != 64 or any(c not in "0123456789abcdef" for c in oid):
            return None
        path = self._lfs_dir() / oid
        return path if path.is_file() else None

    def lfs_patterns(self, rev: Any) -> list[str]:
        """The ``filter=lfs`` patterns of a revision's ``.gitattributes``."""
        st = rev.files.get(".gitattributes") if rev is not None else None
        text = Path(st.path).read_text(encoding="utf-8", errors="replace") if st is not None else DEFAULT_GITATTRIBUTES
        return [line.split()[0] for line in text.splitlines() if "filter=lfs" in line and line.split()]

    def is_lfs_path(self, rev: Any, path: str, size: int | None) -> bool:
        """Whether the Hub would store ``path`` in LFS."""
        name = path.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(name, p) for p in self.lfs_patterns(rev)):
            return True
        threshold = self.lfs_threshold  # type: ignore[attr-defined]
        return threshold is not None and size is not None and size >= threshold

    def _lfs_batch(self, req: _Request) -> _Response:
        data = req.json() or {}
        if data.get("operation") != "upload":
            raise _HttpError(400, "LocalHub's LFS batch API serves uploads only")
        if "basic" not in (data.get("transfers") or ["basic"]):
            raise _HttpError(400, "LocalHub's LFS batch API offers the basic transfer only")
        objects = []
        for obj in data.get("objects", []):
            oid, size = str(obj.get("oid")), obj.get("size")
            entry: dict[str, Any] = {"oid": oid, "size": size}
            if self._lfs_object(oid) is None:
                endpoint = self.endpoint  # type: ignore[attr-defined]
                entry["actions"] = {
                    "upload": {"href": f"{endpoint}/.localhub-lfs/{oid}"},
                    "verify": {"href": f"{endpoint}/{req.repo_id}.git/info/lfs/objects/verify"},
                }
            objects.append(entry)
        return _json_response({"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def _lfs_put(self, req: _Request, oid: str) -> _Response:
        if req.method != "PUT":
            raise _HttpError(405, "LFS objects are uploaded with PUT")
        if hashlib.sha256(req.body).hexdigest() != oid:
            raise _HttpError(400, f"LFS object body does not hash to {oid}")
        tmp = self._lfs_dir() / f".{oid}.tmp"
        tmp.write_bytes(req.body)
        tmp.replace(self._lfs_dir() / oid)
        return _Response(200, {}, b"")

    def _lfs_verify(self, req: _Request) -> _Response:
        data = req.json() or {}
        path = self._lfs_object(str(data.get("oid")))
        if path is None or path.stat().st_size != data.get("size"):
            raise _HttpError(404, f"LFS object {data.get('oid')} not found (or of another size)")
        return _json_response({"oid": data.get("oid"), "size": data.get("size")})
