"""``qaccel export CHECKPOINT OUT [--bnb int8|nf4]``: a training checkpoint -> a Hugging Face model folder."""

from __future__ import annotations

import argparse

from .._errors import report_bad_input
from .._extras import MissingExtraError
from ._output import emit

_BNB_CHOICES = ("int8", "nf4")  # qaccel.hub.BNB_CHOICES, repeated so that --help needs no heavy import


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a training checkpoint to a Hugging Face model folder (full precision or bitsandbytes)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("checkpoint", help="a checkpoint-STEP folder written by training (holds qaccel_state.json)")
    parser.add_argument("out", help="the model folder to create")
    parser.add_argument("--bnb", choices=_BNB_CHOICES, help="quantize the weights with bitsandbytes (default: full precision)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    parser.add_argument("--model_name", help="name for the model card title and usage snippet (e.g. the Hub repo id)")
    parser.add_argument("--merge_adapter", action="store_true",
                        help="LoRA checkpoints: export the merged model (a plain transformers folder) instead of the adapter")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..hub.export import SIDECAR_FILE, export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, bnb=args.bnb, overwrite=args.overwrite, model_name=args.model_name,
                                 merge_adapter=args.merge_adapter)  # fmt: skip
    except (OSError, ValueError, RuntimeError, NotImplementedError, MissingExtraError) as err:
        return report_bad_input("qaccel export", err, exit_code=1)  # a failure, not a usage error
    files = sorted(p.name for p in out.iterdir())
    emit({"export": {"checkpoint": args.checkpoint, "out": str(out), "bnb": args.bnb, "files": files, "sidecar": SIDECAR_FILE}})
    return 0
