"""A command line that starts from the model: MODEL_OR_STACK (a model alone is served with every
default; a .gguf file or a model folder is never read as YAML), `--set KEY.PATH=VALUE` on every
command that takes a stack, `--stack` as the old spelling, `LLM(model=...)`, `lmstack bench
--help`, and the example stacks whose model must be made first naming the command that makes it."""

from __future__ import annotations

import json
import shlex
import sys
import types
from pathlib import Path

import pytest
import yaml

from lmstack import cli
from lmstack.engine.llm import LLM
from lmstack.errors import ConfigError
from lmstack.model.source import MADE_BY, resolve_model_path
from lmstack.sampling_params import SamplingParams
from lmstack.stack.config import load_stack
from lmstack.stack.overrides import apply_overrides, parse_overrides

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_STACKS = sorted((ROOT / "examples" / "stacks").glob("*.yaml"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse: --help, usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0].removeprefix("error: ")


@pytest.fixture
def calls(monkeypatch):
    """The handlers of generate, serve, eval perplexity and quantize, replaced by recorders of
    the arguments they get."""
    recorded: dict[str, object] = {}

    def recorder(name):
        def record(args):
            recorded[name] = args
            return 0

        return record

    generate = types.ModuleType("lmstack.commands.generate")
    generate.run = recorder("generate")
    monkeypatch.setitem(sys.modules, "lmstack.commands.generate", generate)
    monkeypatch.setattr("lmstack.commands.generate", generate, raising=False)

    def serve(stack, host=None, port=None, log_level="info", overrides=()):
        recorded["serve"] = (stack, host, port, list(overrides))
        return 0

    monkeypatch.setattr("lmstack_api.server.serve", serve)
    monkeypatch.setattr("lmstack_calibrate.perplexity.run_cli", recorder("eval"))
    monkeypatch.setattr("lmstack_calibrate.quantize.run_cli", recorder("quantize"))
    return recorded


# ---------------------------------------------------------------------------------------------
# One way to pass the stack
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["check"], ["generate"], ["serve"], ["eval", "perplexity"], ["quantize"]],
    ids=lambda c: " ".join(c),
)
def test_every_command_takes_model_or_stack_and_set(capsys, command):
    code, out, _ = run(capsys, *command, "--help")
    assert code == 0
    assert "MODEL_OR_STACK" in out and "--set KEY.PATH=VALUE" in out


def test_the_stack_is_positional_and_the_old_option_still_works(capsys, calls):
    assert run(capsys, "generate", "org/name", "hi", "--set", "dtype=float32")[0] == 0
    args = calls["generate"]
    assert (args.stack, args.prompt, args.overrides) == ("org/name", "hi", ["dtype=float32"])
    assert run(capsys, "generate", "--stack", "s.yaml", "hi")[0] == 0
    assert (calls["generate"].stack, calls["generate"].prompt) == ("s.yaml", "hi")

    assert run(capsys, "serve", "org/name", "--port", "0", "--set", "a.b=1", "--set", "c=2")[0] == 0
    assert calls["serve"] == ("org/name", None, 0, ["a.b=1", "c=2"])

    for command in (["eval", "perplexity", "--text", "t.txt"], ["quantize", "--method", "awq", "--out", "o"]):
        key = command[0]
        assert run(capsys, *command, "m.gguf", "--set", "dtype=float32")[0] == 0
        assert (calls[key].stack, calls[key].overrides) == ("m.gguf", ["dtype=float32"])
        assert run(capsys, *command, "--stack", "s.yaml")[0] == 0
        assert calls[key].stack == "s.yaml"


def test_the_stack_given_twice_or_not_at_all_is_one_line(capsys, calls):
    line = one_line_error(
        *run(capsys, "quantize", "a.yaml", "--stack", "b.yaml", "--method", "x", "--out", "o")[::2]
    )
    assert "give the stack once" in line
    line = one_line_error(*run(capsys, "generate", "hi")[::2])
    assert "name a model or a stack file" in line


# ---------------------------------------------------------------------------------------------
# A model where a stack is expected
# ---------------------------------------------------------------------------------------------


def test_a_model_alone_is_a_stack_of_every_default(tmp_path, tiny_model_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00 [not: yaml")  # never decoded as YAML
    defaults = load_stack({})
    for model in (str(gguf), str(tiny_model_path), "smollm2-135m-instruct", "org/name", "org/name:Q4_K_M"):
        assert load_stack(model) == load_stack({"model": model}), model
        assert load_stack(model).scheduler == defaults.scheduler


def test_a_folder_without_config_and_a_missing_stack_file_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is a directory \\(a model folder needs config.json\\)"):
        load_stack(tmp_path)
    with pytest.raises(ConfigError, match="^stack file not found: nothing.yaml$"):
        load_stack("nothing.yaml")


def test_check_a_model_folder_with_set(capsys, tiny_model_path):
    code, out, err = run(
        capsys,
        "check",
        str(tiny_model_path),
        "--set",
        "dtype=float32",
        "--set",
        "scheduler.max_num_seqs=3",
        "--json",
    )
    assert code == 0, err
    described = json.loads(out)
    assert described["model"] == str(tiny_model_path)
    assert described["dtype"] == "float32"
    assert described["components"]["scheduler"]["options"]["max_num_seqs"] == 3


# ---------------------------------------------------------------------------------------------
# --set
# ---------------------------------------------------------------------------------------------


def test_set_values_are_yaml_and_short_sections_widen():
    overrides = parse_overrides(
        [
            "scheduler.max_num_seqs=8",
            "quant.kv_cache=float16",
            "attention.decode=torch",
            "server.api_keys=[a, b]",
        ]
    )
    assert overrides["scheduler.max_num_seqs"] == 8 and overrides["server.api_keys"] == ["a", "b"]
    stack = {"scheduler": "continuous", "quant": "gguf", "attention": "auto"}
    assert apply_overrides(stack, overrides) == {
        "scheduler": {"name": "continuous", "max_num_seqs": 8},
        "quant": {"weights": "gguf", "kv_cache": "float16"},
        "attention": {"prefill": "auto", "decode": "torch"},
        "server": {"api_keys": ["a", "b"]},
    }
    assert stack == {"scheduler": "continuous", "quant": "gguf", "attention": "auto"}  # not changed


@pytest.mark.parametrize("item", ["dtype", "=x", "scheduler..x=1", "x=[unclosed"])
def test_a_malformed_set_is_one_line(capsys, tiny_model_path, item):
    line = one_line_error(*run(capsys, "check", str(tiny_model_path), "--skip-model", "--set", item)[::2])
    assert line.startswith(f"--set {item!r}: ")


def test_an_unknown_key_set_is_the_same_error_as_in_a_stack_file(capsys, tmp_path, tiny_model_path):
    stack = tmp_path / "stack.yaml"
    for key, value in [("scheduler.max_num_seqz", "3"), ("dtype", "float33"), ("server.prot", "1")]:
        section, _, leaf = key.partition(".")
        stack.write_text(
            yaml.safe_dump({"model": str(tiny_model_path), section: {leaf: value} if leaf else value})
        )
        from_file = one_line_error(*run(capsys, "check", str(stack), "--skip-model")[::2])
        from_set = one_line_error(
            *run(capsys, "check", str(tiny_model_path), "--skip-model", "--set", f"{key}={value}")[::2]
        )
        assert from_set == from_file, key


def test_generate_with_set_reaches_the_engine(capsys, tmp_path, tiny_model_path):
    stack = tmp_path / "stack.yaml"
    stack.write_text(yaml.safe_dump({"model": str(tiny_model_path), "dtype": "bfloat16"}))
    # The old spelling, end to end (the new one is the same parser's positional).
    code, out, err = run(
        capsys, "generate", "--stack", str(stack), "the cat", "--max-tokens", "3", "--set", "dtype=float32"
    )
    assert code == 0, err
    llm = LLM(str(tiny_model_path), dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    (expected,) = llm.chat([{"role": "user", "content": "the cat"}], greedy)
    assert out == expected.outputs[0].text + "\n"


# ---------------------------------------------------------------------------------------------
# LLM(model=...)
# ---------------------------------------------------------------------------------------------


def test_llm_takes_a_model_and_section_keywords(tiny_model_path):
    llm = LLM(
        model=str(tiny_model_path), dtype="float32", scheduler={"name": "continuous", "max_num_seqs": 3}
    )
    config = llm.engine.stack.config
    assert (config.model, config.dtype, config.scheduler["max_num_seqs"]) == (
        str(tiny_model_path),
        "float32",
        3,
    )
    same = LLM({"model": str(tiny_model_path), "dtype": "float32"})
    params = SamplingParams(temperature=0.0, max_tokens=5)
    assert (
        llm.generate("the cat", params)[0].outputs[0].token_ids
        == same.generate("the cat", params)[0].outputs[0].token_ids
    )


def test_llm_keywords_override_a_stack_file(tmp_path, tiny_model_path):
    stack = tmp_path / "stack.yaml"
    stack.write_text(yaml.safe_dump({"model": "elsewhere/nothing", "dtype": "bfloat16", "seed": 3}))
    config = LLM(str(stack), model=str(tiny_model_path), dtype="float32").engine.stack.config
    assert (config.model, config.dtype, config.seed) == (str(tiny_model_path), "float32", 3)


# ---------------------------------------------------------------------------------------------
# bench, and the example stacks' models
# ---------------------------------------------------------------------------------------------


def test_bench_help(capsys):
    code, out, _ = run(capsys, "bench", "--help")
    assert code == 0 and out.startswith("usage: lmstack bench") and "serve" in out and "plot" in out
    code, out, _ = run(capsys, "bench", "serve", "--help")
    assert code == 0 and "--tokenizer" in out


@pytest.mark.parametrize("path", EXAMPLE_STACKS, ids=[p.stem for p in EXAMPLE_STACKS])
def test_an_example_stack_whose_model_is_missing_names_the_command_that_makes_it(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the stacks name models/... relative to the repository
    model = load_stack(path).model
    if model in MADE_BY and Path(model).exists():
        pytest.skip(f"{model} was made on this machine")
    if model not in MADE_BY:  # a model that needs no making: it resolves, or names its package
        try:
            resolve_model_path(model)
        except ConfigError as exc:
            assert "pip install" in str(exc), exc
        return
    with pytest.raises(ConfigError) as exc:
        resolve_model_path(model)
    command = MADE_BY[model]
    assert str(exc.value) == f"model {model!r}: no such file or folder; make it with `{command}`"
    argv = shlex.split(command)
    if argv[0] == "lmstack":  # the command is one this lmstack takes, from a stack that is there
        args = cli.build_parser(cli._plugin_manager()).parse_args(argv[1:])
        assert load_stack(args.stack).model == "smollm2-135m-instruct"
