"""`lmstack plugins` teaches: every option with its type, default, allowed values and one-line
description (from ``msgspec.Meta(description=...)``), a table within 100 columns, one component in
full with `lmstack plugins NAME`, the same details in ``--json``."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import pytest

from lmstack import cli
from lmstack.commands import plugins as plugins_command
from lmstack.registry import Component, Registry, StackSection, describe_options
from lmstack.stack.plugins import build_registry, make_plugin_manager

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------
# Every installed option is described
# ---------------------------------------------------------------------------------------------


def in_tree_distributions() -> set[str]:
    """The distributions of this repository (besides the core) that declare options: a component
    with an ``options_type`` or a stack section. One that is not loaded fails the test below
    rather than passing it unchecked."""
    found = set()
    pyprojects = [*ROOT.glob("*/pyproject.toml"), *ROOT.glob("plugins/*/*/pyproject.toml")]
    for pyproject in [*pyprojects, *ROOT.glob("examples/plugins/*/pyproject.toml")]:
        sources = [p for p in pyproject.parent.rglob("*.py") if "tests" not in p.parts]
        if any("options_type=" in p.read_text() or "StackSection(" in p.read_text() for p in sources):
            found.add(tomllib.loads(pyproject.read_text())["project"]["name"])
    return found - {"lmstack"}


@pytest.fixture
def installed(monkeypatch) -> Registry:
    """Every installed plugin (this repository's are installed editable), and the test-only
    `replicas` layout, which is not an entry point."""
    monkeypatch.delenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("LMSTACK_PLUGINS", raising=False)
    pm = make_plugin_manager(autoload=True, extra_plugins=["lmstack.testing.replicas"])
    return build_registry(pm)


def test_every_option_of_every_installed_component_and_section_is_described(installed):
    items = [*installed.all(), *installed.sections.values()]
    loaded = {i.distribution for i in items}
    assert in_tree_distributions() <= loaded, installed.problems  # a plugin missing is no pass
    assert "server" in installed.sections

    undescribed, too_long = [], []
    for item in items:
        full = plugins_command.full_view(item)
        row = plugins_command.describe(item)
        for option, shown in zip(item.option_docs(), row["options"], strict=True):
            where = (
                f"{item.distribution}: {getattr(item, 'kind', 'section')} {item.name!r} option {option.name}"
            )
            if not option.description.strip():
                undescribed.append(where)
            elif "\n" in option.description or len(option.description) > WIDTH:
                too_long.append(where)
            assert option.type, where
            assert set(shown) >= {"name", "type", "default", "required", "choices", "bounds", "description"}
            head = f"{option.name}: {option.type}" + (
                " (required)" if option.required else f" = {plugins_command._value(option.default)}"
            )
            assert head in full, (where, full)
            assert option.description in full.replace("\n      ", " "), where
    assert not undescribed, (
        "options without a description; declare each as "
        '`name: Annotated[T, msgspec.Meta(description="what it does, in what unit")] = default`: '
        + "; ".join(undescribed)
    )
    assert not too_long, "descriptions must be one line of at most 100 characters: " + "; ".join(too_long)


# ---------------------------------------------------------------------------------------------
# Reading the options Struct
# ---------------------------------------------------------------------------------------------


class Limits(msgspec.Struct, forbid_unknown_fields=True):
    per_minute: Annotated[int, msgspec.Meta(ge=1, description="requests per minute")] | None = None


class TileOptions(msgspec.Struct, forbid_unknown_fields=True):
    path: Annotated[str, msgspec.Meta(description="where the tiles live")]
    tile: Annotated[int, msgspec.Meta(ge=16, le=256, description="keys per tile")] = 64
    mode: Annotated[Literal["fast", "exact"], msgspec.Meta(description="which kernel")] = "fast"
    bar: Annotated[float | Literal["auto"], msgspec.Meta(description="cut-off, or auto")] = 0.5
    names: Annotated[list[str], msgspec.Meta(description="extra names")] = msgspec.field(default_factory=list)
    bare: int = 3  # no description: rendered as such, and the installed-plugins test refuses it
    limits: Limits = msgspec.field(default_factory=Limits)


def test_option_docs_read_type_default_choices_bounds_and_description():
    docs = {d.name: d for d in describe_options(TileOptions)}
    assert list(docs) == ["path", "tile", "mode", "bar", "names", "bare", "limits.per_minute"]
    assert (docs["path"].type, docs["path"].required) == ("str", True)
    assert docs["path"].description == "where the tiles live"
    tile = docs["tile"]
    assert (tile.type, tile.default, dict(tile.bounds), tile.description) == (
        "int",
        64,
        {"ge": 16, "le": 256},
        "keys per tile",
    )
    assert (docs["mode"].type, set(docs["mode"].choices), docs["mode"].default) == (
        "str",
        {"fast", "exact"},
        "fast",
    )
    # A Literal beside another type is spelled out in the type: any float, or 'auto'.
    assert (docs["bar"].type, docs["bar"].choices) == ("float | 'auto'", ("auto",))
    assert (docs["names"].type, docs["names"].default) == ("list[str]", [])
    assert docs["bare"].description == ""
    nested = docs["limits.per_minute"]
    assert (nested.type, nested.default, dict(nested.bounds), nested.description) == (
        "int | null",
        None,
        {"ge": 1},
        "requests per minute",
    )


# ---------------------------------------------------------------------------------------------
# The CLI, on a registry of fakes
# ---------------------------------------------------------------------------------------------


class SchedOptions(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, description="the most sequences at once")] = 8
    policy: Annotated[Literal["fifo", "shortest"], msgspec.Meta(description="admission order")] = "fifo"


class SectionOptions(msgspec.Struct, forbid_unknown_fields=True):
    host: Annotated[str, msgspec.Meta(description="address to bind")] = "127.0.0.1"


def fake_registry() -> Registry:
    reg = Registry()
    reg.add(
        Component(
            name="fair",
            kind="scheduler",
            factory=lambda o, c: None,
            options_type=SchedOptions,
            capabilities={"chunked_prefill": True, "devices": ("cpu", "cuda")},
            description="Fair-share admission.",
            api=">=1.4,<2",
        ),
        distribution="lmstack-fair",
        version="1.2.3",
    )
    reg.add(
        Component(name="fair", kind="cache", factory=lambda o, c: None, description="A cache named alike."),
        distribution="lmstack-fair",
        version="1.2.3",
    )
    # Long names and many options: the table still fits.
    reg.add(
        Component(
            name="a-component-with-a-rather-long-name",
            kind="attention",
            factory=lambda o, c: None,
            options_type=TileOptions,
            capabilities={"devices": ("cpu",)},
        ),
        distribution="lmstack-a-distribution-with-an-even-longer-name",
        version="10.20.30.dev4",
    )
    reg.add_section(
        StackSection("web", SectionOptions, description="the HTTP side"),
        distribution="lmstack-web",
        version="0.3",
    )
    return reg


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setattr("lmstack.stack.plugins.default_registry", fake_registry)


def test_the_table_fits_100_columns(fakes, capsys):
    code, out, _ = run(capsys, "plugins")
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= WIDTH, out
    assert lines[0].split() == ["KIND", "NAME", "DISTRIBUTION", "VERSION", "OPTIONS", "(DEFAULT)"]
    # Wrapped, not cut: every option with its default is there.
    text = " ".join(out.split())
    for piece in ("max_num_seqs=8", "policy=fifo", "path (required)", "tile=64", "bar=0.5", "names=[]"):
        assert piece in text
    assert "STACK SECTION" in out and "the HTTP side" in out
    assert "lmstack plugins NAME" in text


def test_the_table_of_everything_installed_fits_100_columns(installed, monkeypatch, capsys):
    monkeypatch.setattr("lmstack.stack.plugins.default_registry", lambda: installed)
    code, out, _ = run(capsys, "plugins")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= WIDTH, out


def test_one_component_in_full(fakes, capsys):
    code, out, _ = run(capsys, "plugins", "a-component-with-a-rather-long-name")
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert " ".join(out.split()).startswith(
        "attention 'a-component-with-a-rather-long-name' "
        "(lmstack-a-distribution-with-an-even-longer-name 10.20.30.dev4)"
    )
    assert "  capabilities  devices=[cpu]" in lines
    assert "  plugin API    not declared (any)" in lines
    text = "\n".join(lines)
    for expected in (
        "  path: str (required)\n      where the tiles live",
        "  tile: int = 64 (>= 16, <= 256)\n      keys per tile",
        "  mode: str = fast (one of: exact, fast)\n      which kernel",
        "  bar: float | 'auto' = 0.5\n      cut-off, or auto",
        "  names: list[str] = []\n      extra names",
        "  bare: int = 3\n      (no description)",
        "  limits.per_minute: int | null = null (>= 1)\n      requests per minute",
    ):
        assert expected in text


def test_a_name_shared_by_two_kinds_shows_both_and_a_section_shows_its_keys(fakes, capsys):
    code, out, _ = run(capsys, "plugins", "fair")
    assert code == 0
    assert out.startswith("scheduler 'fair' (lmstack-fair 1.2.3)\n  Fair-share admission.\n")
    assert "  plugin API    >=1.4,<2" in out
    assert "  stack file    scheduler: {name: fair, max_num_seqs: 8}" in out
    assert "  max_num_seqs: int = 8 (>= 1)\n      the most sequences at once" in out
    cache = out.index("\ncache 'fair' (lmstack-fair 1.2.3)\n  A cache named alike.")
    assert out.index("max_num_seqs") < cache and out.rstrip().endswith("options: none")

    code, out, _ = run(capsys, "plugins", "web")
    assert code == 0
    assert out.splitlines()[0] == "stack section 'web' (lmstack-web 0.3)"
    assert "  stack file  web: {host: 127.0.0.1}" in out
    assert "  host: str = 127.0.0.1\n      address to bind" in out


def test_json_carries_every_option_detail(fakes, capsys):
    code, out, _ = run(capsys, "plugins", "--json")
    assert code == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(out)}
    assert set(rows) == {
        ("scheduler", "fair"),
        ("cache", "fair"),
        ("attention", "a-component-with-a-rather-long-name"),
        ("section", "web"),
    }
    fair = rows["scheduler", "fair"]
    assert (fair["distribution"], fair["version"], fair["api"]) == ("lmstack-fair", "1.2.3", ">=1.4,<2")
    assert fair["capabilities"] == {"chunked_prefill": True, "devices": ["cpu", "cuda"]}
    assert fair["options"] == [
        {
            "name": "max_num_seqs",
            "type": "int",
            "default": 8,
            "required": False,
            "choices": [],
            "bounds": {"ge": 1},
            "description": "the most sequences at once",
        },
        {
            "name": "policy",
            "type": "str",
            "default": "fifo",
            "required": False,
            "choices": ["fifo", "shortest"],
            "bounds": {},
            "description": "admission order",
        },
    ]
    assert rows["cache", "fair"]["options"] == []
    assert [o["name"] for o in rows["section", "web"]["options"]] == ["host"]
    long = {o["name"]: o for o in rows["attention", "a-component-with-a-rather-long-name"]["options"]}
    assert long["path"]["required"] is True and long["bar"]["type"] == "float | 'auto'"

    # With a name: only its rows.
    code, out, _ = run(capsys, "plugins", "fair", "--json")
    assert code == 0
    assert [(r["kind"], r["name"]) for r in json.loads(out)] == [("scheduler", "fair"), ("cache", "fair")]


def test_an_unknown_name_is_one_line_with_close_matches(fakes, capsys):
    code, out, err = run(capsys, "plugins", "fiar")
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [
        "error: no installed component or stack section is named 'fiar'; did you mean 'fair'? "
        "(`lmstack plugins` lists them)"
    ]
    code, _, err = run(capsys, "plugins", "nothing-like-it")
    assert code == 2 and "did you mean" not in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "plugins", "--check", "fair")
    assert code == 2 and err.startswith("error: --check lists the problems of every plugin")


def test_builtins_in_full(capsys, monkeypatch):
    monkeypatch.setenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", "1")
    code, out, _ = run(capsys, "plugins", "continuous")
    assert code == 0
    assert out.startswith("scheduler 'continuous' (lmstack ")
    assert "  max_num_seqs: int = 64\n      the most sequences running at once" in out
    assert "chunked_prefill=true" in out  # a capability
    code, out, _ = run(capsys, "plugins", "paged")
    assert "  stack file    allocator: {name: paged, block_size: auto}" in out
    assert (
        "  block_size: int | 'auto' = auto\n      tokens per KV-cache block (1 to 1024); auto: 64 on a CPU"
        in out
    )
    assert "  num_blocks: int | null = null\n" in out
