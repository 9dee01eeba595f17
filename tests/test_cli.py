"""The `lmstack` command line: one-line errors, exit codes, tables and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import msgspec
import pytest

from lmstack import cli
from lmstack.errors import ResolutionError
from lmstack.hookspecs import hookimpl
from lmstack.registry import Component, Registry, StackSection
from lmstack.stack.plugins import make_plugin_manager
from lmstack_api.config import ServerConfig


class FakeSchedOptions(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: int = 8


def fake_registry() -> Registry:
    reg = Registry()
    for name, kind, kw in [
        ("continuous", "scheduler", {"options_type": FakeSchedOptions}),
        ("paged", "allocator", {}),
        ("torch", "attention", {"capabilities": {"devices": ("cpu",), "phases": ("prefill", "decode")}}),
        ("none", "quantizer", {}),
        ("none", "speculator", {}),
        ("single", "parallel", {}),
        ("none", "cache", {}),
        ("gpu-only", "attention", {"capabilities": {"devices": ("cuda",)}, "api": ">=1.0,<2"}),
    ]:
        reg.add(
            Component(
                name=name,
                kind=kind,
                factory=lambda o, c: None,
                distribution="lmstack-fake",
                version="2.0",
                **kw,
            )
        )
    reg.add_section(StackSection("server", ServerConfig), distribution="lmstack-api", version="0.1.0")
    return reg


@pytest.fixture
def fakes(monkeypatch):
    """The CLI sees only the fake components."""
    monkeypatch.setattr("lmstack.stack.plugins.default_registry", fake_registry)
    # `check` resolves through the one pass of `lmstack.stack.prepare`.
    monkeypatch.setattr("lmstack.stack.prepare.build_registry", lambda pm: fake_registry())


@pytest.fixture
def stack_file(tmp_path):
    def write(text: str):
        path = tmp_path / "stack.yaml"
        path.write_text(text)
        return str(path)

    return write


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------


def test_check_prints_the_resolved_stack(fakes, capsys, stack_file):
    path = stack_file("dtype: float32\nscheduler: {max_num_seqs: 3}\n")
    code, out, err = run(capsys, "check", path, "--skip-model")
    assert code == 0 and err == ""
    assert "ROLE" in out and "COMPONENT" in out and "DISTRIBUTION" in out
    sched_row = next(line for line in out.splitlines() if line.startswith("scheduler"))
    assert "continuous" in sched_row and "lmstack-fake" in sched_row and "max_num_seqs=3" in sched_row
    assert "float32" in out
    assert out.rstrip().endswith("no weights were loaded")


def test_check_json(fakes, capsys, stack_file):
    code, out, _ = run(capsys, "check", stack_file("seed: 7\n"), "--skip-model", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["seed"] == 7
    assert data["components"]["attention_prefill"]["name"] == "torch"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("scheduler: {max_num_seqz: 3}\n", "error: scheduler.max_num_seqz: unknown key"),
        ("server: {port: high}\n", "error: server.port: expected int, got str"),
        ("scheduler: {name: fair}\n", "error: scheduler.name: unknown scheduler 'fair'"),
        ("attention: gpu-only\n", "prefill kernel 'gpu-only' (lmstack-fake 2.0) runs on cuda only"),
        ("model: x\nscheduler: [\n", "invalid YAML"),
        ("cache: {name: prefix}\n", "error: cache.name: unknown cache 'prefix'"),
    ],
)
def test_check_errors_are_one_line(fakes, capsys, stack_file, text, fragment):
    line = assert_one_line_error(*run(capsys, "check", stack_file(text), "--skip-model"))
    assert fragment in line


def test_check_missing_file(fakes, capsys, tmp_path):
    line = assert_one_line_error(*run(capsys, "check", str(tmp_path / "absent.yaml")))
    assert "stack file not found" in line


def test_check_reads_the_model_metadata(capsys, stack_file, monkeypatch):
    monkeypatch.setenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", "1")
    from lmstack.errors import ConfigError
    from lmstack.model.source import resolve_model_path

    try:
        resolve_model_path("smollm2-135m-instruct")
    except ConfigError as e:
        pytest.skip(str(e))
    code, out, err = run(capsys, "check", stack_file("model: smollm2-135m-instruct\n"))
    assert code == 0, err
    assert "30 layers" in out and "head_dim 64" in out
    assert "fits the model" in out


def test_check_unknown_model_is_one_line(capsys, stack_file, monkeypatch):
    monkeypatch.setenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", "1")
    line = assert_one_line_error(*run(capsys, "check", stack_file("model: /no/such/model.gguf\n")))
    assert "model.gguf" in line


# ---------------------------------------------------------------------------------------------
# plugins
# ---------------------------------------------------------------------------------------------


def test_plugins_table(fakes, capsys):
    code, out, _ = run(capsys, "plugins")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["KIND", "NAME", "DISTRIBUTION", "VERSION", "OPTIONS", "(DEFAULT)"]
    gpu = next(r for r in rows if "gpu-only" in r)
    assert gpu.split() == ["attention", "gpu-only", "lmstack-fake", "2.0", "-"]  # takes no options
    sched = next(r for r in rows if r.startswith("scheduler"))
    assert sched.split()[4] == "max_num_seqs=8"
    # The API range and capabilities are in `lmstack plugins gpu-only` (tests/test_plugins_help.py).


def test_plugins_json(fakes, capsys):
    code, out, _ = run(capsys, "plugins", "--json")
    assert code == 0
    rows = json.loads(out)
    assert {(r["kind"], r["name"]) for r in rows} >= {("scheduler", "continuous"), ("attention", "gpu-only")}
    gpu = next(r for r in rows if r["name"] == "gpu-only")
    assert gpu["distribution"] == "lmstack-fake" and gpu["version"] == "2.0"
    assert gpu["capabilities"] == {"devices": ["cuda"]}
    assert gpu["api"] == ">=1.0,<2"


def test_plugins_with_the_builtins(capsys, monkeypatch):
    monkeypatch.setenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", "1")
    code, out, _ = run(capsys, "plugins", "--json")
    assert code == 0
    rows = json.loads(out)
    assert {r["kind"] for r in rows} == {
        "scheduler",
        "allocator",
        "attention",
        "quantizer",
        "speculator",
        "parallel",
        "cache",
    }
    assert all(r["distribution"] == "lmstack" for r in rows)


# ---------------------------------------------------------------------------------------------
# generate (the engine part is cli_generate's; here only the argument plumbing)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_generate(monkeypatch):
    calls = []
    module = types.ModuleType("lmstack.commands.generate")

    def run_(args):
        calls.append(args)
        if args.prompt == "interrupt me":
            raise KeyboardInterrupt
        return 0

    module.run = run_
    monkeypatch.setitem(sys.modules, "lmstack.commands.generate", module)
    monkeypatch.setattr("lmstack.commands.generate", module, raising=False)
    return calls


def test_generate_passes_its_arguments(fake_generate, capsys):
    code, _, _ = run(
        capsys,
        "generate",
        "--stack",
        "s.yaml",
        "--max-tokens",
        "12",
        "--temperature",
        "0.7",
        "--seed",
        "7",
        "Hello there",
    )
    assert code == 0
    (args,) = fake_generate
    assert (args.stack, args.max_tokens, args.temperature, args.seed, args.prompt) == (
        "s.yaml",
        12,
        0.7,
        7,
        "Hello there",
    )


def test_generate_defaults(fake_generate, capsys):
    run(capsys, "generate", "--stack", "s.yaml", "Hi")
    (args,) = fake_generate
    assert args.temperature == 0.0 and args.max_tokens >= 1 and args.seed is None


def test_ctrl_c_exits_130_quietly(fake_generate, capsys):
    code, out, err = run(capsys, "generate", "--stack", "s.yaml", "interrupt me")
    assert code == 130 and "Traceback" not in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--max-tokens", "0", "--stack", "s.yaml", "x"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


# ---------------------------------------------------------------------------------------------
# As a process
# ---------------------------------------------------------------------------------------------


def test_the_command_as_a_process(stack_file):
    env = {**os.environ, "LMSTACK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmstack.cli",
            "check",
            stack_file("allocator: {name: paged, blok_size: 8}\n"),
            "--skip-model",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: allocator.blok_size: unknown key; allocator 'paged' (lmstack) accepts: block_size, "
        "kv_cache_memory, num_blocks"
    ]


# ---------------------------------------------------------------------------------------------
# Commands from plugins (lmstack_register_commands)
# ---------------------------------------------------------------------------------------------


class _HelloCommand:
    @staticmethod
    def _hello(args):
        print(f"hello {args.who}")
        return 3

    @hookimpl
    def lmstack_register_commands(self, subparsers):
        p = subparsers.add_parser("hello", help="say hello")
        p.add_argument("who")
        p.set_defaults(handler=self._hello)


def test_a_plugin_adds_a_command(monkeypatch, capsys):
    pm = make_plugin_manager(autoload=False, extra_plugins=[_HelloCommand()])
    monkeypatch.setattr(cli, "_plugin_manager", lambda: pm)
    code, out, err = run(capsys, "hello", "world")
    assert (code, out, err) == (3, "hello world\n", "")


def test_serve_bench_quantize_and_eval_come_from_their_distributions():
    dists = ["lmstack_api.plugin", "lmstack_bench.plugin", "lmstack_calibrate.plugin"]
    parser = cli.build_parser(make_plugin_manager(autoload=False, extra_plugins=dists))
    assert {"check", "plugins", "generate", "serve", "bench", "quantize", "eval"} <= cli._commands(parser)
    assert cli._commands(cli.build_parser(make_plugin_manager(autoload=False))) == {
        "check",
        "plugins",
        "generate",
        "plan",
        "new-plugin",
    }
    args = parser.parse_args(["bench", "serve", "--help"])
    assert args.bench_args == ["serve", "--help"]


def test_a_broken_plugin_leaves_the_core_commands_working(monkeypatch, capsys):
    def broken():
        raise ResolutionError("plugin 'x' (x-dist 1.0) failed to import: ImportError: nope")

    monkeypatch.setattr(cli, "_plugin_manager", broken)
    code, out, err = run(capsys, "serve", "stack.yaml")
    assert code == 2
    assert err.strip() == (
        "error: unknown command 'serve': plugins could not be loaded (plugin 'x' (x-dist 1.0) failed "
        "to import: ImportError: nope)"
    )
