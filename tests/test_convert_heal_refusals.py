"""Late refusals made early: every ``convert --heal`` that heal would refuse once OUT exists is refused by convert's
plan, before any work, with the exit code heal gives and one line; heal's own refusals name the checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mtpquant.convert.run as convert_run
from mtpquant.cli import main as cli
from mtpquant.errors import ExitCode
from mtpquant.graft.run import GraftOptions, graft
from mtpquant.synth.tiny import TinySpec, make_tiny_checkpoint
from mtpquant.synth.train import TINY_MTP_ASSETS
from tests.test_graft import strip_mtp

pytestmark = pytest.mark.dev

ASSET = TINY_MTP_ASSETS["qwen3_5"]
Q4 = TINY_MTP_ASSETS["qwen4_exp"]
NO_HEAL = "--mtp {} leaves OUT without its MTP, so --heal would have nothing to heal (use --mtp keep or --mtp quantize)"
CT = (
    "--format compressed-tensors --mtp quantize stores OUT's MTP as compressed-tensors NVFP4; heal writes back BF16, "
    "ModelOpt NVFP4 and ModelOpt FP8 per tensor (use --format modelopt, or --mtp keep)"
)
MEMORY = (
    "--heal: --max-memory cpu=1MiB leaves the model's first weights (the embedding, 1.05 MB) on disk, where "
    "modelopt's export cannot run the model from: they and the room accelerate keeps for one layer need 2.69 MB "
    "(raise the cap); nothing was converted"
)
# (SRC, extra flags, exit code, the one line): each converted in full and then refused by heal before
CASES = {
    "qwen4_exp-extract": (Q4, ["--mtp", "extract"], ExitCode.HEAL_REFUSED, NO_HEAL.format("extract")),
    "mtp-drop": (ASSET, ["--mtp", "drop"], ExitCode.HEAL_REFUSED, NO_HEAL.format("drop")),
    "mtp-extract": (ASSET, ["--mtp", "extract"], ExitCode.HEAL_REFUSED, NO_HEAL.format("extract")),
    "ct-quantize": (ASSET, ["--format", "compressed-tensors", "--mtp", "quantize"], ExitCode.HEAL_REFUSED, CT),
    "steps": (ASSET, ["--heal-steps", "0"], ExitCode.USAGE, "--heal-steps must be >= 1, got 0"),
    "lr": (ASSET, ["--heal-lr", "0"], ExitCode.USAGE, "--heal-lr must be positive, got 0.0"),
    "samples": (ASSET, ["--heal-samples", "0"], ExitCode.USAGE, "--heal-samples must be >= 1, got 0"),
    "data": (ASSET, ["--heal-data", "/nonexistent/heal.txt"], ExitCode.USAGE,
             "--heal-data: /nonexistent/heal.txt: calibration data file does not exist"),
    "memory": (ASSET, ["--max-memory", "cpu=1MiB"], ExitCode.MEMORY, MEMORY),
}  # fmt: skip


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any conversion that gets past its plan fails the test: the refusal must come before the work."""

    def work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the conversion started")

    monkeypatch.setattr(convert_run, "_run", work)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = cli(["-q", *argv])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("mtpquant: error: "), captured.err
    return code, err[len("mtpquant: error: ") :]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dry_run", [False, True])
def test_convert_heal_refused_at_plan_time(
    case: str, dry_run: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    src, flags, code, text = CASES[case]
    out = tmp_path / "out"
    argv = ["convert", str(src), str(out), "--heal", "--device", "cpu", *flags, *(["--dry-run"] if dry_run else [])]
    assert _refused(capsys, argv) == (code, text)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even beside OUT


def test_quantized_appended_layer_mtp_is_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--mtp quantize --heal`` of an appended-layer family (GLM-4.5, DeepSeek-V3) is no longer refused: heal trains
    its NVFP4 MTP with fake quantization (``tests/test_heal_nextn.py``); the dry run plans it and writes nothing."""
    for key in ("glm4_moe", "deepseek_v3"):
        out = tmp_path / key
        argv = ["-q", "convert", str(TINY_MTP_ASSETS[key]), str(out), "--heal", "--mtp", "quantize", "--device", "cpu",
                "--dry-run"]  # fmt: skip
        assert cli(argv) == 0, capsys.readouterr().err
        assert not out.exists()


def test_source_without_mtp(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None) -> None:
    """convert's default mode drops an MTP the source does not have: --heal is refused for that, in those words."""
    src = make_tiny_checkpoint(tmp_path / "src", TinySpec("qwen3_5", mtp=False), tokenizer=False)
    argv = ["convert", str(src), str(tmp_path / "out"), "--heal", "--device", "cpu"]
    assert _refused(capsys, argv) == (
        ExitCode.HEAL_REFUSED, f"{src}: has no MTP (no mtp.* tensors), so --heal would have nothing to heal"
    )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_filesystem_without_directory_exchange(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_work: None
) -> None:
    """--heal heals OUT in place, which swaps directories: a filesystem that cannot is found before converting."""
    import mtpquant.surgery.inplace as inplace

    monkeypatch.setattr(inplace, "exchange_supported", lambda scratch: False)
    out = tmp_path / "out"
    assert _refused(capsys, ["convert", str(ASSET), str(out), "--heal", "--device", "cpu"]) == (
        ExitCode.GRAFT_REFUSED,
        f"{out}: --heal heals OUT in place, which needs a filesystem with atomic directory exchange (Linux "
        "renameat2); convert, then heal OUT with --out",
    )
    assert list(tmp_path.iterdir()) == []  # the probe's directory removed


def test_refused_before_the_heavy_imports(tmp_path: Path) -> None:
    """heal's values and the MTP mode are refused before torch or transformers is imported (about a second)."""
    script = (
        "import sys; from mtpquant.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "print(code, sorted(m for m in ('torch', 'transformers', 'modelopt') if m in sys.modules))\n"
    )
    for argv, code in [
        (["convert", str(ASSET), str(tmp_path / "a"), "--heal", "--heal-steps", "0"], ExitCode.USAGE),
        (["convert", str(Q4), str(tmp_path / "b"), "--heal", "--mtp", "drop", "--dry-run"], ExitCode.HEAL_REFUSED),
    ]:
        done = subprocess.run([sys.executable, "-c", script, "-q", *argv], capture_output=True, text=True,
                              timeout=300, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        assert done.stdout.split() == [str(int(code)), "[]"], done.stderr


# ---------------------------------------------------------------------------------------------- heal's own


def test_heal_names_the_checkpoint_and_the_missing_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An index naming a shard that does not exist: the MTP's (heal's refusal, with graft's command) or the model's
    (a checkpoint error); either way the line names the checkpoint and the shard. heal's data source is checked in
    its plan."""
    src = make_tiny_checkpoint(tmp_path / "src", "qwen3_5")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    model_shard = sorted(set(index["weight_map"].values()))[0]
    # a quant-like checkpoint whose MTP sits in a shard of its own (graft's layout), then that shard deleted
    quant = tmp_path / "q"
    graft(GraftOptions(quant=strip_mtp(src, tmp_path / "stripped"), source=src, out=quant))
    mtp_shard = "mtp-00001-of-00001.safetensors"
    (quant / mtp_shard).unlink()
    base = ["heal", "--from", str(src), "--out", str(tmp_path / "o"), "--dry-run"]
    assert _refused(capsys, [base[0], str(quant), *base[1:]]) == (
        ExitCode.HEAL_REFUSED,
        f"{quant}: model.safetensors.index.json: shard '{mtp_shard}' does not exist (it held 15 mtp.* tensors), so "
        f"its MTP is incomplete; put it back first with `mtpquant graft {quant} --from SRC --out FIXED`",
    )
    no_model = tmp_path / "no-model"
    shutil.copytree(src, no_model)
    (no_model / model_shard).unlink()
    assert _refused(capsys, [base[0], str(no_model), *base[1:]]) == (
        ExitCode.CHECKPOINT,
        f"{no_model}: model.safetensors.index.json: shard '{model_shard}' does not exist",
    )
    assert _refused(capsys, ["heal", str(src), *base[1:], "--data", "/nonexistent/heal.txt"]) == (
        ExitCode.USAGE, "/nonexistent/heal.txt: calibration data file does not exist"
    )  # fmt: skip
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_heal_of_a_compressed_tensors_mtp_says_what_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A compressed-tensors NVFP4 MTP (``weight_packed``) is a layout heal does not write back: said so, not
    "incomplete"."""
    quant = tmp_path / "q"
    argv = ["convert", str(ASSET), str(quant), "--format", "compressed-tensors", "--mtp", "quantize",
            "--device", "cpu", "--calib-samples", "2", "--calib-seq-len", "32"]  # fmt: skip
    assert cli(["-q", *argv]) == 0
    assert _refused(capsys, ["heal", str(quant), "--from", str(ASSET), "--out", str(tmp_path / "o"), "--dry-run"]) == (
        ExitCode.HEAL_REFUSED,
        f"{quant}: its MTP is stored as nvfp4-ct; heal writes back BF16, ModelOpt NVFP4 and ModelOpt FP8 per tensor",
    )
