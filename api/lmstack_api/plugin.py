"""lmstack-api as a plugin of the core: it declares the `server:` stack section and adds the
`lmstack serve` command (entry point `api` in group `lmstack`). It owns the hook
`lmstack_register_tool_parsers` (`lmstack_api.hookspecs`) and registers the built-in tool-call
parsers through it, as any plugin would."""

from __future__ import annotations

import argparse

from lmstack.commands.stack_args import STACK_HELP, add_stack_arguments, positive_int, stack_text
from lmstack.hookspecs import hookimpl
from lmstack.registry import StackSection
from lmstack_api.config import SECTION, ServerConfig, public_view

# The core adds these hookspecs before it checks any plugin's hooks (lmstack.stack.plugins).
lmstack_hookspecs = ["lmstack_api.hookspecs"]


@hookimpl
def lmstack_register_tool_parsers(register):
    from lmstack_api.tool_parsers import BUILTIN_PARSERS

    for parser in BUILTIN_PARSERS:
        register(parser)


@hookimpl
def lmstack_register_stack_sections(register):
    register(
        StackSection(
            name=SECTION,
            type=ServerConfig,
            description="HTTP server: address, API keys, admission and rate limits, SLOs, drain",
            public=public_view,
        )
    )


@hookimpl
def lmstack_register_commands(subparsers):
    serve = subparsers.add_parser(
        "serve",
        help="serve a model or a stack over an OpenAI-compatible HTTP API",
        description="Resolve the stack (or take a model alone with every default), load the model "
        "and serve /v1/chat/completions, /v1/completions, /v1/models, /v1/stack, /health, /ready and /metrics.",
    )
    add_stack_arguments(serve)
    serve.add_argument("--host", default=None, help="address to bind (default: the stack's server.host)")
    serve.add_argument(
        "--port", type=int, default=None, help="port to bind, 0 for any free one (default: server.port)"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(handler=_cmd_serve)

    batch = subparsers.add_parser(
        "batch",
        help="run an OpenAI batch input file offline (the Batch API's format, no server)",
        description="Batch work without a server: see `lmstack batch run --help`.",
    )
    actions = batch.add_subparsers(dest="batch_command", metavar="ACTION", required=True)
    run = actions.add_parser(
        "run",
        help="run INPUT.jsonl to the end and write the answers (resumable)",
        description="Run every line of an OpenAI batch input file (custom_id, method, url "
        "/v1/chat/completions or /v1/completions, body) through this API's request handling on "
        "a model loaded in this process. Answers go to --out (status 200) and --errors (the rest) "
        "in the Batch API's line format as they finish; rerun the same command to resume.",
    )
    run.add_argument("input", metavar="INPUT.jsonl", help="the batch input file")
    # An option, not the usual positional: after INPUT an optional positional would have to come
    # before every option (argparse binds positionals in one run).
    run.add_argument("--stack", required=True, metavar="MODEL_OR_STACK", help=STACK_HELP)
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="set one key over the stack, as the file would (repeatable; the value is YAML)",
    )
    run.add_argument("--out", required=True, metavar="OUTPUT.jsonl", help="answers with status 200")
    run.add_argument(
        "--errors", default=None, metavar="ERR.jsonl", help="the other lines (default: OUTPUT.errors.jsonl)"
    )
    run.add_argument(
        "--max-inflight",
        type=positive_int,
        default=None,
        help="lines in flight (default: scheduler.max_num_seqs)",
    )
    run.set_defaults(handler=_cmd_batch_run)


def _cmd_serve(args: argparse.Namespace) -> int:
    from lmstack_api.server import serve  # uvicorn and litestar load only for this command

    return serve(
        stack_text(args), host=args.host, port=args.port, log_level=args.log_level, overrides=args.overrides
    )


def _cmd_batch_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lmstack_api.batches.offline import run

    return run(
        stack_text(args),
        args.overrides,
        Path(args.input),
        Path(args.out),
        Path(args.errors) if args.errors else None,
        args.max_inflight,
    )
