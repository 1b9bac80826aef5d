"""Nothing private leaves: publish scans every file it would upload (whatever its suffix or size, streamed; of a
weight shard its header and ``__metadata__``) for any Hub token and for local directory paths, and convert records
the calibration file by its base name."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.cli import main
from mtpquant.errors import ExitCode
from mtpquant.publish.files import SCAN_CHUNK
from tests.support.quants import with_mtp

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]
FOREIGN = "hf_" + "SomeoneElsesToken" + "x" * 17  # shaped like a Hub user token (hf_ + 34 letters and digits)


@pytest.fixture(scope="module")
def template(naive_export_factory: Factory, tiny_factory: Factory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_mtp(naive_export_factory("qwen3_5"), tiny_factory("qwen3_5"), tmp_path_factory.mktemp("p") / "q")


@pytest.fixture
def out(template: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "OUT"
    shutil.copytree(template, dst)
    return dst


def _publish(capsys: pytest.CaptureFixture[str], out: Path) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["-q", "publish", str(out), "--repo", "org/name", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_any_hub_token_in_a_file_of_any_suffix(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (out / "run.state").write_bytes(b"\x00\x01 token=" + FOREIGN.encode() + b"\n")
    code, err = _publish(capsys, out)
    assert code == ExitCode.PUBLISH_REFUSED
    assert err == (
        f"mtpquant: error: {out}/run.state contains a Hub token (hf_...); refusing to upload it (remove the token "
        "from it)"
    )
    assert FOREIGN not in err


def test_the_token_in_use_past_64_mb_and_across_a_seam(
    out: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "hf_TheTokenInUseHereForTheTest0123456789"
    monkeypatch.setenv("HF_TOKEN", token)
    big = out / "cache.bin.part"
    with big.open("wb") as fh:  # sparse: 70 MB of holes, the token at the end
        fh.truncate(70 * 1024 * 1024)
        fh.seek(70 * 1024 * 1024 - 100)
        fh.write(token.encode())
    code, err = _publish(capsys, out)
    assert code == ExitCode.PUBLISH_REFUSED
    assert err == f"mtpquant: error: {big} contains the Hub token; refusing to upload it (remove the token from it)"
    big.unlink()
    seam = out / "notes"
    seam.write_bytes(b"." * (SCAN_CHUNK - 10) + token.encode() + b"\n")  # split between two pieces of the scan
    code, err = _publish(capsys, out)
    assert code == ExitCode.PUBLISH_REFUSED and err.startswith(f"mtpquant: error: {seam} contains the Hub token")


def _set_metadata(shard: Path, metadata: dict[str, str]) -> None:
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"] = metadata
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_a_shard_header_is_scanned(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = sorted(out.glob("*.safetensors"))[0]
    _set_metadata(shard, {"format": "pt", "uploaded_with": FOREIGN})
    code, err = _publish(capsys, out)
    assert code == ExitCode.PUBLISH_REFUSED
    assert err == (
        f"mtpquant: error: {shard} contains a Hub token (hf_...); refusing to upload it (remove the token from its "
        "header)"
    )
    _set_metadata(shard, {"format": "pt", "source": f"{Path.home()}/models/secret-project/ckpt"})
    code, err = _publish(capsys, out)
    assert code == ExitCode.PUBLISH_REFUSED
    assert err == (
        f"mtpquant: error: {shard} names the local path {str(Path.home()).rstrip('/')}/...; refusing to upload it (a "
        "directory layout is private: name local directories by their base name, or remove the file)"
    )


@pytest.mark.slow
def test_the_calibration_file_is_recorded_by_its_base_name(tiny_factory: Factory, tmp_path: Path) -> None:
    from mtpquant.api import ConvertOptions, convert

    private = tmp_path / "private-corpus" / "customer-chats"
    private.mkdir(parents=True)
    calib = private / "calib.txt"
    calib.write_text("\n\n".join(f"Paragraph {i} of text the model reads while it calibrates." for i in range(40)))
    out = tmp_path / "out"
    convert(
        ConvertOptions(
            src=str(tiny_factory("qwen3_5")),
            out=out,
            calib_data=str(calib),
            calib_samples=2,
            calib_seq_len=32,
            device="cpu",
            progress=False,
            command=("mtpquant", "convert", "SRC", str(out), "--calib-data", str(calib)),
        )
    )
    recipe = (out / "mtpquant_recipe.yaml").read_text()
    assert "  data: calib.txt\n" in recipe
    for f in out.rglob("*"):
        if f.is_file() and not f.name.endswith(".safetensors"):
            assert b"private-corpus" not in f.read_bytes(), f


def test_recorded_command_lines_hold_no_secret() -> None:
    from mtpquant.public import public_args

    args = ["serve", "/home/me/models/q", "--api-key", "sk-live-1", "--token=hf_abc", "--server", "http://u:pw@h:8/"]
    assert public_args(args) == ("serve", "q", "--api-key", "***", "--token=***", "--server", "http://h:8/")
