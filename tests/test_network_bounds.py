"""Every request to a server is bounded: an overall deadline (a server that drips its answer is cut off), byte caps
on what is read, no redirect to another host for the engine client, and no credential from a URL in any message.

The servers are scripted raw sockets on 127.0.0.1 (``tests/support/rawhttp.py``); the clients are the real ones
(httpx through ``mtpquant.net.http``, huggingface_hub for the Hub), never patched.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtpquant.cli import main
from mtpquant.engine.http import JSON_CAP, EngineHttp
from mtpquant.engine.vllm import VllmClient
from mtpquant.errors import EngineAnswerError, EngineUnreachableError, ExitCode
from mtpquant.net.http import transport_class
from mtpquant.net.hub import API_CAP
from tests.support.rawhttp import RawRequest, RawServer, answer, drip

pytestmark = pytest.mark.dev

REPO = "org/tiny"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("mtpquant: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


def _json(obj: object) -> bytes:
    return answer(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})


def _endless(sock: socket.socket, head: bytes) -> None:
    """Headers, then body bytes until the client hangs up."""
    sock.sendall(head)
    block = b"x" * 65536
    try:
        while True:
            sock.sendall(block)
    except OSError:
        return


@pytest.fixture
def vllm_like() -> Iterator[RawServer]:
    """/version and /v1/models as vLLM answers them, 404 elsewhere."""

    def script(req: RawRequest, sock: socket.socket) -> None:
        if req.path == "/version":
            sock.sendall(_json({"version": "0.32.0"}))
        elif req.path == "/v1/models":
            sock.sendall(_json({"data": [{"id": "m", "max_model_len": 512}]}))
        else:
            sock.sendall(answer(404, b'{"detail":"Not Found"}'))

    with RawServer(script) as server:
        yield server


# ---- the engine client ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_dripping_engine_is_cut_off_at_the_deadline(where: str) -> None:
    whole = _json({"version": "0.32.0"})
    head, _, body = whole.partition(b"\r\n\r\n")

    def script(req: RawRequest, sock: socket.socket) -> None:
        if where == "headers":
            drip(sock, whole, 0.2)
        else:
            sock.sendall(head + b"\r\n\r\n")
            drip(sock, body, 0.2)

    transport_class()  # httpx and httpcore imported before the clock starts (seconds on a busy machine)
    with RawServer(script) as server:
        client = VllmClient(server.url, timeout=1.5)
        t0 = time.monotonic()
        with pytest.raises(EngineUnreachableError) as exc:
            client.info()
        elapsed = time.monotonic() - t0
    assert str(exc.value) == f"{server.url}: no answer to /version within 1.5 s"
    assert 1.4 < elapsed < 3.0  # each byte came within the wait between bytes: only the deadline ends it


def test_an_engine_answer_past_its_cap_is_refused_unread(
    vllm_like: RawServer, capsys: pytest.CaptureFixture[str]
) -> None:
    def script(req: RawRequest, sock: socket.socket) -> None:
        if req.path == "/v1/models":  # no Content-Length: endless until refused
            _endless(sock, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
        else:
            vllm_like.script(req, sock)

    with RawServer(script) as server:
        code, err = run(capsys, "validate", "--server", server.url)
    assert code == ExitCode.ENGINE_ANSWER
    assert err == f"mtpquant: error: {server.url}/v1/models: the answer is larger than {JSON_CAP} bytes"


def test_a_declared_length_past_the_cap_is_refused_before_reading() -> None:
    def script(req: RawRequest, sock: socket.socket) -> None:
        sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {JSON_CAP + 1}\r\n\r\n".encode() + b"{")

    with RawServer(script) as server, pytest.raises(EngineAnswerError) as exc:
        EngineHttp(server.url).json("/v1/models")
    assert str(exc.value) == f"{server.url}/v1/models: the answer is larger than {JSON_CAP} bytes"


def test_an_error_answer_is_read_only_in_part() -> None:
    def script(req: RawRequest, sock: socket.socket) -> None:
        _endless(sock, b"HTTP/1.1 500 Oops\r\nConnection: close\r\n\r\n")

    with RawServer(script) as server, pytest.raises(EngineAnswerError) as exc:
        EngineHttp(server.url, timeout=10).json("/v1/completions", payload={"prompt": [1]})
    assert str(exc.value) == f"{server.url}/v1/completions: HTTP 500"


def test_a_redirect_to_another_host_is_not_followed() -> None:
    with RawServer(lambda req, sock: sock.sendall(_json({"ok": 1}))) as elsewhere:

        def script(req: RawRequest, sock: socket.socket) -> None:
            sock.sendall(answer(307, b"", {"Location": elsewhere.url + req.path}))

        with RawServer(script) as server, pytest.raises(EngineAnswerError) as exc:
            EngineHttp(server.url).json("/v1/completions", payload={"prompt": [1, 2, 3]})
        assert str(exc.value) == (
            f"{server.url}/v1/completions: redirects to another server ({elsewhere.url}); not followed (the request "
            "and its prompts would be sent there)"
        )
        assert elsewhere.requests == []  # the prompts never left for the other host


def test_a_redirect_on_the_same_server_is_followed(vllm_like: RawServer) -> None:
    def script(req: RawRequest, sock: socket.socket) -> None:
        if req.path == "/old/v1/models":
            sock.sendall(answer(308, b"", {"Location": "/v1/models"}))
        else:
            vllm_like.script(req, sock)

    with RawServer(script) as server:
        assert EngineHttp(server.url).json("/old/v1/models") == {"data": [{"id": "m", "max_model_len": 512}]}
        assert [r.path for r in server.requests] == ["/old/v1/models", "/v1/models"]


def test_credentials_in_the_server_url_are_sent_but_never_shown(
    vllm_like: RawServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://alice:s3cret@127.0.0.1:{vllm_like.port}"
    code, err = run(capsys, "validate", "--server", url)  # /tokenize answers 404
    assert code == ExitCode.ENGINE_ANSWER
    assert err == (
        f"mtpquant: error: {vllm_like.url}/tokenize: HTTP 404: Not Found (give the served checkpoint as CHECKPOINT: "
        "its tokenizer makes the prompts)"
    )
    assert "s3cret" not in err and "alice" not in err
    sent = {r.headers.get("authorization") for r in vllm_like.requests}
    assert sent == {"Basic " + base64.b64encode(b"alice:s3cret").decode()}


def test_a_server_key_from_a_file_or_the_environment(
    vllm_like: RawServer, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = tmp_path / "key"
    key.write_text("sk-file-key\n")
    code, err = run(capsys, "validate", "--server", vllm_like.url, "--api-key-file", str(key))
    assert code == ExitCode.ENGINE_ANSWER and "sk-file-key" not in err
    assert {r.headers.get("authorization") for r in vllm_like.requests} == {"Bearer sk-file-key"}
    vllm_like.requests.clear()
    monkeypatch.setenv("MTPQUANT_ENGINE_API_KEY", "sk-env-key")
    code, err = run(capsys, "validate", "--server", vllm_like.url)
    assert code == ExitCode.ENGINE_ANSWER and "sk-env-key" not in err
    assert {r.headers.get("authorization") for r in vllm_like.requests} == {"Bearer sk-env-key"}
    code, err = run(capsys, "validate", "--server", vllm_like.url, "--api-key-file", str(tmp_path / "none"))
    assert code == ExitCode.USAGE
    assert err == f"mtpquant: error: {tmp_path / 'none'}: cannot read the API key file (No such file or directory)"


# ---- the Hub client -------------------------------------------------------------------------------------------


def test_a_dripping_hub_is_cut_off_at_the_deadline(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _json([])

    with RawServer(lambda req, sock: drip(sock, whole, 0.2)) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("MTPQUANT_HUB_TIMEOUT", "1")
        t0 = time.monotonic()
        code, err = run(capsys, "inspect", REPO)
        elapsed = time.monotonic() - t0
    assert code == ExitCode.HUB_UNREACHABLE
    assert err == (
        f"mtpquant: error: {REPO}: listing the repo: 127.0.0.1:{server.port} did not complete its answer within 1 s "
        "plus 1 s per 16 KiB received (a stalled server; MTPQUANT_HUB_TIMEOUT sets the limit)"
    )
    assert elapsed < 4


def test_an_endless_hub_json_answer_is_refused_at_its_cap(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n["
    with RawServer(lambda req, sock: _endless(sock, head)) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        code, err = run(capsys, "inspect", REPO)
    assert code == ExitCode.HUB_REFUSED
    assert err == (
        f"mtpquant: error: {REPO}: listing the repo: 127.0.0.1:{server.port} sent an answer larger than {API_CAP} "
        "bytes; refused"
    )


def test_credentials_in_hf_endpoint_are_never_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://bob:hunter2@127.0.0.1:{port}")
    code, err = run(capsys, "inspect", REPO)
    assert code == ExitCode.HUB_UNREACHABLE
    assert err == f"mtpquant: error: {REPO}: cannot reach 127.0.0.1:{port} ([Errno 111] Connection refused)"
