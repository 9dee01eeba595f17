"""The `lmstack` command: check a stack, list plugins, generate text; plugins add more (serve,
bench, quantize, eval) through the `lmstack_register_commands` hook.

A problem the user can fix (any `LmstackError`) is one line on stderr, ``error: <message>``,
and exit status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmstack.commands.stack_args import add_stack_arguments, positive_int, stack_from_args
from lmstack.errors import BuildError, LmstackError, one_line

if TYPE_CHECKING:
    import pluggy

    from lmstack.model.config import ModelConfig
    from lmstack.stack.resolve import ResolvedStack

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `plugins --check` lists the problems itself: the warnings would say everything twice.
    restore = _configure_logging(quiet_plugins="plugins" in argv[:1] and "--check" in argv)
    try:
        return _main(argv)
    finally:
        restore()


def _main(argv: list[str]) -> int:
    try:
        pm = _plugin_manager()
    except LmstackError as exc:
        # A broken plugin must not take `check` / `plugins` down: they report it themselves
        # when they build the registry; only plugin-provided commands are missing meanwhile.
        pm, load_error = None, exc
    else:
        load_error = None
    parser = build_parser(pm)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in _commands(parser):
        print(f"error: {_unknown_command(command, load_error)}", file=sys.stderr)
        return EXIT_ERROR
    args = parser.parse_args(argv)
    try:
        if os.environ.get("LMSTACK_MAX_ISA"):  # a bad value is one line before anything runs
            from lmstack.kernels.hardware import isa_cap

            isa_cap()
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `lmstack plugins | head`: the reader left; stop quietly without a second error when
        # Python flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (LmstackError, OSError) as exc:
        # The traceback is for the log (LMSTACK_LOG_LEVEL=debug); the user gets the one line.
        # A BuildError's was logged where the factory raised.
        if not isinstance(exc, BuildError):
            logging.getLogger("lmstack.cli").debug("%s", exc, exc_info=exc)
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR


LOG_LEVEL_ENV = "LMSTACK_LOG_LEVEL"


class _StderrHandler(logging.Handler):
    """``warning: <message>`` on whatever `sys.stderr` is now (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _configure_logging(quiet_plugins: bool = False) -> Callable[[], None]:
    """lmstack's own log records (a skipped plugin's warning; at ``LMSTACK_LOG_LEVEL=debug``
    the tracebacks behind one-line errors) as ``level: message`` lines on stderr, for one
    command; returns what undoes it (`main` runs in-process in tests and embedders)."""
    logger, plugins_logger = logging.getLogger("lmstack"), logging.getLogger("lmstack.stack.plugins")
    saved = logger.level, plugins_logger.level
    level = os.environ.get(LOG_LEVEL_ENV, "warning").strip().upper()
    logger.setLevel(level if level in logging.getLevelNamesMapping() else logging.WARNING)
    if quiet_plugins:
        plugins_logger.setLevel(logging.ERROR)
    handler = _StderrHandler()
    handler.setFormatter(_LevelFormatter())
    logger.addHandler(handler)

    def restore() -> None:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        plugins_logger.setLevel(saved[1])

    return restore


class _LevelFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info and logging.getLogger("lmstack").isEnabledFor(logging.DEBUG):
            text += "\n" + self.formatException(record.exc_info)
        return text


def build_parser(pm: pluggy.PluginManager | None = None) -> argparse.ArgumentParser:
    """The core's commands plus those installed plugins add (`lmstack serve` comes from
    lmstack-api, `lmstack bench` from lmstack-bench) through `lmstack_register_commands`."""
    parser = argparse.ArgumentParser(
        prog="lmstack", description="An LLM inference server assembled from plugins."
    )
    parser.add_argument("--version", action="version", version=f"lmstack {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = sub.add_parser(
        "check",
        help="resolve and validate a stack (or a model alone) without loading weights",
        description="Load a stack file (or take a model alone with every default), resolve its "
        "components against the installed plugins, read the model's metadata (no weights) and "
        "check that everything fits together.",
    )
    add_stack_arguments(check)
    check.add_argument("--json", action="store_true", help="print the resolved stack as JSON")
    check.add_argument(
        "--skip-model", action="store_true", help="do not open the model (check the components only)"
    )
    check.add_argument(
        "--build",
        action="store_true",
        help="also run every component's factory (quantizer, kernels, parallel layout, allocator, "
        "scheduler, speculator) with the model's metadata, in build order, so a factory that "
        "raises (a missing draft model, a bad option value) is reported now, in one line. It does "
        "not create the executor, load the weights, allocate the KV cache or run a step: failures "
        "there still show only at `generate` / `serve`. Needs the model (not --skip-model)",
    )
    check.add_argument(
        "--memory",
        action="store_true",
        help="also build the model as it will run (the quantizer's layers, the weights loaded, in this "
        "process, no KV cache) and print its resident weight bytes, bytes per weight, and the "
        "checkpoint tensor types the quantizer dequantized at load; implies --build",
    )
    check.set_defaults(handler=_cmd_check)

    plugins = sub.add_parser(
        "plugins",
        help="list every installed component, or show one in full",
        description="List every installed component (kind, name, distribution, version, options "
        "with their defaults) and the stack sections plugins declare; with NAME, show that "
        "component in full: capabilities, API range, and each option's type, default, allowed "
        "values and description.",
    )
    plugins.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="a component or stack section (every component of that name: `none` is one per kind)",
    )
    plugins.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of a table: a list of components (and sections, kind `section`), "
        "each option with its type, default, allowed values and description",
    )
    plugins.add_argument(
        "--check",
        action="store_true",
        help="list every plugin problem (failed import, invalid component, unsupported API, "
        "registers nothing), one a line; exit status 1 when there is any",
    )
    plugins.set_defaults(handler=_cmd_plugins)

    generate = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Build the engine from a stack file (or a model alone) and answer one prompt.",
    )
    add_stack_arguments(generate, legacy_option=True)
    generate.add_argument("--max-tokens", type=positive_int, default=128, metavar="N")
    generate.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 (the default) samples greedily"
    )
    generate.add_argument(
        "--seed", type=int, default=None, metavar="N", help="seed for sampling (reproducible output)"
    )
    generate.add_argument("prompt", metavar="PROMPT")
    generate.set_defaults(handler=_cmd_generate)

    plan = sub.add_parser(
        "plan",
        help="plan capacity: memory, sequences that fit, step times, replicas for a request rate",
        description="Break down the stack's memory as it will run (weights, KV per token and per "
        "sequence, activations, runtime) against the device's memory and count the sequences that "
        "fit; with --profile measure this machine's prefill and decode step times (cached), and with "
        "--rate / --slo plan the replicas a load needs, printing the queueing model's assumptions.",
    )
    from lmstack.commands.plan import add_arguments as add_plan_arguments

    add_plan_arguments(plan)
    plan.set_defaults(handler=_cmd_plan)

    if pm is not None:
        from lmstack.stack.plugins import register_commands

        register_commands(pm, sub)
    return parser


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def _cmd_check(args: argparse.Namespace) -> int:
    from lmstack.stack.prepare import prepare_stack, resolve_stack

    if (args.build or args.memory) and args.skip_model:
        flag = "--build" if args.build else "--memory"
        raise LmstackError(f"{flag} needs the model's metadata; leave out --skip-model")
    # One pass, as `serve` makes it: the same plugins resolve the stack and pick the model's
    # architecture (a plugin's architecture is checked as it will be served).
    pm = _plugin_manager()
    stack = stack_from_args(args)
    model_config = memory = None
    if args.skip_model:
        resolved = resolve_stack(stack, pm)
    else:
        prepared = prepare_stack(stack, plugin_manager=pm)
        resolved, model_config = prepared.resolved, prepared.model_config
        if args.build or args.memory:
            from lmstack.stack.build import check_build

            built = check_build(resolved, model_config, prepared.models)
        if args.memory:
            memory = _measure_memory(prepared, built["quantizer"])

    if args.json:
        out = resolved.describe()
        if model_config is not None:
            out["model_config"] = _jsonable(model_config)
        if memory is not None:
            out["memory"] = {**dataclasses.asdict(memory), "bytes_per_weight": memory.bytes_per_weight}
        print(json.dumps(out, indent=2))
    else:
        _print_check(args.stack, resolved, model_config, built=args.build or args.memory, memory=memory)
    return 0


def _measure_memory(prepared: Any, quantizer: Any) -> Any:
    """`lmstack check --memory`: the model built and loaded here (`lmstack.model.memory`)."""
    from lmstack.model.memory import measure_weights

    r, mc = prepared.resolved, prepared.model_config
    positions = min(mc.max_position_embeddings, r.config.max_model_len or mc.max_position_embeddings)
    return measure_weights(prepared.source, mc, quantizer, dtype=r.dtype, max_positions=positions)


def _cmd_plugins(args: argparse.Namespace) -> int:
    from lmstack.commands import plugins
    from lmstack.stack.plugins import default_registry

    if args.check and args.name:
        raise LmstackError("--check lists the problems of every plugin; leave out NAME")
    registry = default_registry()
    if args.check:
        problems = registry.problems
        if args.json:
            print(json.dumps([_jsonable(p) | {"text": str(p)} for p in problems], indent=2))
        else:
            print("\n".join(str(p) for p in problems) if problems else "no problems")
        return 1 if problems else 0
    return plugins.run(registry, args.name, args.json)


def _plugin_manager() -> pluggy.PluginManager:
    from lmstack.stack.plugins import make_plugin_manager

    return make_plugin_manager()


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


# Commands this repository's other distributions add, for a hint when one is not installed.
_KNOWN_PLUGIN_COMMANDS = {
    "serve": "lmstack-api",
    "bench": "lmstack-bench",
    "quantize": "lmstack-calibrate",
    "eval": "lmstack-calibrate",
}


def _unknown_command(command: str, load_error: LmstackError | None) -> str:
    if load_error is not None:
        return f"unknown command {command!r}: plugins could not be loaded ({one_line(load_error)})"
    dist = _KNOWN_PLUGIN_COMMANDS.get(command)
    if dist is None:
        return f"unknown command {command!r}; run `lmstack --help` for the commands"
    from lmstack.stack.plugins import ALLOW_LIST_ENV, AUTOLOAD_ENV

    return (
        f"unknown command {command!r}: it comes from the {dist} distribution, which is not installed or "
        f"not loaded (install it, and check {AUTOLOAD_ENV} / {ALLOW_LIST_ENV})"
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from lmstack.commands import generate as cli_generate
    from lmstack.commands.stack_args import stack_text

    stack_text(args)  # the old --stack spelling too, as args.stack
    return int(cli_generate.run(args) or 0)


def _cmd_plan(args: argparse.Namespace) -> int:
    from lmstack.commands import plan

    return plan.run(args)


# `auto_reasons` keys that are not roles: how `lmstack check` names them.
_AUTO_LABEL = {"kv_cache_memory": "KV cache memory", "block_size": "KV block size"}


def _print_check(
    path: str,
    resolved: ResolvedStack,
    model_config: ModelConfig | None,
    built: bool = False,
    memory: Any = None,
) -> None:
    from lmstack.stack.resolved import DTYPE_NAMES, ROLE_LABEL

    print(f"stack     {path}")
    print(f"model     {resolved.model}")
    if model_config is not None:
        mc = model_config
        window = f", sliding window {mc.sliding_window}" if mc.sliding_window else ""
        print(
            f"          {mc.num_layers} layers, hidden {mc.hidden_size}, {mc.num_heads} heads "
            f"({mc.num_kv_heads} KV), head_dim {mc.head_dim}, context {mc.max_position_embeddings}{window}"
        )
    print(f"device    {resolved.device}")
    if "device" in resolved.auto_reasons:
        print(f"          {resolved.auto_reasons['device']}")
    print(f"dtype     {DTYPE_NAMES[resolved.dtype]} (KV cache {DTYPE_NAMES.get(resolved.kv_cache_dtype)})")
    print(f"          {resolved.dtype_reason}")
    fmt = resolved.checkpoint_format or "-"
    print(f"weights   {fmt} checkpoint, quantizer {resolved.quantizer.name}")
    if memory is not None:
        m = memory
        print(
            f"memory    {m.resident_bytes / 1e6:.1f} MB resident, {m.bytes_per_weight:.3f} bytes a weight "
            f"({m.weights / 1e6:.2f} M weights; the checkpoint's tensors {m.file_bytes / 1e6:.1f} MB, "
            f"{m.resident_bytes / max(1, m.file_bytes):.2f}x)"
        )
        for name, extra in sorted(m.dequantized.items()):
            print(f"          {name} tensors dequantized at load: +{extra / 1e6:.1f} MB")
    print()
    rows = []
    for role, sel in resolved.roles().items():
        desc = sel.describe()
        rows.append(
            [
                ROLE_LABEL[role],
                desc["name"],
                desc["distribution"] or "-",
                desc["version"] or "-",
                _pairs(desc["options"]) or "-",
            ]
        )
    print(_table(["ROLE", "COMPONENT", "DISTRIBUTION", "VERSION", "OPTIONS"], rows))
    print()
    # What each `auto` chose and why (the device's is printed beside it, above).
    choices = {key: reason for key, reason in resolved.auto_reasons.items() if key != "device"}
    for key, reason in choices.items():
        print(f"{ROLE_LABEL.get(key, _AUTO_LABEL.get(key, key))}: {reason}")
    if choices:
        print()
    from lmstack.kernels.hardware import dtype_warning
    from lmstack.stack.resolve import speculation_warning

    slow = dtype_warning(resolved.device, resolved.dtype) if resolved.config.dtype != "auto" else None
    if slow:
        print(f"warning: {slow}", file=sys.stderr)
    drift = speculation_warning(resolved)
    if drift:
        print(f"warning: {drift}", file=sys.stderr)
    checked = "fits the model" if model_config is not None else "resolves (model not opened)"
    if built:
        checked += " and every component builds"
    loaded = "the weights were loaded to measure memory" if memory is not None else "no weights were loaded"
    print(f"ok: the stack {checked}; {loaded}")


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns; the last one is free-width."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [str(cell).ljust(w) for cell, w in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, str(row[-1])]).rstrip())
    return "\n".join(lines)


def _pairs(mapping: Any) -> str:
    if not isinstance(mapping, dict):
        return str(mapping)
    return ", ".join(f"{k}={_short(v)}" for k, v in mapping.items())


def _short(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ",".join(_short(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def _jsonable(value: Any) -> Any:
    import dataclasses

    import msgspec

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return msgspec.to_builtins(value, str_keys=True, enc_hook=repr)


def _version() -> str:
    from lmstack.stack.plugins import lmstack_version

    return lmstack_version()


if __name__ == "__main__":
    sys.exit(main())
