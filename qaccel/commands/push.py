"""``qaccel push OUT --repo_id ORG/NAME``: upload an exported model folder to the Hugging Face Hub in one commit."""

from __future__ import annotations

import argparse

from .._errors import report_bad_input
from ._output import emit


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push",
        help="upload an exported model folder to the Hub (HF_TOKEN, HF_ENDPOINT); --dry_run sends nothing",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("folder", help="a folder written by `qaccel export`")
    parser.add_argument("--repo_id", required=True, help="ORG/NAME on the Hub")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", help="branch to commit to (created when missing; default main)")
    parser.add_argument("--commit_message", help="default: 'Upload <folder> with qaccel'")
    parser.add_argument("--dry_run", action="store_true", help="print what would be uploaded (files, sizes, card front matter); send nothing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..hub.push import PushError, push_folder

    try:
        result = push_folder(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            dry_run=args.dry_run,
        )
    except (PushError, OSError, ValueError) as err:
        return report_bad_input("qaccel push", err, exit_code=1)  # a failure, not a usage error
    emit({"push": result})
    return 0
