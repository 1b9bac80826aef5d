"""``publish``: gate OUT through the inspect checks, write its model card, upload it with huggingface_hub.

Order of work, so that a refusal costs nothing and uploads nothing:

1. options: repo id by the Hub's naming rules, ``--create-pr`` not combined with a branch;
2. OUT: a directory, every file it will upload a regular file inside it;
3. gate: ``inspect_checkpoint(OUT)``. An incomplete OUT (a shard or tensor the index names is absent) is
   always refused; any other failure (MTP declared but missing, exclusions that disagree with the tensors,
   index defects) is refused unless ``force``, and then the card says so;
4. card: generated from facts (``mtpquant.publish.card``); a README.md a person wrote (or edited after mtpquant
   generated it) is kept unless ``overwrite_card``; the metadata is validated against the Hub's field types;
5. ``dry_run`` stops here (no HTTP, nothing written) and returns the file list and the card;
6. the card is written into OUT (atomically), then ``HfApi.create_repo(exist_ok=True)``, ``create_branch``
   for a new ``revision`` branch, and one ``upload_folder`` call (resumable with hf_xet; remote
   ``*.safetensors`` / index files that OUT does not have are deleted in the same commit, so a repo never
   mixes the shards of two conversions).

The token comes from huggingface_hub's usual sources (``HF_TOKEN``, the login cache) or ``token``; it is never
logged, printed, written into the card or put into an exception message (errors are re-raised as one-line
``MtpquantError`` with any token masked and without the client's exception chained).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpquant import __version__
from mtpquant.errors import (
    CheckpointError,
    ConfigError,
    HubAccessError,
    HubRefusedError,
    HubUnreachableError,
    MtpquantError,
    PublishRefusedError,
    PublishUsageError,
    UploadError,
)
from mtpquant.public import public_args, public_text
from mtpquant.publish.card import (
    CARD_NAME,
    CardFacts,
    build_card,
    card_origin,
    is_repo_id,
    read_license,
    read_recipe,
    read_search,
    read_validation,
    redact,
    validate_card_metadata,
)
from mtpquant.publish.files import HIDDEN, LOCAL_ONLY, PublishFile, plan_files, refuse_private
from mtpquant.publish.options import PublishOptions
from mtpquant.records.provenance import PROVENANCE_FILE, Step, check_base_model, source_provenance

__all__ = [
    "PublishOptions",
    "PublishRefusedError",
    "PublishResult",
    "PublishUsageError",
    "UploadError",
    "publish",
    "validate_repo_id",
]

log = logging.getLogger(__name__)

# Weight files whose remote copies are replaced as a set (see module docstring).
_REPLACED_REMOTE = ["*.safetensors", "*.safetensors.index.json"]
# Index problems that make OUT incomplete (a file or tensor the index names is absent): refused, --force or not.
_INCOMPLETE = frozenset({"missing_shard", "missing_tensor"})
_LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md")
_BRANCH_RE = re.compile(r"[A-Za-z0-9._/-]+")


@dataclass(frozen=True)
class PublishResult:
    """What ``publish`` did (or, with ``dry_run``, would do)."""

    repo_id: str
    revision: str | None
    dry_run: bool
    files: tuple[PublishFile, ...]
    card: str  # the README.md that is (or would be) uploaded
    card_action: str  # generated | regenerated | kept | overwritten
    healthy: bool
    forced: bool
    gate_failures: tuple[str, ...]
    verdicts: dict[str, str]
    commit_url: str | None = None
    commit_oid: str | None = None
    pr_url: str | None = None
    pr_revision: str | None = None
    repo_url: str | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes of every file uploaded."""
        return sum(f.size for f in self.files)


def validate_repo_id(repo: str) -> str:
    """``repo`` if it is a full ``namespace/name`` model id by the Hub's naming rules, else a one-line error."""
    if not isinstance(repo, str) or not is_repo_id(repo):
        raise PublishUsageError(
            f"--repo {repo!r}: not a Hub model id; expected ORG/NAME with letters, digits, '-', '_' or '.', "
            "not starting or ending with '-' or '.', no '--' or '..', at most 96 characters per part"
        )
    from huggingface_hub.utils import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hf_validate

    try:  # the client's own rules as well, so the upload never fails on them later
        hf_validate(repo)
    except HFValidationError as exc:
        raise PublishUsageError(f"--repo {repo!r}: {str(exc).splitlines()[0]}") from None
    return repo


def _check_options(opts: PublishOptions) -> None:
    opts.check_fields(PublishUsageError)
    validate_repo_id(opts.repo)
    rev = opts.revision
    if rev is not None:
        if not rev or not _BRANCH_RE.fullmatch(rev) or ".." in rev or rev.startswith("/") or rev.endswith("/"):
            raise PublishUsageError(f"--revision {rev!r}: not a valid branch name")
        if rev.startswith("refs/") and not re.fullmatch(r"refs/pr/\d+", rev):
            raise PublishUsageError(f"--revision {rev!r}: only a branch name or refs/pr/N can receive a commit")
    if opts.create_pr and rev not in (None, "main"):
        raise PublishUsageError(
            "--create-pr opens a pull request against main; it cannot be combined with --revision "
            f"{rev!r} (to add to an open pull request, use --revision refs/pr/N without --create-pr)"
        )


def _gate(out: Path, force: bool) -> tuple[Any, Any]:
    """Inspect OUT; refuse an incomplete OUT always, an unhealthy one unless ``force``."""
    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.diagnose.report import inspect_checkpoint

    ckpt = Checkpoint.open(out, strict=False)
    incomplete = [p.message for p in ckpt.problems if p.code in _INCOMPLETE]
    if incomplete:
        more = f" (and {len(incomplete) - 1} more)" if len(incomplete) > 1 else ""
        raise PublishRefusedError(f"refusing to publish {out}: incomplete: {incomplete[0]}{more}")
    report = inspect_checkpoint(out, checkpoint=ckpt)
    if not report.healthy:
        msgs = report.failure_messages
        more = f" (and {len(msgs) - 1} more)" if len(msgs) > 1 else ""
        if not force:
            raise PublishRefusedError(
                f"refusing to publish {out}: {msgs[0]}{more}; fix it (mtpquant inspect {out} says what is wrong) "
                "or pass --force to publish it anyway, with the card saying so"
            )
        log.warning("publishing despite failed checks (--force): %s%s", msgs[0], more)
    return ckpt, report


def _existing_card(out: Path) -> str | None:
    path = out / CARD_NAME
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""  # unreadable: treat as a person's file (kept unless --overwrite-card)


def _endpoint(opts: PublishOptions) -> str | None:
    return opts.endpoint or os.environ.get("HF_ENDPOINT") or None


def _secrets(opts: PublishOptions) -> list[str]:
    """Every token the client may send, to mask it wherever text leaves this module."""
    secrets = [opts.token] if opts.token else []
    try:
        from huggingface_hub import get_token

        found = get_token()
        if found:
            secrets.append(found)
    except Exception:  # a broken token file must not turn into a crash here
        pass
    for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(key):
            secrets.append(os.environ[key])
    return secrets


def publish(opts: PublishOptions) -> PublishResult:
    """Gate, card and upload OUT to ``opts.repo`` (with ``dry_run``: everything but the upload and the write)."""
    _check_options(opts)
    base, base_revision = check_base_model(opts.base_model, opts.base_model_revision)
    out = Path(opts.out)
    if not out.is_dir():
        raise PublishRefusedError(f"{out}: not a directory (publish uploads a checkpoint directory)")
    files = plan_files(out)
    try:
        ckpt, report = _gate(out, opts.force)
    except (CheckpointError, ConfigError) as exc:
        raise PublishRefusedError(f"refusing to publish {out}: {exc}") from None
    forced = not report.healthy

    config = ckpt.config
    hfq = ckpt.hf_quant_config
    family_key = ckpt.spec.family.key
    existing = _existing_card(out)
    origin = card_origin(existing) if existing is not None else None
    provenance = source_provenance(ckpt.source)
    if base is not None:  # recorded like convert's --base-model: a step of its own, written before the upload
        command = public_args(opts.command or ("mtpquant", "publish", str(out), "--repo", opts.repo))
        step = Step("publish", command, base_model=base, base_model_revision=base_revision)
        provenance = provenance.then(step)
    facts = CardFacts(
        repo_id=opts.repo,
        report=report,
        family_key=family_key,
        config=config,
        hf_quant_config=hfq,
        provenance=provenance,
        license=read_license(provenance, config, existing),
        validation=read_validation(out),
        recipe=read_recipe(out, provenance),
        revision=opts.revision if not opts.create_pr else None,
        forced=forced,
        license_file=next((f.path for f in files if f.path in _LICENSE_FILES), None),
        search=read_search(out) if provenance.mode == "search" else None,
    )
    card_text = str(build_card(facts))
    problems = validate_card_metadata(_metadata(card_text))
    if problems:
        raise PublishRefusedError(f"the generated card's metadata would be refused by the Hub: {problems[0]}")

    if existing is None:
        action = "generated"
    elif origin == "generated":
        action = "regenerated"
    elif opts.overwrite_card:
        action = "overwritten"
    else:
        action = "kept"
        card_text = existing
        log.info("%s/%s was written or edited by a person; keeping it (--overwrite-card replaces it)", out, CARD_NAME)
        _check_kept_card(out, existing)
    secrets = _secrets(opts)
    if any(s in card_text for s in secrets):
        raise PublishRefusedError(f"{out}/{CARD_NAME} contains the Hub token; refusing to upload it")
    refuse_private(out, files, card_text, secrets)
    card_bytes = card_text.encode("utf-8")
    note = {"kept": "card kept (written or edited by a person)"}.get(action, f"model card ({action})")
    listed = [f for f in files if f.path != CARD_NAME] + [PublishFile(CARD_NAME, len(card_bytes), note)]
    listed.sort(key=lambda f: f.path)
    result = PublishResult(
        repo_id=opts.repo,
        revision=opts.revision,
        dry_run=opts.dry_run,
        files=tuple(listed),
        card=card_text,
        card_action=action,
        healthy=report.healthy,
        forced=forced,
        gate_failures=tuple(report.failure_messages),
        verdicts=dict(report.verdicts),
    )
    if opts.dry_run:
        log.info(
            "dry run: %d files (%d bytes) would go to %s; nothing uploaded", len(listed), result.total_bytes, opts.repo
        )
        return result

    from mtpquant.checkpoint.filesystem import atomic_write_bytes

    # the card (and the base model recorded) go into OUT for the upload; a failed upload puts OUT back as it was
    writes = {PROVENANCE_FILE: provenance.to_bytes() if base is not None else None}
    writes[CARD_NAME] = card_bytes if action != "kept" else None
    before = {name: (out / name).read_bytes() if (out / name).is_file() else None for name in writes}
    for name, data in writes.items():
        if data is not None:
            atomic_write_bytes(out / name, data)
    try:
        return _upload(opts, out, result, secrets)
    except MtpquantError:
        for name, data in writes.items():
            if data is not None:
                old = before[name]
                if old is None:
                    (out / name).unlink(missing_ok=True)
                else:
                    atomic_write_bytes(out / name, old)
        raise


def _check_kept_card(out: Path, text: str) -> None:
    """A kept card must parse as the Hub parses it; doubtful metadata fields are only warned about."""
    import yaml

    try:
        meta = _metadata(text)
    except (ValueError, TypeError, yaml.YAMLError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PublishRefusedError(
            f"{out}/{CARD_NAME}: its metadata block does not parse ({reason}); fix it or pass --overwrite-card"
        ) from None
    for problem in validate_card_metadata(meta):
        log.warning("%s/%s (kept as written): %s", out, CARD_NAME, problem)


def _metadata(card_text: str) -> dict[str, Any]:
    from huggingface_hub import ModelCard

    return dict(ModelCard(card_text).data.to_dict())


def _commit_message(opts: PublishOptions, result: PublishResult) -> tuple[str, str]:
    title = opts.commit_message or f"Upload {opts.repo.split('/')[-1]} with mtpquant {__version__}"
    lines = [f"Published by mtpquant {__version__} after `mtpquant inspect`:"]
    lines += [f"- {public_text(v)}" for v in result.verdicts.values()]
    if result.forced:
        lines.append("Published with --force despite: " + "; ".join(result.gate_failures))
    return title, "\n".join(lines)


def _upload(opts: PublishOptions, out: Path, result: PublishResult, secrets: list[str]) -> PublishResult:
    from huggingface_hub import HfApi

    from mtpquant.net.hub import configure_client

    configure_client()
    endpoint = _endpoint(opts)
    api = HfApi(endpoint=endpoint, token=opts.token, library_name="mtpquant", library_version=__version__)
    title, description = _commit_message(opts, result)
    where = f"{opts.repo}@{opts.revision}" if opts.revision else opts.repo
    log.info(
        "uploading %d files (%d bytes) from %s to %s%s",
        len(result.files),
        result.total_bytes,
        out,
        where,
        " as a pull request" if opts.create_pr else "",
    )
    step = "creating the repo"
    failure: MtpquantError | None = None
    try:
        repo_url = api.create_repo(opts.repo, private=opts.private, exist_ok=True, repo_type="model")
        if opts.revision and opts.revision != "main" and not opts.revision.startswith("refs/pr/"):
            step = f"creating branch {opts.revision}"
            api.create_branch(opts.repo, branch=opts.revision, exist_ok=True, repo_type="model")
        step = "uploading"
        info = api.upload_folder(
            repo_id=opts.repo,
            repo_type="model",
            folder_path=out,
            revision=opts.revision,
            create_pr=opts.create_pr,
            commit_message=title,
            commit_description=description,
            ignore_patterns=[*HIDDEN, *LOCAL_ONLY],
            delete_patterns=list(_REPLACED_REMOTE),
        )
    except Exception as exc:  # every client failure becomes one token-free line
        failure = _failure(exc, step, opts.repo, endpoint, secrets)
    if failure is not None:
        # Raised outside the handler: the client's exception (which holds the request) is not chained.
        raise failure
    log.info("committed %s", info.commit_url)
    return dataclasses.replace(
        result,
        commit_url=info.commit_url,
        commit_oid=info.oid,
        pr_url=info.pr_url,
        pr_revision=info.pr_revision,
        repo_url=str(repo_url),
    )


def _failure(exc: Exception, step: str, repo: str, endpoint: str | None, secrets: list[str]) -> MtpquantError:
    """The error to raise for a failed Hub call: unreachable (30), no access (31) and rate limits (32) as for
    every Hub call; any other refusal of the upload is an UploadError (14)."""
    from huggingface_hub.errors import HfHubHTTPError

    from mtpquant.net.hub import translate

    status = getattr(getattr(exc, "response", None), "status_code", None) if isinstance(exc, HfHubHTTPError) else None
    err = translate(exc, f"publishing to {repo}", step, endpoint)
    if isinstance(err, HubUnreachableError):
        return HubUnreachableError(redact(str(err), secrets))
    if isinstance(err, HubAccessError) or status in (401, 403):
        return HubAccessError(_describe(exc, step, repo, secrets))
    if isinstance(err, HubRefusedError) and (status == 429 or status is None):
        return HubRefusedError(redact(str(err), secrets))
    return UploadError(_describe(exc, step, repo, secrets))


def _describe(exc: Exception, step: str, repo: str, secrets: list[str]) -> str:
    """One line for a failed Hub call: step, HTTP status and the server's message, tokens masked."""
    from huggingface_hub.errors import HfHubHTTPError

    status = None
    detail = ""
    if isinstance(exc, HfHubHTTPError):
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        server_message = getattr(exc, "server_message", None)
        detail = server_message or str(exc).splitlines()[0]
    else:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    hint = ""
    if status == 401:
        hint = " (set HF_TOKEN or run `hf auth login` with a token that can write to it)"
    elif status == 403:
        hint = " (the token has no write access to this namespace)"
    head = f"HTTP {status}: " if status else f"{type(exc).__name__}: "
    text = f"publishing to {repo} failed while {step}: {head}{detail.strip()}{hint}"
    return redact(" ".join(text.split()), secrets)
