"""A local, stdlib-only stand-in for the Hugging Face Hub HTTP API, for tests.

`LocalHub` serves model repos stored as plain directories on a threaded HTTP server bound to 127.0.0.1, in the
URL layout `huggingface_hub` (1.x) talks to, so the **real** client can be pointed at it with
``endpoint=hub.endpoint`` (``hf_hub_download``, ``snapshot_download``, ``HfApi(endpoint=...)``,
``HfFileSystem(endpoint=...)``) and exercised without network access or patching its HTTP layer.

Storage layout (``root`` is the directory given to `LocalHub`)::

    root/<org>/<name>/                     files of the repo's ``main`` branch, as-is
    root/<org>/<name>@<quoted-revision>/   any other revision: ``name@dev``, ``name@refs%2Fpr%2F1`` ...
    root/.localhub/                        scratch space of the server (temporary files of commits)

A revision's commit sha is derived from the ``(path, size, mtime_ns, inode)`` of its files, so it changes
as soon as anything in the directory changes (also when a test edits files directly); the server reports it
in ``X-Repo-Commit`` / ``sha`` and accepts it (or a >= 7 character prefix) wherever a revision is expected.
Older commits are not kept: a sha only resolves while its revision still has that content.

File object ids are content hashes (git blob sha1; sha256 for files at or above ``lfs_threshold``, which are
reported as LFS files like on the Hub: ``X-Linked-Etag``/``X-Linked-Size`` headers and ``lfs`` entries in
tree listings), computed lazily and cached by file stat. For multi-GB repos pass ``hash_contents=False`` to
get cheap stat-derived ids instead (then unchanged re-uploads are not detected as no-ops).

Uploads take the Hub's paths: every new repo gets the Hub's default ``.gitattributes``; preupload answers
``"lfs"`` for what it marks (``*.safetensors`` among them) and ``"regular"`` (contents inline in the NDJSON
commit) for the rest; LFS objects go through the Git LFS batch API (basic transfer: PUT, verify). Xet is never
offered: ``client_env`` sets ``HF_HUB_DISABLE_XET=1`` and responses never carry ``X-Xet-Hash`` or
``xetHash``, so transfers stay on plain HTTP even with ``hf_xet`` installed (the Xet path itself is untested).
Gated and private repos, 429 with ``Retry-After``, paginated tree listings and faults (no answer, HTML, a
dropped connection, ``Range`` ignored) are in ``behaviour.py``.

Client quirks (huggingface_hub 1.x) that callers must know:

* ``HF_ENDPOINT``, ``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and the token path are read when
  ``huggingface_hub`` is imported; setting them later (``monkeypatch.setenv``) has no effect on an already
  imported client, and the module-level functions (``huggingface_hub.model_info``, ``upload_folder``, ...)
  are bound to an ``HfApi()`` created at import. Pass ``endpoint=hub.endpoint`` / ``HfApi(endpoint=...)`` and
  ``cache_dir=`` explicitly, or wrap the code in ``hub.client_env(home)``, which also covers calls that take
  no such arguments (``HfApi.get_safetensors_metadata`` downloads the shard index into the default cache).
  ``HF_TOKEN`` is read per call.
* fsspec caches ``HfFileSystem`` instances: use ``HfFileSystem(endpoint=..., skip_instance_cache=True)``.
  Its default buffered reads fetch a whole block ahead (up to 5 MiB); ``fs.cat_file(path, start=a, end=b,
  cache_type="none")`` or ``fs.open(path, "rb", cache_type="none")`` + ``seek``/``read`` fetch exactly the
  requested bytes (one ``Range`` GET, after one ``model_info`` and one parent-folder tree listing per fs).
* Editing a served file in place without changing its size within the filesystem's timestamp granularity is
  not noticed (sha and ids are keyed by stat); write new content via a new file (or a different size).
"""

from __future__ import annotations

from tests.support.hubserver.http import RequestRecord
from tests.support.hubserver.hub import LocalHub

__all__ = ["LocalHub", "RequestRecord"]
