"""`lmstack batch run INPUT.jsonl --out OUTPUT.jsonl [--errors ERR.jsonl] MODEL_OR_STACK`: a batch
input file run to the end in this process, no server, as vLLM's `run-batch`.

Each line goes through the HTTP API's own handlers (`dispatch`: the Litestar app called in
process), so a line answers exactly what the Batch API and a plain HTTP request would. The engine
is the one `lmstack serve` builds (resolved and prepared the same way, loaded on its engine
thread: torch work kept on one thread runs ~1.5x faster than split across two, see
`AsyncEngine`). Lines may come from both endpoints (each line's `url` picks).

Results are appended to OUTPUT (status 200) and ERR (anything else) as they finish, in OpenAI's
batch line format, so an interrupted run is resumed by running the same command again: lines
whose custom_id is already answered are skipped, and a last line cut short is dropped.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import IO, Any

import msgspec

from lmstack.errors import LmstackError
from lmstack_api.batches.dispatch import RETRY_STATUSES, invalid_record, record_of, run_line
from lmstack_api.batches.lines import Line, read_lines

DEFAULT_INFLIGHT = 64


def default_errors_path(out: Path) -> Path:
    return out.with_name(out.stem + ".errors" + (out.suffix or ".jsonl"))


def _answered(path: Path) -> list[dict[str, Any]]:
    """The complete records of a previous run's file; a last line cut short by a kill is cut
    off the file (it is run again)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    out = []
    for raw in data[:keep].splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            raise LmstackError(
                f"{path} is not a batch output file (a line is not JSON); give another path"
            ) from None
    return out


def plan(lines: list[Line], out_path: Path, err_path: Path) -> tuple[list[Line], list[Line], int]:
    """(lines to report as invalid now, lines to run, lines already answered). A first run
    reports every invalid line before anything runs; a rerun (either file exists) has done that
    and skips the lines whose custom_id is answered in OUTPUT, or in ERR other than as a
    repeated id."""
    resumed = out_path.exists() or err_path.exists()
    done: set[str] = {r.get("custom_id") for r in _answered(out_path)}  # type: ignore[misc]
    for r in _answered(err_path):
        if (r.get("error") or {}).get("code") != "duplicate_custom_id":
            done.add(r.get("custom_id"))
    invalid = [] if resumed else [ln for ln in lines if ln.error is not None]
    todo = [ln for ln in lines if ln.error is None and ln.custom_id not in done]
    skipped = sum(1 for ln in lines if ln.error is None and ln.custom_id in done)
    return invalid, todo, skipped


def _append(f: IO[str], record: dict[str, Any]) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()  # in the OS's hands: a killed process loses nothing written


def build_app(stack_text: str, overrides: list[str]):
    """(app, state, request headers): the API over a freshly loaded engine, not listening."""
    from lmstack.engine.async_engine import AsyncEngine
    from lmstack.stack.config import load_stack
    from lmstack.stack.overrides import parse_overrides
    from lmstack.stack.plugins import make_plugin_manager
    from lmstack.stack.prepare import prepare_stack, resolve_stack
    from lmstack_api.app import create_app
    from lmstack_api.prompts import max_piece_bytes
    from lmstack_api.state import ServerState

    pm = make_plugin_manager(extra_plugins=["lmstack_api.plugin"])
    stack = resolve_stack(load_stack(stack_text, parse_overrides(overrides)), pm)
    prepared = prepare_stack(stack, plugin_manager=pm)
    state = ServerState(stack, AsyncEngine(prepared))
    # No server's batch state here: this run is its own batch.
    state.config = msgspec.structs.replace(state.config, batch_dir=None)
    state.max_piece_bytes = max_piece_bytes(state.engine.tokenizer)
    headers = {"authorization": f"Bearer {state.api_keys[0][0].decode()}"} if state.api_keys else {}
    return create_app(stack, state), state, headers


async def run_lines(app: Any, todo: list[Line], headers: dict[str, str], width: int, on_done) -> None:
    """Run `todo` with at most `width` lines in flight; `on_done(line, ok, record)` for each."""
    stop = asyncio.Event()  # never set: an offline run ends by finishing or by Ctrl-C
    queue = iter(todo)

    async def worker() -> None:
        for line in queue:
            while True:
                reply = await run_line(app, line, headers, stop)
                if reply.status not in RETRY_STATUSES:
                    break
                await asyncio.sleep(reply.retry_after())  # a rate limit of the stack's own
            on_done(line, *record_of(line, reply))

    async with asyncio.TaskGroup() as group:  # one failing cancels the others
        for _ in range(max(1, min(width, len(todo)))):
            group.create_task(worker())


def run(
    stack_text: str,
    overrides: list[str],
    input_path: Path,
    out_path: Path,
    err_path: Path | None = None,
    max_inflight: int | None = None,
) -> int:
    from lmstack.commands.progress import Progress

    err_path = err_path or default_errors_path(out_path)
    if out_path.resolve() == err_path.resolve() or input_path.resolve() in (
        out_path.resolve(),
        err_path.resolve(),
    ):
        raise LmstackError("INPUT, --out and --errors must be three different files")
    try:
        data = input_path.read_bytes()
    except OSError as exc:
        raise LmstackError(f"cannot read {input_path}: {exc.strerror or exc}") from None
    lines = read_lines(data, None)
    invalid, todo, skipped = plan(lines, out_path, err_path)
    counts = {True: 0, False: len(invalid)}
    with open(err_path, "a") as err_file, open(out_path, "a") as out_file:
        for line in invalid:
            _append(err_file, invalid_record(line)[1])
        if skipped:
            print(f"resuming: {skipped} line(s) already answered in {out_path} / {err_path}", file=sys.stderr)
        if todo:
            app, state, headers = build_app(stack_text, overrides)
            width = max_inflight or state.engine.limits.max_num_seqs or DEFAULT_INFLIGHT
            progress = Progress(len(todo), "batch", "lines")

            def done(line: Line, ok: bool, record: dict[str, Any]) -> None:
                _append(out_file if ok else err_file, record)
                counts[ok] += 1
                progress.update()

            try:
                asyncio.run(run_lines(app, todo, headers, width, done))
            except KeyboardInterrupt:
                print(
                    f"\ninterrupted: rerun the same command to resume ({counts[True]} line(s) saved)",
                    file=sys.stderr,
                )
                return 130
            finally:
                progress.close()
                state.grammar_guard.close()
                state.shutdown()
        for f in (out_file, err_file):
            os.fsync(f.fileno())
    print(
        f"{counts[True]} line(s) answered -> {out_path}; {counts[False]} failed -> {err_path}"
        + (f"; {skipped} answered before" if skipped else ""),
        file=sys.stderr,
    )
    return 0
