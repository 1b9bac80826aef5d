"""``mtpquant publish OUT --repo ORG/NAME``."""

from __future__ import annotations

import argparse
from pathlib import Path

from mtpquant.cli import HUB_CODES, add_base_model_arguments, add_command, options_from
from mtpquant.errors import ExitCode
from mtpquant.render import publish_plan_text
from mtpquant.units import format_bytes

EXAMPLES = """\
examples:
  mtpquant publish ./Qwen3.5-4B-NVFP4-MTP --repo my-org/Qwen3.5-4B-NVFP4-MTP --dry-run
  mtpquant publish ./Qwen3.5-4B-NVFP4-MTP --repo my-org/Qwen3.5-4B-NVFP4-MTP --private
  mtpquant publish ./Qwen3.5-4B-NVFP4-MTP --repo my-org/Qwen3.5-4B-NVFP4-MTP --create-pr --base-model Qwen/Qwen3.5-4B

Before anything is uploaded, OUT must pass the checks of `mtpquant inspect` (MTP present when
declared, exclusions consistent with the tensors, index intact); --force publishes a failing OUT anyway
and the card says so. An incomplete OUT (a shard or tensor the index names is absent) is never published.

The card (README.md) is generated from OUT's facts; a README.md written or edited by a person is kept
unless --overwrite-card. Remote *.safetensors and index files that OUT does not have are deleted in the
same commit. The token comes from HF_TOKEN or `hf auth login`; HF_ENDPOINT selects another Hub server.

"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``publish`` subcommand."""
    p = add_command(
        sub,
        "publish",
        summary="check OUT, write its model card and upload it to the Hub",
        description="Gate OUT through the inspect checks, generate its model card and upload it with huggingface_hub.",
        examples=EXAMPLES,
        codes=(ExitCode.ARCHITECTURE, ExitCode.PUBLISH_REFUSED, ExitCode.UPLOAD, *HUB_CODES),
    )
    p.add_argument("out", metavar="OUT", type=Path, help="checkpoint directory to publish (e.g. convert's OUT)")
    p.add_argument("--repo", required=True, metavar="ORG/NAME", help="Hub model repo to publish to")
    p.add_argument(
        "--private", action="store_true", help="create the repo private (an existing repo keeps its visibility)"
    )
    p.add_argument(
        "--revision", metavar="BRANCH", help="branch to commit to (created from main if missing), or refs/pr/N"
    )
    p.add_argument("--create-pr", action="store_true", help="open a pull request against main instead of committing")
    p.add_argument(
        "--commit-message", metavar="MSG", help="commit title (default: 'Upload NAME with mtpquant VERSION')"
    )
    p.add_argument("--dry-run", action="store_true", help="print the file list and the card; upload and write nothing")
    p.add_argument("--force", action="store_true", help="publish even if the inspect checks fail (the card says so)")
    p.add_argument("--overwrite-card", action="store_true", help="replace a README.md written by a person")
    add_base_model_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Publish and print the commit URL (or, with --dry-run, the plan and the card)."""
    from mtpquant.api import PublishOptions, publish

    opts = options_from(PublishOptions, args)
    result = publish(opts)
    if result.dry_run:
        print(publish_plan_text(result))
        return 0
    if result.forced:
        print("published with --force despite: " + "; ".join(result.gate_failures))
    print(
        f"published {len(result.files)} files ({format_bytes(result.total_bytes)}) to {result.repo_id}; "
        f"card {result.card_action}"
    )
    if result.pr_url:
        print(f"pull request: {result.pr_url}")
    print(f"commit: {result.commit_url}")
    return 0
