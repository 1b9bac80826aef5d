"""inspect on a Hub repo: the real huggingface_hub client against a local Hub-layout server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.cli import main as cli
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode
from tests.support.cli import one_error
from tests.support.hubserver import LocalHub

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]
_VOLATILE = {"checkpoint", "bytes_fetched", "requests", "seconds", "serve_commands"}


def _comparable(report: object) -> dict:
    data = report.to_json()  # type: ignore[attr-defined]
    return {k: v for k, v in data.items() if k not in _VOLATILE}


def _upload(hub: LocalHub, repo: str, path: Path) -> None:
    hub.create_repo(repo, {p.relative_to(path).as_posix(): p for p in path.rglob("*") if p.is_file()})


def test_hub_report_equals_local_and_reads_under_one_percent(local_hub: LocalHub, tiny_factory: Factory) -> None:
    path = tiny_factory("qwen3_5_moe")
    _upload(local_hub, "org/tiny-moe", path)
    local = inspect_checkpoint(path)
    local_hub.reset_counters()
    remote = inspect_checkpoint("org/tiny-moe")
    assert _comparable(remote) == _comparable(local)
    assert remote.checkpoint == "org/tiny-moe"
    assert "vllm serve org/tiny-moe" in remote.serve_commands["vllm"]
    served = local_hub.bytes_served  # everything the server sent: listings, JSON, header ranges
    assert served < 0.01 * local.checkpoint_bytes, (served, local.checkpoint_bytes)
    assert 0 < remote.bytes_fetched <= served
    assert remote.requests == len(local_hub.requests) and local.requests == 0  # every request counted
    resolves = [r for r in local_hub.requests if r.kind == "resolve" and r.filename.endswith(".safetensors")]
    assert resolves and all(r.range for r in resolves)  # only ranged reads of shards, never a whole shard


def test_hub_declared_but_missing_and_revision(
    local_hub: LocalHub, naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path
) -> None:
    _upload(local_hub, "org/quant", naive_export_factory("qwen3_next"))
    local_hub.create_branch("org/quant", "v2")
    r = inspect_checkpoint("org/quant", revision="v2")
    assert r.verdicts["vllm"] == "vLLM: MTP declared but missing: speculative decoding will accept nothing"
    assert r.checkpoint == "org/quant@v2"
    # the fix names the repo and its revision as graft takes them, and works
    fix = "mtpquant graft org/quant --revision v2 --from SRC --out quant-mtp"
    assert r.fixes == [f"{fix}   (SRC: the BF16 checkpoint it was made from)"]
    out = tmp_path / "quant-mtp"
    argv = [*fix.split()[1:-4], "--from", str(tiny_factory("qwen3_next")), "--out", str(out)]
    assert cli(argv) == 0
    assert inspect_checkpoint(out).exit_code(strict=True) == 0


def test_a_mistyped_local_path_says_both(
    local_hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``runs/typo`` has the shape of a repo id: it is looked up on the Hub, and the error says that there is no such
    local directory either."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    code, line = one_error(capsys, "inspect", "runs/typo")
    assert code == ExitCode.HUB_ACCESS
    assert line.startswith("mtpquant: error: runs/typo: repository not found on 127.0.0.1:")
    assert line.endswith("; nor is there a local directory runs/typo")
    # a Hub repo id given where only the Hub is meant (publish's --repo) does not get the local hint
    from mtpquant.checkpoint.source import HubSource
    from mtpquant.errors import HubAccessError

    with pytest.raises(HubAccessError) as refused:
        HubSource("runs/typo").list_files()
    assert "local directory" not in str(refused.value)
