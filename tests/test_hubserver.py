"""LocalHub exercised with the real huggingface_hub client (no patching of its HTTP layer)."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    HfFileSystem,
    constants,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.torch import save_file

from tests.support.hubserver import LocalHub

pytestmark = pytest.mark.dev

REPO = "org/tiny"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with LocalHub(tmp_path / "hub") as server, server.client_env(tmp_path / "hf_home"):
        yield server
    assert server.errors == []


def _api(hub: LocalHub, token: str | bool = False) -> HfApi:
    return HfApi(endpoint=hub.endpoint, token=token)


def _raw(
    url: str, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_download_file_headers_and_listing(hub: LocalHub, tmp_path: Path) -> None:
    repo_dir = hub.create_repo(
        REPO, {"config.json": '{"model_type": "qwen3"}', "sub/notes.txt": "hello\n"}, gitattributes=False
    )
    api = _api(hub)

    path = hf_hub_download(
        REPO, "sub/notes.txt", endpoint=hub.endpoint, cache_dir=tmp_path / "c", token=False
    )
    assert Path(path).read_bytes() == b"hello\n"
    assert hub.commit_sha(REPO) in path  # cache snapshot folder is named after X-Repo-Commit

    meta = get_hf_file_metadata(hf_hub_url(REPO, "config.json", endpoint=hub.endpoint), token=False)
    assert meta.commit_hash == hub.commit_sha(REPO)
    assert meta.etag == _git_blob_sha1((repo_dir / "config.json").read_bytes())
    assert meta.size == (repo_dir / "config.json").stat().st_size
    assert meta.xet_file_data is None  # downloads stay on plain HTTP even with hf_xet installed

    info = api.model_info(REPO)
    assert info.sha == hub.commit_sha(REPO)
    assert {(s.rfilename, s.size) for s in info.siblings or []} == {("config.json", 23), ("sub/notes.txt", 6)}
    assert api.list_repo_files(REPO) == ["config.json", "sub/notes.txt"]
    assert api.file_exists(REPO, "config.json") and not api.file_exists(REPO, "missing.json")
    assert not api.file_exists("org/nope", "config.json")
    assert [(e.path, type(e).__name__) for e in api.list_repo_tree(REPO)] == [
        ("config.json", "RepoFile"),
        ("sub", "RepoFolder"),
    ]
    assert [p.path for p in api.get_paths_info(REPO, ["sub", "sub/notes.txt", "nope"])] == [
        "sub",
        "sub/notes.txt",
    ]


def test_ranged_reads_fetch_only_the_requested_bytes(hub: LocalHub) -> None:
    data = os.urandom(300_000)
    hub.create_repo(REPO, {"blob.bin": data})
    fs = HfFileSystem(endpoint=hub.endpoint, token=False, skip_instance_cache=True)

    hub.reset_counters()
    assert fs.cat_file(f"{REPO}/blob.bin", start=1000, end=1064, cache_type="none") == data[1000:1064]
    assert hub.bytes_served_for(REPO, "blob.bin") == 64
    with fs.open(f"{REPO}/blob.bin", "rb", block_size=1 << 20, cache_type="none") as f:
        f.seek(250_000)
        assert f.read(10) == data[250_000:250_010]
    assert hub.bytes_served_for(REPO, "blob.bin") == 74
    ranges = [r.range for r in hub.requests if r.kind == "resolve"]
    assert ranges == ["bytes=1000-1063", "bytes=250000-250009"]

    # The default buffered file reads ahead a whole block: that's what cache_type="none" avoids.
    hub.reset_counters()
    assert fs.cat_file(f"{REPO}/blob.bin", start=0, end=8) == data[:8]
    assert hub.bytes_served_for(REPO, "blob.bin") > 8

    url = hub.file_url(REPO, "blob.bin")
    status, headers, body = _raw(url, {"Range": "bytes=10-19"})
    assert (status, headers["Content-Range"], body) == (206, "bytes 10-19/300000", data[10:20])
    assert headers["X-Repo-Commit"] == hub.commit_sha(REPO)
    assert _raw(url, {"Range": "bytes=299990-"})[2] == data[-10:]
    assert _raw(url, {"Range": "bytes=-5"})[2] == data[-5:]
    assert _raw(url, {"Range": "bytes=299999-400000"})[2] == data[-1:]
    status, headers, _ = _raw(url, {"Range": "bytes=300000-"})
    assert (status, headers["Content-Range"]) == (416, "bytes */300000")
    assert _raw(url, {"Range": "bytes=0-1,5-6"})[:1] == (200,)  # multi-range: ignored, whole file
    status, headers, body = _raw(url, method="HEAD")
    assert (status, headers["Content-Length"], body) == (200, "300000", b"")


def test_safetensors_metadata_of_a_sharded_repo(hub: LocalHub, tmp_path: Path) -> None:
    repo_dir = hub.create_repo(REPO)
    shards = {
        "model-00001-of-00002.safetensors": {"a.weight": torch.zeros(256, 256), "a.bias": torch.zeros(256)},
        "model-00002-of-00002.safetensors": {"b.weight": torch.zeros(512, 256, dtype=torch.bfloat16)},
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, repo_dir / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 256 * 256 * 4 + 256 * 4 + 512 * 256 * 2}, "weight_map": weight_map}
    (repo_dir / "model.safetensors.index.json").write_text(json.dumps(index))

    meta = _api(hub).get_safetensors_metadata(REPO)
    assert meta.sharded and meta.weight_map == weight_map
    assert meta.parameter_count == {"F32": 256 * 256 + 256, "BF16": 512 * 256}
    assert meta.files_metadata["model-00002-of-00002.safetensors"].tensors["b.weight"].shape == [512, 256]
    for name in shards:  # headers only: one ranged GET of at most 100 kB per shard, never the whole shard
        gets = [r for r in hub.requests if r.filename == name and r.method == "GET"]
        assert [r.range for r in gets] == ["bytes=0-100000"]
        assert hub.bytes_served_for(REPO, name) <= 100_001 < (repo_dir / name).stat().st_size
    # The index went through hf_hub_download into the default cache, which client_env moved into tmp_path.
    assert list(
        (tmp_path / "hf_home" / "hub").glob("models--org--tiny/snapshots/*/model.safetensors.index.json")
    )

    info = _api(hub).model_info(REPO)
    assert info.safetensors is not None and info.safetensors.total == 256 * 256 + 256 + 512 * 256


def test_snapshot_download_with_allow_patterns(hub: LocalHub, tmp_path: Path) -> None:
    hub.create_repo(REPO, {"config.json": "{}", "tok/vocab.json": "[]", "weights.bin": os.urandom(4096)})
    hub.reset_counters()
    folder = snapshot_download(
        REPO, allow_patterns=["*.json"], endpoint=hub.endpoint, cache_dir=tmp_path / "c", token=False
    )
    got = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())
    assert got == ["config.json", "tok/vocab.json"]
    assert hub.bytes_served_for(REPO, "weights.bin") == 0
    assert Path(folder).name == hub.commit_sha(REPO)


def test_create_repo_and_upload_folder_round_trip(hub: LocalHub, tmp_path: Path) -> None:
    api = _api(hub)
    src = tmp_path / "src"
    (src / "sub" / "deep").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")  # goes through validate-yaml
    (src / "sub" / "deep" / "x.bin").write_bytes(os.urandom(1000))
    big = os.urandom(10 * 1024 * 1024 + 17)
    (src / "big.safetensors").write_bytes(big)

    url = api.create_repo(REPO)
    assert url.repo_id == REPO and url.startswith(hub.endpoint)
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo(REPO)
    assert err.value.response.status_code == 409
    assert api.create_repo(REPO, exist_ok=True).repo_id == REPO

    info = api.upload_folder(repo_id=REPO, folder_path=src, commit_message="first upload")
    assert info.oid == hub.commit_sha(REPO)
    repo_dir = hub.repo_dir(REPO)
    local = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    # the Hub writes its default .gitattributes into a new repo; the rest is what was uploaded
    assert sorted(p.relative_to(repo_dir) for p in repo_dir.rglob("*") if p.is_file()) == sorted(
        [*local, Path(".gitattributes")]
    )
    # *.safetensors and *.bin are LFS by that .gitattributes: the client took the Git LFS path for those two
    # (one batch, then a PUT and a verify each) and sent the rest inline in the commit
    lfs = [r.kind for r in hub.requests if r.kind.startswith("lfs_")]
    assert lfs[0] == "lfs_batch" and sorted(lfs[1:]) == ["lfs_upload"] * 2 + ["lfs_verify"] * 2, lfs
    for rel in local:
        assert (repo_dir / rel).read_bytes() == (src / rel).read_bytes(), rel

    (entry,) = api.get_paths_info(REPO, "big.safetensors")
    assert entry.lfs is not None and entry.lfs.sha256 == hashlib.sha256(big).hexdigest()
    assert [c.title for c in api.list_repo_commits(REPO)] == ["first upload"]

    again = api.upload_folder(repo_id=REPO, folder_path=src)  # nothing changed: no new commit
    assert again.oid == info.oid == hub.commit_sha(REPO)
    assert not [r for r in hub.requests if r.kind == "commit" and r.status != 200]

    path = hf_hub_download(
        REPO, "big.safetensors", endpoint=hub.endpoint, cache_dir=tmp_path / "c", token=False
    )
    assert Path(path).read_bytes() == big
    assert Path(path).resolve().name == hashlib.sha256(big).hexdigest()  # LFS blobs are cached by sha256


def test_create_pr(hub: LocalHub, tmp_path: Path) -> None:
    hub.create_repo(REPO, {"config.json": "{}", "old.txt": "old"}, gitattributes=False)
    api = _api(hub)
    main_sha = hub.commit_sha(REPO)

    ops = [CommitOperationAdd("new.txt", b"new"), CommitOperationDelete("old.txt")]
    info = api.create_commit(REPO, ops, commit_message="propose", create_pr=True)
    assert (info.pr_revision, info.pr_num) == ("refs/pr/1", 1)
    assert info.pr_url == f"{hub.endpoint}/{REPO}/discussions/1"
    assert hub.commit_sha(REPO) == main_sha  # main untouched
    assert api.list_repo_files(REPO) == ["config.json", "old.txt"]
    assert api.list_repo_files(REPO, revision="refs/pr/1") == ["config.json", "new.txt"]
    assert info.oid == api.model_info(REPO, revision="refs/pr/1").sha
    pr_file = hf_hub_download(
        REPO, "new.txt", revision="refs/pr/1", endpoint=hub.endpoint, cache_dir=tmp_path / "c", token=False
    )
    assert Path(pr_file).read_text() == "new"

    folder = tmp_path / "extra"
    folder.mkdir()
    (folder / "more.txt").write_text("more")
    second = api.upload_folder(repo_id=REPO, folder_path=folder, path_in_repo="extra", create_pr=True)
    assert second.pr_revision == "refs/pr/2"
    assert api.list_repo_files(REPO, revision="refs/pr/2") == ["config.json", "extra/more.txt", "old.txt"]
    prs = api.list_repo_refs(REPO, include_pull_requests=True).pull_requests
    assert [r.ref for r in prs or []] == ["refs/pr/1", "refs/pr/2"]


def test_token_is_required_and_never_logged(tmp_path: Path) -> None:
    token = "hf_localhub_test_token"
    with LocalHub(tmp_path / "hub", token=token) as hub, hub.client_env(tmp_path / "hf_home"):
        hub.create_repo(REPO, {"config.json": "{}"})
        for bad in (False, "hf_wrong"):
            with pytest.raises(HfHubHTTPError) as err:
                _api(hub, bad).model_info(REPO)
            assert err.value.response.status_code == 401
            with pytest.raises(HfHubHTTPError) as err:
                hf_hub_download(
                    REPO, "config.json", endpoint=hub.endpoint, cache_dir=tmp_path / "c", token=bad
                )
            assert err.value.response.status_code == 401
        assert {r.status for r in hub.requests} == {401}

        hub.reset_counters()
        path = hf_hub_download(
            REPO, "config.json", endpoint=hub.endpoint, cache_dir=tmp_path / "c", token=token
        )
        assert Path(path).read_text() == "{}"
        _api(hub, token).upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=REPO)
        fs = HfFileSystem(endpoint=hub.endpoint, token=token, skip_instance_cache=True)
        assert fs.cat_file(f"{REPO}/x.txt") == b"x"
        assert hub.requests and all(r.has_auth and r.status < 400 for r in hub.requests)
        assert token not in repr(hub.requests)
        assert hub.errors == []


def test_revisions_branches_and_shas(hub: LocalHub, tmp_path: Path) -> None:
    repo_dir = hub.create_repo(REPO, {"config.json": '{"v": 1}'})
    api = _api(hub)
    cache = tmp_path / "c"
    sha1 = hub.commit_sha(REPO)

    api.create_branch(REPO, branch="dev")
    api.upload_file(path_or_fileobj=b'{"v": 2}', path_in_repo="config.json", repo_id=REPO, revision="dev")
    dev_sha = hub.commit_sha(REPO, "dev")
    assert dev_sha != sha1 and hub.commit_sha(REPO) == sha1
    branches = {b.name: b.target_commit for b in api.list_repo_refs(REPO).branches}
    assert branches == {"main": sha1, "dev": dev_sha}

    def download(revision: str) -> str:
        path = hf_hub_download(
            REPO, "config.json", revision=revision, endpoint=hub.endpoint, cache_dir=cache, token=False
        )
        return Path(path).read_text()

    assert download("main") == '{"v": 1}'
    assert download("dev") == '{"v": 2}'
    assert download(dev_sha) == '{"v": 2}'
    assert api.model_info(REPO, revision=sha1[:10]).sha == sha1  # short sha prefixes resolve too

    (repo_dir / "config.json").write_text('{"v": 33}')  # direct edit = new commit on main
    sha3 = hub.commit_sha(REPO)
    assert sha3 != sha1 and download("main") == '{"v": 33}'
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision=sha1)  # history is not kept
    with pytest.raises(RevisionNotFoundError):
        api.list_repo_files(REPO, revision="nope")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.json", endpoint=hub.endpoint, cache_dir=cache, token=False)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")


def test_client_env_points_module_level_api_at_the_hub(hub: LocalHub, tmp_path: Path) -> None:
    hub.create_repo(REPO, {"config.json": "{}"})
    # Inside client_env (see fixture), calls without endpoint=/cache_dir= reach the hub and the temp cache.
    assert huggingface_hub.model_info(REPO).sha == hub.commit_sha(REPO)
    path = Path(huggingface_hub.hf_hub_download(REPO, "config.json"))
    assert path.is_relative_to(tmp_path / "hf_home" / "hub")
    assert HfApi().endpoint == hub.endpoint == constants.ENDPOINT


def test_client_env_restores_the_configuration(tmp_path: Path) -> None:
    before = (constants.ENDPOINT, constants.HF_HUB_CACHE, os.environ.get("HF_ENDPOINT"))
    with LocalHub(tmp_path / "hub") as hub:
        with hub.client_env(tmp_path / "home"):
            assert Path(constants.HF_HUB_CACHE) == (tmp_path / "home" / "hub").resolve()
        assert (constants.ENDPOINT, constants.HF_HUB_CACHE, os.environ.get("HF_ENDPOINT")) == before
