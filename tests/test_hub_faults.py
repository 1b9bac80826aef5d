"""The Hub as it really behaves, through the CLI: unreachable, hanging, HTML-answering, gated, private,
rate-limited, Range-ignoring and connection-dropping servers; each gives one line, its exit code, and no output.

The real huggingface_hub client talks to LocalHub (tests/support/hubserver) on 127.0.0.1; the faults are the
server's, never a patched client.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mtpquant.cli import main
from mtpquant.errors import ExitCode
from tests.support.hubserver import LocalHub

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]
REPO = "org/tiny"


@pytest.fixture
def hub(local_hub: LocalHub, tiny_factory: Factory) -> Iterator[LocalHub]:
    src = tiny_factory("qwen3_5")
    local_hub.create_repo(REPO, {p.name: p for p in src.iterdir() if p.is_file()})
    yield local_hub
    local_hub.clear_faults()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("mtpquant: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_connection_refused(hub: LocalHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = LocalHub.refusing_endpoint()
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    code, err = run(capsys, "inspect", REPO)
    host = endpoint.removeprefix("http://")
    assert code == ExitCode.HUB_UNREACHABLE
    assert one_line(err) == f"mtpquant: error: {REPO}: cannot reach {host} ([Errno 111] Connection refused)"


def test_dns_failure(hub: LocalHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.invalid")
    code, err = run(capsys, "inspect", REPO)
    assert code == ExitCode.HUB_UNREACHABLE
    assert re.fullmatch(rf"mtpquant: error: {REPO}: cannot reach hub\.invalid \(\[Errno -?\d+\] .+\)", one_line(err))


def test_html_instead_of_json(hub: LocalHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.fault("html", ["tree"])
    code, err = run(capsys, "inspect", REPO)
    assert code == ExitCode.HUB_REFUSED
    host = hub.endpoint.removeprefix("http://")
    assert one_line(err) == (
        f"mtpquant: error: {REPO}: listing the repo: {host} answered something that is not the Hub's JSON (a "
        "proxy, mirror or captive portal in the way?)"
    )


def test_a_server_that_never_answers_times_out(
    hub: LocalHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPQUANT_HUB_TIMEOUT", "1.5")
    hub.fault("hang", ["tree"])
    t0 = time.monotonic()
    code, err = run(capsys, "inspect", REPO)
    assert time.monotonic() - t0 < 10
    assert code == ExitCode.HUB_UNREACHABLE
    host = hub.endpoint.removeprefix("http://")
    assert one_line(err) == (
        f"mtpquant: error: {REPO}: listing the repo: no answer from {host} within 1.5 s (MTPQUANT_HUB_TIMEOUT "
        "sets the limit)"
    )


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan"])
def test_a_timeout_that_is_not_seconds_is_refused(
    hub: LocalHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("MTPQUANT_HUB_TIMEOUT", value)  # not silently replaced by the default
    code, err = run(capsys, "inspect", REPO)
    assert (code, one_line(err)) == (
        ExitCode.USAGE,
        f"mtpquant: error: MTPQUANT_HUB_TIMEOUT={value!r}: not a positive number of seconds",
    )


def test_offline_mode(hub: LocalHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, read at import
    code, err = run(capsys, "inspect", REPO)
    assert code == ExitCode.HUB_UNREACHABLE
    assert one_line(err) == (
        f"mtpquant: error: {REPO}: HF_HUB_OFFLINE is set and listing the repo needs the Hub (not in the local cache)"
    )


def test_gated_repo(hub: LocalHub, capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_factory: Factory) -> None:
    hub.set_access(REPO, "gated")
    code, err = run(capsys, "inspect", REPO)
    assert code == ExitCode.HUB_ACCESS
    assert one_line(err) == (
        f"mtpquant: error: {REPO}: gated repo: accept its conditions on its Hub page, then pass a token that has "
        "access (HF_TOKEN or `hf auth login`)"
    )
    assert [r.status for r in hub.requests if r.kind == "resolve"] == [401]  # no retry of a gated file
    # graft from a gated SRC: the same line, nothing written
    out = tmp_path / "out"
    code, err = run(capsys, "graft", str(tiny_factory("qwen3_5")), "--from", REPO, "--out", str(out))
    assert code == ExitCode.HUB_ACCESS and "gated repo" in one_line(err)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_private_repo(hub: LocalHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.set_access(REPO, "private")
    code, err = run(capsys, "inspect", REPO)
    host = hub.endpoint.removeprefix("http://")
    assert code == ExitCode.HUB_ACCESS
    assert one_line(err) == (
        f"mtpquant: error: {REPO}: repository not found on {host}, or private and not readable with the token "
        "given (HF_TOKEN or `hf auth login`)"
    )


def test_rate_limit_is_waited_out_after_retry_after(
    hub: LocalHub, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    hub.rate_limit(["resolve"], times=2, retry_after=1)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="mtpquant"):
        code, _ = run(capsys, "inspect", REPO)
    assert code == 0 and time.monotonic() - t0 >= 2  # two waits of Retry-After: 1
    waits = [r for r in caplog.records if "before retry" in r.getMessage()]
    assert len(waits) == 2 and all(r.levelno == logging.INFO for r in waits)
    host = hub.endpoint.removeprefix("http://")
    assert waits[0].getMessage() == (
        f"{REPO}: reading config.json: {host} answered HTTP 429; waiting 1 s (Retry-After) before retry 1 of 3"
    )


def test_rate_limit_beyond_the_retries(hub: LocalHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.rate_limit(["resolve"], times=100, retry_after=0)
    code, err = run(capsys, "inspect", REPO)
    host = hub.endpoint.removeprefix("http://")
    assert code == ExitCode.HUB_REFUSED
    assert one_line(err) == (
        f"mtpquant: error: {REPO}: reading config.json: rate-limited by {host} (HTTP 429) beyond 3 retries; wait "
        "and rerun, or log in for a higher limit"
    )
    assert len([r for r in hub.requests if r.kind == "resolve"]) == 4  # one try and three retries


def test_a_server_that_ignores_range(hub: LocalHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.ignore_range_from = 0
    code, err = run(capsys, "inspect", REPO)
    assert code == ExitCode.HUB_REFUSED
    size = (hub.repo_dir(REPO) / "config.json").stat().st_size
    assert one_line(err) == (
        f"mtpquant: error: {REPO}: reading config.json: {hub.endpoint.removeprefix('http://')} ignores HTTP Range "
        f"requests (it answered the whole {size}-byte file to a read of {size} bytes); mtpquant reads only the "
        "headers and tensors it needs: use a server that honours Range, or download the repo and pass its directory"
    )


def test_a_connection_dropped_mid_body(hub: LocalHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.fault("drop", ["resolve"])
    code, err = run(capsys, "inspect", REPO)
    assert code == ExitCode.HUB_UNREACHABLE
    line = one_line(err)
    assert line.startswith(f"mtpquant: error: {REPO}: reading config.json: the connection to ") and "broke off" in line


def test_convert_from_an_unreachable_hub_writes_nothing(
    hub: LocalHub, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", LocalHub.refusing_endpoint())
    out = tmp_path / "out"
    code, err = run(capsys, "convert", REPO, str(out), "--keep-mtp", "--device", "cpu")
    assert code == ExitCode.HUB_UNREACHABLE and "cannot reach" in one_line(err)
    assert not out.exists() and list(tmp_path.glob(".out*")) == []


def test_a_paginated_tree_listing_is_followed(hub: LocalHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.tree_page_size = 2  # the Hub pages its tree listings (Link: <...>; rel="next")
    code, _ = run(capsys, "inspect", REPO, "--json")
    pages = [r for r in hub.requests if r.kind == "tree"]
    files = len([p for p in hub.repo_dir(REPO).iterdir() if p.is_file()])
    assert code == 0 and len(pages) == -(-files // 2) > 1  # every page read, the checkpoint complete
