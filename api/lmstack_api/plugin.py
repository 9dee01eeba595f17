"""lmstack-api as a plugin of the core: it declares the `server:` stack section and adds the
`lmstack serve` command (entry point `api` in group `lmstack`). It owns the hook
`lmstack_register_tool_parsers` (`lmstack_api.hookspecs`) and registers the built-in tool-call
parsers through it, as any plugin would."""

from __future__ import annotations

import argparse

from lmstack.commands.stack_args import add_stack_arguments, stack_text
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


def _cmd_serve(args: argparse.Namespace) -> int:
    from lmstack_api.server import serve  # uvicorn and litestar load only for this command

    return serve(
        stack_text(args), host=args.host, port=args.port, log_level=args.log_level, overrides=args.overrides
    )
