"""The stack argument every command takes the same way: `MODEL_OR_STACK` (a stack file, or a
model alone: a known name, a .gguf file, a Hugging Face folder or Hub id, served with every
default) and `--set KEY.PATH=VALUE` (repeatable) over it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from lmstack.errors import LmstackError

if TYPE_CHECKING:
    from lmstack.stack.config import StackConfig

STACK_HELP = (
    "a stack YAML file, or a model alone (a known name such as smollm2-135m-instruct, a .gguf file, "
    "a Hugging Face folder, or a Hub id: org/name, org/name@revision, org/name:Q4_K_M, "
    "org/name/file.gguf) served with every default"
)


def add_stack_arguments(parser: argparse.ArgumentParser, *, legacy_option: bool = False) -> None:
    """MODEL_OR_STACK and --set. `legacy_option`: the command took `--stack FILE` before, which
    still works (scripts keep running) as another spelling of MODEL_OR_STACK."""
    parser.add_argument(
        "stack", nargs="?" if legacy_option else None, metavar="MODEL_OR_STACK", help=STACK_HELP
    )
    if legacy_option:
        parser.add_argument(
            "--stack", dest="stack_option", metavar="FILE", help="deprecated: the same as MODEL_OR_STACK"
        )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="set one key over the stack, as the file would (repeatable; the value is YAML): "
        "--set scheduler.max_num_seqs=8 --set attention=torch --set server.port=8001",
    )


def stack_text(args: argparse.Namespace) -> str:
    """What the command line names as the stack (MODEL_OR_STACK, or the old --stack), left in
    `args.stack` alone (a handler that passes `args` on may ask again)."""
    option = getattr(args, "stack_option", None)
    if option is not None and args.stack is not None:
        raise LmstackError(
            f"give the stack once: {args.stack!r} and --stack {option!r} (--stack is its old spelling)"
        )
    text = args.stack if args.stack is not None else option
    if text is None:
        raise LmstackError("name a model or a stack file (MODEL_OR_STACK)")
    args.stack, args.stack_option = text, None
    return text


def stack_from_args(args: argparse.Namespace) -> StackConfig:
    """The stack the command line names, with its --set keys."""
    from lmstack.stack.config import load_stack  # deferred: `--help` stays quick
    from lmstack.stack.overrides import parse_overrides

    return load_stack(stack_text(args), parse_overrides(args.overrides))


def positive_int(text: str) -> int:
    """An argparse type for counts (`--max-tokens`, `--samples`): a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
