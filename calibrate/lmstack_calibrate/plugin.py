"""lmstack-calibrate as a plugin of the core: it adds `lmstack quantize` and `lmstack eval`
(entry point `calibrate` in group `lmstack`). The commands' modules (and torch) load only when
one runs."""

from __future__ import annotations

import argparse
from typing import Any

from lmstack.commands.stack_args import add_stack_arguments, positive_int, stack_text
from lmstack.hookspecs import hookimpl


@hookimpl
def lmstack_register_commands(subparsers):
    _add_eval_parser(subparsers)
    _add_quantize_parser(subparsers)


def _add_eval_parser(sub: Any) -> None:
    evaluate = sub.add_parser(
        "eval", help="measure the served model", description="Measure the model a stack serves."
    )
    what = evaluate.add_subparsers(dest="what", required=True, metavar="WHAT")
    ppl = what.add_parser(
        "perplexity",
        help="windowed perplexity over a text file",
        description="Perplexity of the model the stack serves (its quantizer and KV-cache dtype "
        "apply) over a text file, in non-overlapping windows of W predicted tokens (--method "
        "windows), or as llama.cpp's llama-perplexity -c N computes it (--method chunks: chunks of "
        "N tokens, a BOS first where the model adds one, the second half of each scored); each "
        "window or chunk runs through the engine as one request.",
    )
    add_stack_arguments(ppl, legacy_option=True)
    ppl.add_argument("--text", required=True, metavar="FILE", help="a UTF-8 text file")
    ppl.add_argument("--model", default=None, metavar="M", help="serve this model instead of the stack's")
    ppl.add_argument(
        "--method",
        choices=("windows", "chunks"),
        default="windows",
        help="windows (default), or chunks: llama-perplexity's, to compare with llama.cpp on the same file",
    )
    ppl.add_argument(
        "--max-tokens", type=positive_int, default=None, metavar="N", help="windows: read at most N tokens"
    )
    ppl.add_argument(
        "--window",
        type=positive_int,
        default=None,
        metavar="W",
        help="windows: predicted tokens per window (512)",
    )
    ppl.add_argument(
        "--ctx",
        type=positive_int,
        default=None,
        metavar="N",
        help="chunks: tokens per chunk, llama-perplexity's -c (512)",
    )
    ppl.add_argument(
        "--chunks",
        type=positive_int,
        default=None,
        metavar="N",
        help="chunks: at most N, llama-perplexity's --chunks",
    )
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    ppl.set_defaults(handler=_cmd_eval_perplexity)


def _add_quantize_parser(sub: Any) -> None:
    q = sub.add_parser(
        "quantize",
        help="write a quantized Hugging Face folder of a model (or a stack's model)",
        description="Quantize the model (a model alone, or the stack's model) (dequantized to fp32) with a quantizer plugin's "
        "checkpoint format and write a Hugging Face folder (compressed-tensors config.json, "
        "safetensors, tokenizer, chat template) that `model: DIR` serves. Methods that "
        "calibrate (awq) run their search on calibration text first.",
    )
    add_stack_arguments(q, legacy_option=True)
    q.add_argument(
        "--method", required=True, metavar="NAME", help="a quantizer: awq, rtn-int4, fp8, nvfp4, ..."
    )
    q.add_argument(
        "--out", required=True, metavar="DIR", help="the folder to write (must not exist or be empty)"
    )
    q.add_argument("--model", default=None, metavar="M", help="quantize this model instead of the stack's")
    q.add_argument(
        "--group-size", type=positive_int, default=None, metavar="N", help="the quantizer's group size"
    )
    q.add_argument(
        "--calibration",
        default=None,
        metavar="SOURCE",
        help="a text file, or `self` (the default: the model's own sampled answers to built-in "
        "prompts, saved as calibration.txt in the output folder)",
    )
    q.add_argument(
        "--num-samples",
        type=positive_int,
        default=32,
        metavar="N",
        help="calibration samples (a format that validates, e.g. awq's scale tuning, cuts a few more after them)",
    )
    q.add_argument("--seq-len", type=positive_int, default=512, metavar="L", help="tokens per sample")
    q.set_defaults(handler=_cmd_quantize)


def _cmd_eval_perplexity(args: argparse.Namespace) -> int:
    from lmstack_calibrate.perplexity import run_cli

    stack_text(args)  # the old --stack spelling too, as args.stack
    return run_cli(args)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from lmstack_calibrate.quantize import run_cli

    stack_text(args)  # the old --stack spelling too, as args.stack
    return run_cli(args)
