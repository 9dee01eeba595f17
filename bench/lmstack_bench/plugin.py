"""lmstack-bench as a plugin of the core: it adds `lmstack bench` and `lmstack tune` (entry point
`bench` in group `lmstack`). Each parses its own arguments (`lmstack bench serve --help`,
`lmstack tune --help`)."""

from __future__ import annotations

import argparse

from lmstack.hookspecs import hookimpl


@hookimpl
def lmstack_register_commands(subparsers):
    bench = subparsers.add_parser(
        "bench",
        help="benchmark a live OpenAI-compatible server (lmstack bench serve --help)",
        description="Benchmark servers: `lmstack bench serve --help`, `lmstack bench plot --help`.",
        add_help=False,
        # Everything after `bench` goes to the benchmark's own parser. An argument list that
        # starts with an option (`lmstack bench --help`) would not reach the REMAINDER
        # positional below (argparse matches positionals only up to the first option-like
        # string) and failed as unrecognized: with no prefix characters of its own, this parser
        # sees none of them as options.
        prefix_chars="+",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=_cmd_bench)

    tune = subparsers.add_parser(
        "tune",
        help="search scheduler knobs, quantizer, KV dtype and speculation for the most goodput at an SLO",
        description="Tune a stack against a latency SLO: `lmstack tune --help`.",
        add_help=False,
        prefix_chars="+",  # as `bench` above: every argument goes to the tuner's own parser
    )
    tune.add_argument("tune_args", nargs=argparse.REMAINDER)
    tune.set_defaults(handler=_cmd_tune)


def _cmd_bench(args: argparse.Namespace) -> int:
    from lmstack_bench.cli import main as bench_main

    return bench_main(args.bench_args or ["--help"])


def _cmd_tune(args: argparse.Namespace) -> int:
    from lmstack_bench.tune import main as tune_main

    return tune_main(args.tune_args or ["--help"])
