"""publish: gate, card and upload, with the real huggingface_hub client against LocalHub (no patching)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.repocard import REGEX_YAML_BLOCK, metadata_load

from mtpquant.cli import main as cli
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import ExitCode, HubAccessError
from mtpquant.publish.card import card_origin, redact, validate_card_metadata
from mtpquant.publish.run import (
    PublishOptions,
    PublishRefusedError,
    PublishUsageError,
    publish,
)
from mtpquant.units import format_bytes
from tests.support.hubserver import LocalHub
from tests.support.quants import with_mtp

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]
REPO = "org/tiny-qwen3_5-NVFP4"
VARIANT = "qwen3_5"
TOKEN = "hf_PublishTestTokenDoNotLeak0123456789"
WRITE_KINDS = {"create_repo", "preupload", "commit", "branch", "discussions", "delete_repo"}


# ---- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def healthy_template(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A healthy NVFP4 quant with its BF16 MTP (built once; tests publish private copies)."""
    return with_mtp(naive_export_factory(VARIANT), tiny_factory(VARIANT), tmp_path_factory.mktemp("pub") / "quant")


@pytest.fixture
def out(healthy_template: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "OUT"
    shutil.copytree(healthy_template, dst)
    return dst


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def converted_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real `convert --keep-mtp` of the trained tiny model, from a source laid out as an HF-cache snapshot of
    Qwen/Qwen3.5-0.8B with its card, plus a real pair-mode `validate` report in OUT/validation."""
    from mtpquant.api import ConvertOptions, ValidateOptions, convert, validate
    from mtpquant.synth.train import TINY_MTP_ASSET

    root = tmp_path_factory.mktemp("made")
    src = root / "hf_home" / "hub" / "models--Qwen--Qwen3.5-0.8B" / "snapshots" / COMMIT
    shutil.copytree(TINY_MTP_ASSET, src)
    (src / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# Qwen3.5-0.8B\n")
    out = root / "tiny-NVFP4"
    command = ("mtpquant", "convert", str(src), str(out), "--keep-mtp", "--calib-samples", "4")
    convert(
        ConvertOptions(
            src=str(src),
            out=out,
            mtp="keep",
            calib_samples=4,
            calib_seq_len=32,
            device="cpu",
            progress=False,
            command=command,
        )
    )
    validate(
        ValidateOptions(
            src, out, num_prompts=4, max_len=48, k=3, device="cpu", report_dir=out / "validation", progress=False
        )
    )
    return src, out


@pytest.fixture
def made(converted_template: tuple[Path, Path], tmp_path: Path) -> Path:
    """A private copy of the converted OUT (with its provenance file and validation report)."""
    dst = tmp_path / "tiny-NVFP4"
    shutil.copytree(converted_template[1], dst)
    return dst


def _server_files(hub: LocalHub, repo: str = REPO, revision: str = "main") -> dict[str, bytes]:
    """The repo's files, less the ``.gitattributes`` the Hub itself writes into every new repo."""
    return {k: v for k, v in _tree(hub.repo_dir(repo, revision)).items() if k != ".gitattributes"}


def _writes(hub: LocalHub) -> list[str]:
    return [r.kind for r in hub.requests if r.kind in WRITE_KINDS]


# ---- the upload -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_publish_uploads_exact_files_and_a_truthful_card(
    local_hub: LocalHub, made: Path, converted_template: tuple[Path, Path]
) -> None:
    out = made
    src = converted_template[0]
    (out / ".mtpquant-partial-x").mkdir()  # an interrupted write's temp dir: never uploaded
    (out / ".mtpquant-partial-x" / "junk.safetensors").write_bytes(b"x")
    local_files = {k: v for k, v in _tree(out).items() if not k.startswith(".")}

    result = publish(PublishOptions(out=out, repo=REPO, private=True))

    assert result.card_action == "generated" and result.healthy and not result.forced
    served = _server_files(local_hub)
    assert served == {**local_files, "README.md": (out / "README.md").read_bytes()}  # exact files, exact bytes
    # the weights took the Hub's LFS path (the repo's .gitattributes marks *.safetensors): one batch call, then a
    # PUT to the storage URL it handed out and a verify per shard; the JSON and the card went inline
    shards = sorted(k for k in local_files if k.endswith(".safetensors"))
    kinds = [r.kind for r in local_hub.requests]
    assert kinds.count("lfs_batch") == 1 and kinds.count("lfs_upload") == kinds.count("lfs_verify") == len(shards)
    assert shards and kinds.index("lfs_batch") < kinds.index("commit")
    assert served["README.md"].decode() == result.card
    assert {f.path: f.size for f in result.files} == {k: len(v) for k, v in served.items()}
    sha = local_hub.commit_sha(REPO)
    assert (result.commit_oid, result.commit_url) == (sha, f"{local_hub.endpoint}/{REPO}/commit/{sha}")
    api = HfApi(endpoint=local_hub.endpoint, token=False)
    assert api.model_info(REPO).private is True
    assert [c.title for c in api.list_repo_commits(REPO)] == ["Upload tiny-qwen3_5-NVFP4 with mtpquant 0.1.0"]
    kinds = [r.kind for r in local_hub.requests]
    assert kinds.count("commit") == 1 and "validate_yaml" in kinds  # one commit; README went through validate-yaml

    # The card as the Hub reads it: YAML block first, metadata that validates, then the body.
    readme = local_hub.repo_dir(REPO) / "README.md"
    text = readme.read_text()
    assert REGEX_YAML_BLOCK.search(text) is not None
    meta = metadata_load(readme)
    assert meta == ModelCard.load(readme).data.to_dict() == yaml.safe_load(REGEX_YAML_BLOCK.search(text).group(2))
    assert meta == {
        "base_model": "Qwen/Qwen3.5-0.8B",
        "base_model_relation": "quantized",
        "library_name": "transformers",
        "license": "apache-2.0",
        "pipeline_tag": "image-text-to-text",
        "tags": ["nvfp4", "modelopt", "mtp", "speculative-decoding", "qwen3_5", "mtpquant"],
    }
    assert validate_card_metadata(meta) == []
    assert card_origin(text) == "generated"
    body = ModelCard.load(readme).text
    report = inspect_checkpoint(out)
    # the validation figures are the real report's, exactly
    vr = json.loads((out / "validation" / "report.json").read_text())
    ref, cand = vr["reference"]["acceptance"]["by_k"], vr["candidate"]["acceptance"]["by_k"]
    k1 = [
        f"| {side} | 1 | {rows[0]['mean_acceptance_length']:.3f} | "
        for side, rows in (("reference", ref), ("this checkpoint", cand))
    ]
    pos3 = [" / ".join(f"{100 * a:.1f} %" for a in rows[2]["acceptance_per_position"]) + " |" for rows in (ref, cand)]
    modelopt = next(s for s in json.loads((out / "mtpquant_provenance.json").read_text())["steps"])["versions"]
    for needle in (
        "| Mode | `keep` |",
        f"| Present | all {report.mtp_expected_tensors} expected tensors (",
        "| Precision | BF16 |",
        "| Shard(s) | `mtp-00001-of-00001.safetensors` |",
        "| vLLM | vLLM: MTP loads (BF16) |",
        "`modelopt` `NVFP4` (vLLM loads it as `modelopt_fp4`), group size 16",
        "Recipe `qwen3_5-nvfp4`: scheme `nvfp4`, targets `all`, calibration `max` on 4 samples x 32 tokens",
        "name: qwen3_5-nvfp4",  # the resolved recipe itself
        "- Vision tower (`model.visual.*`): 21 tensors, kept as is (6 BF16).",
        "`mtp*`",
        f"Verdict: **{vr['verdict']['status']}**: {vr['verdict']['reasons'][0]}.",
        "(4 prompts, k = 1..3, activations emulated as the engines run them)",  # validate's default: W4A4 as served
        "| | k | AL | 95 % CI | acceptance rate | per-position acceptance |",  # validate.table: as in report.md
        *k1,
        *pos3,
        "MTP's top-1 agrees with the reference MTP's 100.0 % of the time; mean KL(reference || this) 0",
        "Full report: [`validation/report.md`](validation/report.md).",
        f'vllm serve {REPO} --speculative-config \'{{"method":"mtp","num_speculative_tokens":3}}\'',
        f"python -m sglang.launch_server --model-path {REPO} --speculative-algorithm NEXTN",
        f"Produced by mtpquant 0.1.0 `convert` (nvidia-modelopt {modelopt['nvidia-modelopt']}, transformers "
        f"{modelopt['transformers']}) with:",
        "mtpquant convert Qwen/Qwen3.5-0.8B tiny-NVFP4 --keep-mtp --calib-samples 4",  # local dirs by name
        f"Source checkpoint: `Qwen/Qwen3.5-0.8B` at revision `{COMMIT}`.",
        "# source: Qwen/Qwen3.5-0.8B",  # the recipe's comment header: the HF-cache snapshot by its repo id
        f"Base model `Qwen/Qwen3.5-0.8B` at revision `{COMMIT}` from the provenance file (source).",
        "Licence `apache-2.0`, carried over from the source card",
    ):
        assert needle in body, needle
    assert str(out) not in text and str(src) not in text and str(src.parents[4]) not in text  # nothing local
    assert vr["settings"]["activations"] == "emulate"  # validate's default: the card's numbers are the emulated ones
    assert "NOT quantized" not in body and "were not quantized" not in body
    # ... and no uploaded file names a local directory: provenance, recipe and validation report included
    root = str(src.parents[4])
    leaks = [k for k, v in served.items() if not k.endswith(".safetensors") and root.encode() in v]
    assert leaks == []
    recorded = json.loads(served["mtpquant_provenance.json"])["steps"][0]
    assert recorded["command"][2:4] == ["Qwen/Qwen3.5-0.8B", "tiny-NVFP4"]
    assert recorded["source"]["path"] == COMMIT  # the snapshot directory by its name
    assert recorded["license"] == {"license": "apache-2.0"}  # read from the source card at convert time


def test_existing_repo_keeps_other_files_and_loses_stale_shards(local_hub: LocalHub, out: Path) -> None:
    local_hub.create_repo(REPO, {"model-00001-of-00009.safetensors": b"stale", "notes.txt": "mine"})
    publish(PublishOptions(out=out, repo=REPO))
    served = _server_files(local_hub)
    assert "model-00001-of-00009.safetensors" not in served  # never mix shards of two conversions
    assert served["notes.txt"] == b"mine"
    assert set(served) == {*_tree(out), "notes.txt"}


def test_create_pr_leaves_main_untouched(local_hub: LocalHub, out: Path) -> None:
    local_hub.create_repo(REPO, {"notes.txt": "main"})
    main_sha = local_hub.commit_sha(REPO)
    result = publish(PublishOptions(out=out, repo=REPO, create_pr=True, commit_message="NVFP4 with MTP"))
    assert (result.pr_revision, result.pr_url) == ("refs/pr/1", f"{local_hub.endpoint}/{REPO}/discussions/1")
    assert local_hub.commit_sha(REPO) == main_sha and set(_server_files(local_hub)) == {"notes.txt"}
    assert _server_files(local_hub, revision="refs/pr/1") == {**_tree(out), "notes.txt": b"main"}
    assert result.commit_oid == local_hub.commit_sha(REPO, "refs/pr/1")
    commits = HfApi(endpoint=local_hub.endpoint, token=False).list_repo_commits(REPO, revision="refs/pr/1")
    assert commits[0].title == "NVFP4 with MTP"
    with pytest.raises(PublishUsageError, match="cannot be combined with --revision"):
        publish(PublishOptions(out=out, repo=REPO, create_pr=True, revision="dev"))


def test_revision_branch_is_created_and_named_in_the_serve_commands(local_hub: LocalHub, out: Path) -> None:
    result = publish(PublishOptions(out=out, repo=REPO, revision="nvfp4"))
    assert _server_files(local_hub, revision="nvfp4") == _tree(out)
    assert _server_files(local_hub) == {}  # main stays empty
    assert result.commit_oid == local_hub.commit_sha(REPO, "nvfp4")
    assert '"num_speculative_tokens":3}\' --revision nvfp4' in result.card
    # again, into the now existing branch: a new commit on it, nothing else
    (out / "notes.txt").write_text("second")
    publish(PublishOptions(out=out, repo=REPO, revision="nvfp4"))
    assert _server_files(local_hub, revision="nvfp4")["notes.txt"] == b"second"


def test_hf_endpoint_is_read_when_publishing(
    local_hub: LocalHub, out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub's constants point at local_hub; HF_ENDPOINT set later must still win.
    with LocalHub(tmp_path / "other-hub") as other:
        monkeypatch.setenv("HF_ENDPOINT", other.endpoint)
        result = publish(PublishOptions(out=out, repo=REPO))
        assert _server_files(other) == _tree(out) and result.commit_url.startswith(other.endpoint)
        assert other.errors == []
    assert local_hub.requests == []


def test_dry_run_prints_files_and_card_and_sends_nothing(
    local_hub: LocalHub, out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree(out)
    assert cli(["publish", str(out), "--repo", REPO, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert local_hub.requests == []  # no HTTP at all
    assert _tree(out) == before  # and nothing written
    assert f"would publish to {REPO}" in printed and "checks: passed" in printed
    lines = printed.splitlines()
    for name, data in before.items():  # every file, with its size
        assert any(ln.split() == [name, *format_bytes(len(data)).split()] for ln in lines), name
    assert "model card (generated)" in printed
    card = printed.split("----- README.md (generated) -----\n", 1)[1].split("\n----- end of README.md -----", 1)[0]
    assert validate_card_metadata(metadata_load_text(card)) == []
    # the printed card is the one a real publish uploads
    result = publish(PublishOptions(out=out, repo=REPO))
    assert result.card.rstrip("\n") == card


def test_out_given_as_dot(local_hub: LocalHub, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(out)
    card = publish(PublishOptions(out=Path("."), repo=REPO, dry_run=True)).card
    assert f"vllm serve {REPO} --speculative-config" in card
    assert f"python -m sglang.launch_server --model-path {REPO} --speculative-algorithm NEXTN" in card


def metadata_load_text(text: str) -> dict:
    m = REGEX_YAML_BLOCK.search(text)
    return yaml.safe_load(m.group(2)) if m else {}


# ---- refusals ---------------------------------------------------------------------------------------------------
def test_gate_refuses_declared_but_missing_mtp_and_force_overrides(
    local_hub: LocalHub, naive_export_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    naive = tmp_path / "naive"
    shutil.copytree(naive_export_factory(VARIANT), naive)
    with pytest.raises(PublishRefusedError) as err:
        publish(PublishOptions(out=naive, repo=REPO))
    msg = str(err.value)
    assert "\n" not in msg and "MTP declared but missing" in msg and "--force" in msg
    assert cli(["publish", str(naive), "--repo", REPO]) == ExitCode.PUBLISH_REFUSED
    stderr = capsys.readouterr().err.strip().splitlines()
    assert stderr[-1].startswith("mtpquant: error: refusing to publish") and "MTP declared but missing" in stderr[-1]
    assert local_hub.requests == [] and not (naive / "README.md").exists()

    result = publish(PublishOptions(out=naive, repo=REPO, force=True))
    assert result.forced and not result.healthy
    card = _server_files(local_hub)["README.md"].decode()
    assert "**Published with `--force`**" in card
    assert "> - MTP declared but missing: speculative decoding will accept nothing" in card
    assert "| Mode | `missing` |" in card and "vLLM: no MTP serve command" in card
    assert "| Present | none of 15 expected tensors |" in card
    meta = metadata_load_text(card)
    assert "mtp" not in meta["tags"] and "speculative-decoding" not in meta["tags"]  # the tags don't lie either
    assert validate_card_metadata(meta) == []
    assert "Published with --force despite" in HfApi(endpoint=local_hub.endpoint).list_repo_commits(REPO)[0].message


@pytest.mark.parametrize(
    "repo",
    [
        "noslash",
        "a/b/c",
        "-org/x",
        "org/x-",
        "org/.x",
        "org/x..y",
        "org--x/y",
        "org/x.git",
        "org/x y",
        "org/",
        "/x",
        "org/x?y",
        "org/" + "a" * 97,
        "",
    ],
)
def test_malformed_repo_ids_are_refused_before_anything(local_hub: LocalHub, out: Path, repo: str) -> None:
    with pytest.raises(PublishUsageError) as err:
        publish(PublishOptions(out=out, repo=repo))
    assert "\n" not in str(err.value) and err.value.exit_code == 2
    assert local_hub.requests == [] and not (out / "README.md").exists()


def test_cli_exit_code_for_a_malformed_repo(local_hub: LocalHub, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["publish", str(out), "--repo", "not a repo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtpquant: error: --repo 'not a repo': not a Hub model id")
    assert local_hub.requests == []


def test_incomplete_out_is_refused_even_with_force(local_hub: LocalHub, out: Path, tmp_path: Path) -> None:
    (out / "mtp.safetensors").unlink()  # listed in the index, gone from disk
    for force in (False, True):
        with pytest.raises(PublishRefusedError, match=r"incomplete: .*shard 'mtp\.safetensors' does not exist"):
            publish(PublishOptions(out=out, repo=REPO, force=force))
    with pytest.raises(PublishRefusedError, match="not a directory"):
        publish(PublishOptions(out=tmp_path / "nope", repo=REPO))
    (tmp_path / "file").write_text("x")
    with pytest.raises(PublishRefusedError, match="not a directory"):
        publish(PublishOptions(out=tmp_path / "file", repo=REPO, dry_run=True))
    (out / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:1000])  # truncated
    with pytest.raises(PublishRefusedError, match=r"refusing to publish .*model\.safetensors"):
        publish(PublishOptions(out=out, repo=REPO, force=True))
    (out / "config.json").unlink()
    with pytest.raises(PublishRefusedError, match=r"config\.json is missing"):
        publish(PublishOptions(out=out, repo=REPO, force=True))
    assert local_hub.requests == []


def test_symlink_out_of_out_is_refused(local_hub: LocalHub, out: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("private")
    (out / "notes.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(PublishRefusedError, match="symlink points outside OUT"):
        publish(PublishOptions(out=out, repo=REPO))
    assert local_hub.requests == []


# ---- the card kept, regenerated, overwritten ---------------------------------------------------------------------
def test_person_written_card_is_kept_unless_overwrite_card(local_hub: LocalHub, out: Path) -> None:
    mine = "---\nlicense: mit\n---\n\n# My own card\n"
    (out / "README.md").write_text(mine)
    result = publish(PublishOptions(out=out, repo=REPO))
    assert result.card_action == "kept" and _server_files(local_hub)["README.md"] == mine.encode()
    assert (out / "README.md").read_text() == mine

    result = publish(PublishOptions(out=out, repo=REPO, overwrite_card=True))
    assert result.card_action == "overwritten" and card_origin(result.card) == "generated"
    assert "license: mit" in result.card  # the licence of the card it replaced is carried over
    assert _server_files(local_hub)["README.md"].decode() == result.card == (out / "README.md").read_text()

    assert publish(PublishOptions(out=out, repo=REPO)).card_action == "regenerated"  # ours: regenerated freely
    edited = (out / "README.md").read_text().replace("## Serving", "## Serving\n\nTested on 8xB200 by me.")
    (out / "README.md").write_text(edited)
    assert card_origin(edited) == "edited"
    result = publish(PublishOptions(out=out, repo=REPO))
    assert result.card_action == "kept" and _server_files(local_hub)["README.md"].decode() == edited


def test_kept_card_with_broken_metadata_is_refused(local_hub: LocalHub, out: Path) -> None:
    (out / "README.md").write_text("---\n- just\n- a list\n---\n# card\n")
    with pytest.raises(PublishRefusedError, match=r"metadata block does not parse.*--overwrite-card"):
        publish(PublishOptions(out=out, repo=REPO))
    assert local_hub.requests == []
    assert publish(PublishOptions(out=out, repo=REPO, overwrite_card=True)).card_action == "overwritten"


# ---- the token ---------------------------------------------------------------------------------------------------
def _debug_everything(caplog: pytest.LogCaptureFixture) -> None:
    for name in (None, "huggingface_hub", "httpx", "httpcore", "mtpquant", "hf_xet"):
        caplog.set_level(logging.DEBUG, logger=name)


def test_token_is_sent_but_never_printed_logged_or_written(
    tmp_path: Path, out: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    _debug_everything(caplog)
    other = "hf_SomeOtherTokenInTheCommandLine42"
    from mtpquant.records.provenance import PROVENANCE_FILE, Provenance, Step

    step = Step("convert", ("mtpquant", "convert", "SRC", "OUT", "--token", other), mode="keep")
    (out / PROVENANCE_FILE).write_bytes(Provenance((step,)).to_bytes())
    with LocalHub(tmp_path / "hub", token=TOKEN) as hub, hub.client_env(tmp_path / "home", token=TOKEN):
        # any Hub token in a file, not only the one in use, keeps the file (and so the upload) back
        assert cli(["publish", str(out), "--repo", REPO, "--private"]) == ExitCode.PUBLISH_REFUSED
        assert capsys.readouterr().err == (
            f"mtpquant: error: {out}/{PROVENANCE_FILE} contains a Hub token (hf_...); refusing to upload it (remove "
            "the token from it)\n"
        )
        assert hub.requests == []
        step = Step("convert", ("mtpquant", "convert", "SRC", "OUT", "--keep-mtp"), mode="keep")
        (out / PROVENANCE_FILE).write_bytes(Provenance((step,)).to_bytes())
        assert cli(["-vv", "publish", str(out), "--repo", REPO, "--private"]) == 0
        printed = capsys.readouterr()
        assert hub.requests and all(r.status < 400 for r in hub.requests)
        # the token goes to the Hub's API; an LFS object goes to the storage URL the batch API handed out,
        # which (a presigned URL on the Hub) needs none
        assert all(r.has_auth for r in hub.requests if r.kind != "lfs_upload")
        assert any(r.kind == "lfs_upload" for r in hub.requests)
        served = _server_files(hub)
        assert hub.errors == []
    assert "commit: " in printed.out
    card = served["README.md"].decode()
    assert "mtpquant convert SRC OUT --keep-mtp" in card and other not in card
    assert redact(f"mtpquant convert SRC OUT --token {other}") == "mtpquant convert SRC OUT --token ***"
    everything = [printed.out, printed.err, caplog.text, *(v.decode("utf-8", "replace") for v in served.values())]
    everything += [r.getMessage() for r in caplog.records]
    assert all(TOKEN not in text for text in everything)
    assert any("uploading" in r.getMessage() for r in caplog.records)  # logs were captured at all


def test_wrong_token_fails_in_one_line_without_the_token_and_uploads_nothing(
    tmp_path: Path, out: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    _debug_everything(caplog)
    wrong = "hf_WrongTokenAlsoSecret987654321"
    with LocalHub(tmp_path / "hub", token=TOKEN) as hub, hub.client_env(tmp_path / "home", token=wrong):
        with pytest.raises(HubAccessError) as err:
            publish(PublishOptions(out=out, repo=REPO))
        assert cli(["publish", str(out), "--repo", REPO]) == ExitCode.HUB_ACCESS
        printed = capsys.readouterr()
        # explicit token argument, wrong as well
        with pytest.raises(HubAccessError) as err2:
            publish(PublishOptions(out=out, repo=REPO, token=wrong + "X"))
        assert {r.status for r in hub.requests} == {401} and all(r.has_auth for r in hub.requests)
        assert not hub.repo_dir(REPO).exists()  # nothing created, nothing committed
        assert hub.errors == []
    msg = str(err.value)
    assert "\n" not in msg and "HTTP 401" in msg and "creating the repo" in msg and "HF_TOKEN" in msg
    assert err.value.__cause__ is None and err.value.__context__ is None  # the client's exception is not attached
    texts = [msg, repr(err.value), str(err2.value), printed.out, printed.err, caplog.text]
    assert all(wrong not in t and TOKEN not in t for t in texts)
    assert printed.err.strip().splitlines()[-1].startswith("mtpquant: error: publishing to")


def test_a_file_holding_the_token_is_never_uploaded(tmp_path: Path, out: Path) -> None:
    (out / "convert.log").write_text(f"HF_TOKEN={TOKEN}\n")
    with LocalHub(tmp_path / "hub", token=TOKEN) as hub, hub.client_env(tmp_path / "home", token=TOKEN):
        for force in (False, True):
            with pytest.raises(PublishRefusedError) as err:
                publish(PublishOptions(out=out, repo=REPO, force=force))
            assert "convert.log contains the Hub token" in str(err.value) and TOKEN not in str(err.value)
        assert hub.requests == []


@pytest.mark.slow
def test_provenance_from_a_hub_source_and_an_unknown_licence(made: Path) -> None:
    from mtpquant.checkpoint.source import SourceRef
    from mtpquant.records.provenance import PROVENANCE_FILE, Provenance, Step

    # as convert records a Hub SRC: the repo, the revision asked for, the commit it resolved to
    step = Step(
        "convert",
        ("mtpquant", "convert", "Qwen/Qwen3.6-27B", "/home/me/out dir", "--mtp", "keep", "--revision", "dev"),
        source=SourceRef(repo_id="Qwen/Qwen3.6-27B", revision="dev", commit="f" * 40),
        mode="keep",
        recipe="qwen3_5-nvfp4",
        recipe_file="mtpquant_recipe.yaml",
        mtpquant_version="9.9.9",
    )
    (made / PROVENANCE_FILE).write_bytes(Provenance((step,)).to_bytes())
    config = json.loads((made / "config.json").read_text())
    config["license"] = "Qwen Research License"  # not a Hub licence id
    (made / "config.json").write_text(json.dumps(config))
    (made / "LICENSE").write_text("Qwen RESEARCH LICENSE AGREEMENT\n")
    card = publish(PublishOptions(out=made, repo=REPO, dry_run=True)).card
    meta = metadata_load_text(card)
    assert (meta["base_model"], meta["license"], meta["license_name"], meta["license_link"]) == (
        "Qwen/Qwen3.6-27B",
        "other",
        "qwen-research-license",
        "LICENSE",
    )
    assert validate_card_metadata(meta) == []
    assert "Produced by mtpquant 9.9.9 `convert`" in card
    assert "mtpquant convert Qwen/Qwen3.6-27B 'out dir' --mtp keep --revision dev" in card  # no /home/me
    assert f"Source checkpoint: `Qwen/Qwen3.6-27B` at revision `{'f' * 40}`." in card
    assert "/home/me" not in card


def test_unreachable_hub_is_one_line(
    out: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    before = _tree(out)
    assert cli(["publish", str(out), "--repo", REPO, "--base-model", "Qwen/Qwen3.6-27B"]) == ExitCode.HUB_UNREACHABLE
    assert _tree(out) == before  # the card and the base model recorded for the upload are taken back out of OUT
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"mtpquant: error: publishing to {REPO}: cannot reach 127.0.0.1:9 ([Errno 111] Connection refused)"
    )


# ---- the card's facts in other modes, and the metadata checks ----------------------------------------------------
def test_quantized_mtp_card_carries_the_sglang_caveat(out: Path) -> None:
    from mtpquant.publish.card import CardFacts, build_card
    from mtpquant.records.provenance import read_provenance

    report = inspect_checkpoint(out)
    mods = [
        dataclasses.replace(m, disk="NVFP4", vllm_quantized=True) if m.module != "mtp.fc" else m
        for m in report.mtp_modules
    ]
    quantized = dataclasses.replace(
        report,
        mtp_modules=mods,
        mtp_precision="mixed: BF16, NVFP4",
        verdicts={
            "vllm": "vLLM: MTP loads (mixed: BF16, NVFP4)",
            "sglang": "SGLang will fail to load the MTP (NEXTN): SGLang builds the MTP of a serialized modelopt_fp4 "
            "checkpoint in BF16, and the packed NVFP4 weight of mtp.layers.0.mlp.down_proj does not fit a BF16 module; "
            "serve without speculative decoding, or with vLLM",
        },
        serve_commands={"vllm": report.serve_commands["vllm"]},
    )
    facts = CardFacts(
        repo_id=REPO,
        report=quantized,
        family_key=VARIANT,
        config={},
        hf_quant_config=None,
        provenance=read_provenance(out),
        license=None,
        validation=None,
    )
    text = str(build_card(facts))
    assert "| Mode | `quantize` |" in text
    assert (
        "> **SGLang and this mixed: BF16, NVFP4 MTP**: SGLang will fail to load the MTP (NEXTN): SGLang builds the MTP "
        "of a serialized modelopt_fp4 checkpoint in BF16" in text
    )
    assert f"python -m sglang.launch_server --model-path {REPO}\n" in text  # served without speculative decoding
    assert "--speculative-algorithm NEXTN" not in text  # no SGLang speculative serve command
    assert validate_card_metadata(metadata_load_text(text)) == []
    assert "license" not in metadata_load_text(text) and "base_model" not in metadata_load_text(text)


@pytest.mark.slow
def test_validation_report_single_mode_and_unreadable(made: Path) -> None:
    from mtpquant.api import ValidateOptions, validate

    shutil.rmtree(made / "validation")
    validate(
        ValidateOptions(
            made, num_prompts=2, max_len=40, k=3, device="cpu", report_dir=made / "validation", progress=False
        )
    )
    report = json.loads((made / "validation" / "report.json").read_text())
    result = publish(PublishOptions(out=made, repo=REPO, dry_run=True))
    card = result.card
    assert "measured this checkpoint with greedy verification" in card
    # the speculation profile travels with the report, and the card shows its headline
    profile = json.loads((made / "validation" / "speculation_profile.json").read_text())
    assert "validation/speculation_profile.json" in {f.path for f in result.files}
    conditional = " / ".join(f"{100 * c:.1f} %" for c in profile["conditional_accept_rates"])
    assert (
        f"k = 3, mean acceptance length {profile['mean_accept_length']:.2f}, conditional acceptance per draft "
        f"position {conditional} (built-in prediction" in card
    )
    k2 = report["reference"]["acceptance"]["by_k"][1]
    pos = " / ".join(f"{100 * a:.1f} %" for a in k2["acceptance_per_position"])
    rate = f"{100 * k2['acceptance_rate']:.1f} %"
    assert f"|  | 2 | {k2['mean_acceptance_length']:.3f} | n/a | {rate} | {pos} |" in card  # 2 prompts: no interval
    assert "Full report: [`validation/report.md`](validation/report.md)." in card

    (made / "validation" / "report.json").write_text('{"something": "else"}')
    card = publish(PublishOptions(out=made, repo=REPO, dry_run=True)).card
    assert "its figures are in a format this card does not read" in card
    (made / "validation" / "report.json").write_text("not json")
    assert "format this card does not read" in publish(PublishOptions(out=made, repo=REPO, dry_run=True)).card


@pytest.mark.slow
def test_card_serves_the_k_validation_measured(made: Path) -> None:
    """What a user saw: validation measured k <= 2 and the card's serve commands drafted k = 3. They now draft the
    largest k the report measured, and say so (an earlier report there is replaced whole by the new one)."""
    from mtpquant.api import ValidateOptions, validate

    validate(ValidateOptions(made, num_prompts=2, max_len=40, k=2, device="cpu", report_dir=made / "validation",
                             progress=False))  # fmt: skip
    card = publish(PublishOptions(out=made, repo=REPO, dry_run=True)).card
    assert "Drafting 2 tokens per step (k = 2), the largest k the validation report measured." in card
    assert f'vllm serve {REPO} --speculative-config \'{{"method":"mtp","num_speculative_tokens":2}}\'' in card
    assert (
        f"python -m sglang.launch_server --model-path {REPO} --speculative-algorithm NEXTN --speculative-num-steps 2 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 3"
    ) in card
    assert "num_speculative_tokens\":3" not in card and "--speculative-num-steps 3" not in card


def test_card_metadata_validator_knows_the_hub_field_types(local_hub: LocalHub) -> None:
    # LocalHub's validate-yaml endpoint is a stub: it answers "no errors" to anything (checked here), so the
    # card is validated by mtpquant itself, against the field types the Hub enforces.
    local_hub.create_repo(REPO)
    bad_card = b"---\nlicense: Apache 2.0\nbase_model_relation: quantised\ntags: nvfp4\n---\n# x\n"
    HfApi(endpoint=local_hub.endpoint, token=False).upload_file(
        path_or_fileobj=bad_card, path_in_repo="README.md", repo_id=REPO
    )
    assert [r.status for r in local_hub.requests if r.kind == "validate_yaml"] == [200]
    assert len(validate_card_metadata(metadata_load_text(bad_card.decode()))) == 4

    good = {
        "base_model": "Qwen/Qwen3.5-27B",
        "base_model_relation": "quantized",
        "license": "other",
        "license_name": "qwen-research",
        "license_link": "LICENSE",
        "tags": ["nvfp4"],
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
    }
    assert validate_card_metadata(good) == []
    bad = [
        {"license": "Apache 2.0"},
        {"license": "other"},
        {"license": "other", "license_name": "Qwen Research"},
        {"base_model": "not a repo"},
        {"base_model": "/abs/path/model"},
        {"base_model_relation": "quantized"},
        {"base_model": "a/b", "base_model_relation": "quantised"},
        {"tags": "nvfp4"},
        {"tags": ["ok", 3]},
        {"library_name": ""},
        {"pipeline_tag": "magic"},
        {"language": []},
    ]
    for meta in bad:
        assert validate_card_metadata(meta), meta


def test_card_seal_detects_any_edit(out: Path) -> None:
    card = publish(PublishOptions(out=out, repo=REPO, dry_run=True)).card
    assert card_origin(card) == "generated"
    assert card_origin(card.replace("BF16", "bf16", 1)) == "edited"
    assert card_origin("# a card\n") == "person"
    digest = hashlib.sha256(card.encode()).hexdigest()
    assert digest not in card  # the seal is over the card with a zero hash, not a self-reference
