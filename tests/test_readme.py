"""README.md against what is installed: its size, the `lmstack` commands and options it names
(against their `--help`), the components and options of its stack examples (against `lmstack
plugins --json` and the stack sections plugins declare), its relative links and the benchmark
scripts and example stacks it names. No model is loaded.

Each check is a function from markdown text to a list of problems, so the tests at the end run
every check on the README (no problems) and on a small wrong sample (the problem reported)."""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import yaml

from lmstack import cli
from lmstack.roles import ROLES

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_BYTES = 25_000

# Environment switches that would hide installed plugins (and with them `serve`, `bench`, ...).
PLUGIN_ENV = ("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", "LMSTACK_PLUGINS")


# ---------------------------------------------------------------------------------------------
# Markdown pieces
# ---------------------------------------------------------------------------------------------

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}


def fenced(text: str, languages: set[str]) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in languages]


def inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", FENCE.sub("", text))


def shell_lines(text: str) -> Iterator[str]:
    """Every command line of the shell blocks (continuations joined, comments cut) and every
    inline code span."""
    for body in fenced(text, SHELL_LANGUAGES):
        for line in body.replace("\\\n", " ").splitlines():
            yield re.split(r"\s#", line.removeprefix("$ "), maxsplit=1)[0]
    yield from inline_code(text)


# ---------------------------------------------------------------------------------------------
# The CLI, in process, with every installed plugin
# ---------------------------------------------------------------------------------------------


class Cli:
    """`lmstack ARGS` run in this process; each distinct call once."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, ...], tuple[int, str]] = {}

    def __call__(self, *argv: str) -> tuple[int, str]:
        if argv not in self._cache:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                try:
                    code = cli.main(list(argv))
                except SystemExit as exc:  # argparse's --help and usage errors
                    code = exc.code if isinstance(exc.code, int) else 1
            self._cache[argv] = (code, out.getvalue())
        return self._cache[argv]

    def help(self, chain: list[str]) -> str | None:
        """The help text of `lmstack CHAIN`, or None when CHAIN is not a (sub)command."""
        code, out = self(*chain, "--help")
        usage = " ".join(out.split()[: 2 + len(chain)])  # "usage: lmstack a b"
        return out if code == 0 and usage == " ".join(["usage:", "lmstack", *chain]) else None


def subcommands(help_text: str) -> set[str]:
    """The (sub)commands an argparse help lists under "positional arguments", indented by 4."""
    section = help_text.partition("positional arguments:")[2].partition("\n\n")[0]
    return set(re.findall(r"^ {4}([a-z][\w-]*)", section, re.MULTILINE))


WORD = re.compile(r"[a-z][a-z0-9-]*")
COMMAND = re.compile(r"(?:^|(?<=[\s/]))lmstack\s+([a-z][^|;&]*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def command_problems(text: str, run: Cli) -> list[str]:
    top = run.help([])
    if top is None:
        return ["`lmstack --help` fails"]
    known = subcommands(top)
    problems = []
    for line in shell_lines(text):
        for match in COMMAND.finditer(line):
            tokens = match.group(1).split()
            if tokens[0] not in known:
                problems.append(f"`lmstack {tokens[0]}` is not a command (`lmstack --help`: {sorted(known)})")
                continue
            chain = [tokens[0]]
            help_text = run.help(chain)
            # Descend while the next word is a subcommand (`eval perplexity`, `bench serve`);
            # `lmstack bench` itself has no --help, only its subcommands do.
            for token in tokens[1:]:
                deeper = run.help([*chain, token]) if WORD.fullmatch(token) else None
                if deeper is None:
                    break
                chain.append(token)
                help_text = deeper
            name = " ".join(chain)
            for option in OPTION.findall(match.group(1)):
                if help_text is None:
                    problems.append(f"`lmstack {name}` has no --help to check {option} against")
                elif option != "--help" and not re.search(rf"(?<![\w-]){option}(?![\w-])", help_text):
                    problems.append(f"`lmstack {name}` has no option {option}")
    return problems


# ---------------------------------------------------------------------------------------------
# Stack examples against `lmstack plugins --json`
# ---------------------------------------------------------------------------------------------


def option_names(options: object) -> set[str]:
    """Option names from `lmstack plugins --json`: a list of names, of {name: ...} records, or a
    mapping by name."""
    if isinstance(options, dict):
        return set(options)
    return {o["name"] if isinstance(o, dict) else o for o in options or ()}


def installed_components(run: Cli) -> dict[tuple[str, str], set[str]]:
    code, out = run("plugins", "--json")
    assert code == 0, out
    return {(c["kind"], c["name"]): option_names(c["options"]) for c in json.loads(out)}


SECTION_KIND = {r.section: r.kind for r in ROLES}
NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")  # a component name, not a placeholder such as `...`


def stack_problems(text: str, components: dict[tuple[str, str], set[str]]) -> list[str]:
    """The stack files (```yaml blocks) and stack fragments in inline code (`attention: ...`,
    `{name: X, option: ...}`) name installed components and options those components have."""
    problems = []
    for body in fenced(text, {"yaml"}):
        problems += _check_stack(yaml.safe_load(body), components)
    for span in inline_code(text):
        try:
            value = yaml.safe_load(span)
        except yaml.YAMLError:
            continue  # prose in backticks, not a fragment
        if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in (*SECTION_KIND, "server"):
            problems += _check_stack(value, components)
        elif isinstance(value, dict) and "name" in value:
            name = value["name"]
            kinds = [k for k, n in components if n == name]
            if not kinds:
                problems.append(f"`{span}`: no installed component is named {name!r}")
            elif all(set(value) - {"name"} - components[k, name] for k in kinds):
                problems.append(f"`{span}`: component {name!r} has no such option")
    return problems


def _check_stack(mapping: object, components: dict[tuple[str, str], set[str]]) -> list[str]:
    from lmstack.stack.config import NAMED_SECTIONS, stack_from_mapping
    from lmstack.stack.plugins import default_registry

    if not isinstance(mapping, dict):
        return []
    stack = stack_from_mapping(mapping)
    named = [(s, SECTION_KIND[s], getattr(stack, s)) for s in NAMED_SECTIONS if s in mapping]
    named += [("attention", "attention", c) for c in stack.attention.values() if "attention" in mapping]
    if "quant" in mapping:
        weights = {"name": stack.quant["weights"]} | {
            k: v for k, v in stack.quant.items() if k not in ("weights", "kv_cache")
        }
        named.append(("quant", "quantizer", weights))
    problems = []
    for section, kind, component in named:
        name = component["name"]
        if name == "auto" or not NAME.fullmatch(name):
            continue
        if (kind, name) not in components:
            problems.append(f"{section}: no installed {kind} named {name!r}")
            continue
        unknown = set(component) - {"name"} - components[kind, name]
        if unknown:
            problems.append(f"{section}: {kind} {name!r} has no option {', '.join(sorted(unknown))}")
    declared = default_registry().sections
    for section, value in stack.extra_sections.items():
        if section not in declared:
            problems.append(f"stack section {section!r} is declared by no installed plugin")
            continue
        try:
            msgspec.convert(value, declared[section].type)
        except msgspec.ValidationError as exc:
            problems.append(f"{section}: {exc}")
    return list(dict.fromkeys(problems))  # attention's two phases name the same kernel


# ---------------------------------------------------------------------------------------------
# Links and paths
# ---------------------------------------------------------------------------------------------


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(text: str, root: Path) -> list[str]:
    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", text), re.MULTILINE)}
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        if not path and fragment not in anchors:
            problems.append(f"link #{fragment}: no such heading")
        elif path and not (root / path).exists():
            problems.append(f"link {target}: no such file")
    return problems


def path_problems(text: str, root: Path) -> list[str]:
    """Every `benchmarks/...py` script and `examples/...` path named anywhere, and every stack
    file named by its file name alone (`cpu.yaml`, meaning examples/stacks/cpu.yaml), exists."""
    paths = set(re.findall(r"(?<![\w/.-])((?:benchmarks/[\w./-]+\.py)|(?:examples/[\w./-]*\w))", text))
    paths |= {f"examples/stacks/{n}" for n in re.findall(r"`([\w-]+\.yaml)`", text)}
    return [f"{p}: no such file" for p in sorted(paths) if not (root / p).exists()]


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run() -> Iterator[Cli]:
    with pytest.MonkeyPatch.context() as mp:
        for name in PLUGIN_ENV:
            mp.delenv(name, raising=False)
        yield Cli()


@pytest.fixture(scope="module")
def components(run) -> dict[tuple[str, str], set[str]]:
    return installed_components(run)


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_is_short(readme):
    assert len(readme.encode()) < MAX_BYTES


def test_readme_starts_with_the_two_make_commands(readme):
    first_block = fenced(readme, SHELL_LANGUAGES)[0]
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == ["make serve", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve:", makefile, re.MULTILINE) and re.search(r"^test:", makefile, re.MULTILINE)


def test_every_command_and_option_exists(readme, run):
    assert command_problems(readme, run) == []


def test_every_stack_example_names_installed_components_and_options(readme, components):
    assert stack_problems(readme, components) == []


def test_every_relative_link_and_named_path_exists(readme):
    assert link_problems(readme, ROOT) == []
    assert path_problems(readme, ROOT) == []


def test_the_checks_find_mistakes(run, components):
    """The checks above can fail: each finds a planted mistake."""
    commands = (
        "```sh\nlmstack chek STACK\nlmstack check --jsn STACK\n```\n`lmstack eval perplexity --txt F`\n"
    )
    assert command_problems(commands, run) == [
        f"`lmstack chek` is not a command (`lmstack --help`: {sorted(subcommands(run.help([])))})",
        "`lmstack check` has no option --jsn",
        "`lmstack eval perplexity` has no option --txt",
    ]
    stacks = (
        "```yaml\nscheduler: {name: continuous, max_num_seq: 8}\nattention: flash-atention\n"
        "server: {prot: 80}\n```\n`quant: {weights: gguf, activation: int8}` `{name: ngram, max_gram: 2}`\n"
    )
    problems = stack_problems(stacks, components)
    assert len(problems) == 5, problems
    assert "scheduler: scheduler 'continuous' has no option max_num_seq" in problems
    assert "attention: no installed attention named 'flash-atention'" in problems
    assert any(p.startswith("server: ") and "prot" in p for p in problems)
    assert "quant: quantizer 'gguf' has no option activation" in problems
    assert "`{name: ngram, max_gram: 2}`: component 'ngram' has no such option" in problems
    links = "# Title\n[a](#titel) [b](docs/nothing.md) [c](https://example.com) [d](#title)\n"
    assert link_problems(links, ROOT) == [
        "link #titel: no such heading",
        "link docs/nothing.md: no such file",
    ]
    paths = "run benchmarks/e2e/nothing.py on `nothing.yaml`"
    assert path_problems(paths, ROOT) == [
        "benchmarks/e2e/nothing.py: no such file",
        "examples/stacks/nothing.yaml: no such file",
    ]
