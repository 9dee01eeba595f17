"""Plugin discovery (built-ins, entry points, environment switches) and the registry it fills."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import msgspec
import pytest

import lmstack
from lmstack import cli
from lmstack.errors import ResolutionError
from lmstack.hookspecs import REGISTRATION_HOOKS, hookimpl
from lmstack.plugin_api import PLUGIN_API_VERSION, PUBLIC_API
from lmstack.registry import KINDS, Component, InvalidComponent
from lmstack.stack import plugins
from lmstack.stack.plugins import (
    DEFAULT_PLUGINS,
    UNKNOWN_DISTRIBUTION,
    build_registry,
    default_registry,
    make_plugin_manager,
)


def component(name: str, kind: str, **kw) -> Component:
    return Component(name=name, kind=kind, factory=lambda options, ctx: None, **kw)


class FakeScheduling:
    """A plugin object offering two schedulers and a kernel."""

    @hookimpl
    def lmstack_register_schedulers(self, register):
        register(component("fake-fcfs", "scheduler"))
        register(component("fake-lottery", "scheduler", capabilities={"chunked_prefill": False}))

    @hookimpl
    def lmstack_register_attention(self, register):
        register(component("fake-kernel", "attention", capabilities={"devices": ("cuda",)}))


def fakes_only(*plugins) -> object:
    return build_registry(make_plugin_manager(autoload=False, default_plugins=(), extra_plugins=plugins))


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("LMSTACK_PLUGINS", raising=False)


# ---------------------------------------------------------------------------------------------
# Hook specs
# ---------------------------------------------------------------------------------------------


def test_hookimpl_is_importable_from_the_package():
    assert lmstack.hookimpl is hookimpl


def test_every_kind_has_a_registration_hook():
    pm = make_plugin_manager(autoload=False, default_plugins=())
    assert set(REGISTRATION_HOOKS) == set(KINDS)
    for hook in (
        *REGISTRATION_HOOKS.values(),
        "lmstack_engine_started",
        "lmstack_step_finished",
        "lmstack_request_finished",
    ):
        assert hasattr(pm.hook, hook)


def test_lifecycle_hooks_reach_observers():
    seen = []

    class Observer:
        @hookimpl
        def lmstack_step_finished(self, engine, stats):
            seen.append(("step", engine, stats))

        @hookimpl
        def lmstack_request_finished(self, output):  # a subset of the arguments is fine
            seen.append(("request", output))

    pm = make_plugin_manager(autoload=False, default_plugins=(), extra_plugins=[Observer()])
    pm.hook.lmstack_step_finished(engine="E", stats={"running": 1})
    pm.hook.lmstack_request_finished(engine="E", output="O")
    assert seen == [("step", "E", {"running": 1}), ("request", "O")]


# ---------------------------------------------------------------------------------------------
# Registry and attribution
# ---------------------------------------------------------------------------------------------


def test_fake_plugin_components_are_registered():
    registry = fakes_only(FakeScheduling())
    assert registry.names("scheduler") == ["fake-fcfs", "fake-lottery"]
    assert registry.names("attention") == ["fake-kernel"]
    assert registry.names("allocator") == []
    comp = registry.get("scheduler", "fake-lottery")
    assert comp.capabilities == {"chunked_prefill": False}
    # Registered in code, not from an installed package.
    assert comp.distribution == UNKNOWN_DISTRIBUTION


def test_builtins_are_attributed_to_lmstack(no_env):
    assert DEFAULT_PLUGINS == ("lmstack.components.builtins", "lmstack.commands.new_plugin")
    registry = build_registry(make_plugin_manager(autoload=False))
    expected_version = importlib.metadata.version("lmstack")
    for kind, name in [
        ("scheduler", "continuous"),
        ("allocator", "paged"),
        ("attention", "torch"),
        ("quantizer", "none"),
        ("speculator", "none"),
        ("parallel", "single"),
    ]:
        comp = registry.get(kind, name)
        assert (comp.distribution, comp.version) == ("lmstack", expected_version)


def test_a_component_registered_through_the_wrong_hook_is_an_error():
    class Confused:
        @hookimpl
        def lmstack_register_attention(self, register):
            register(component("sneaky", "scheduler"))

    with pytest.raises(ResolutionError) as info:
        fakes_only(Confused())
    msg = str(info.value)
    assert "Confused" in msg  # names the plugin
    assert "scheduler 'sneaky'" in msg and "lmstack_register_attention" in msg
    assert "lmstack_register_schedulers" in msg  # the way out


def test_registering_something_that_is_not_a_component_is_an_error():
    class Sloppy:
        @hookimpl
        def lmstack_register_allocators(self, register):
            register({"name": "paged"})

    with pytest.raises(ResolutionError, match=r"Sloppy.*passed a dict.*Component"):
        fakes_only(Sloppy())


def test_two_plugins_registering_the_same_name_are_named():
    class Again:
        @hookimpl
        def lmstack_register_schedulers(self, register):
            register(component("fake-fcfs", "scheduler", distribution="lmstack-again"))

    with pytest.raises(ResolutionError, match=r"registered twice.*lmstack-again"):
        fakes_only(FakeScheduling(), Again())


def test_a_failing_registration_hook_is_reported_by_plugin():
    class Broken:
        @hookimpl
        def lmstack_register_speculators(self, register):
            raise KeyError("draft_model")

    with pytest.raises(ResolutionError) as info:
        fakes_only(Broken())
    assert "Broken" in str(info.value) and "lmstack_register_speculators" in str(info.value)
    assert "KeyError" in str(info.value)


def test_a_misspelled_hook_is_reported_with_the_closest_name():
    class Typo:
        @hookimpl
        def lmstack_register_scheduler(self, register):  # missing the final "s"
            pass

    with pytest.raises(ResolutionError) as info:
        make_plugin_manager(autoload=False, default_plugins=(), extra_plugins=[Typo()])
    assert "Typo" in str(info.value)
    assert str(info.value).endswith(
        "implements lmstack_register_scheduler, which lmstack does not define; "
        "did you mean lmstack_register_schedulers?"
    )


def test_a_misnamed_hook_argument_says_what_to_call_it():
    class Reg:
        @hookimpl
        def lmstack_register_schedulers(self, reg):
            reg(component("x", "scheduler"))

    with pytest.raises(ResolutionError) as info:
        make_plugin_manager(autoload=False, default_plugins=(), extra_plugins=[Reg()])
    msg = str(info.value)
    assert "Reg" in msg and "\n" not in msg
    assert msg.endswith(
        "declares argument `reg` in lmstack_register_schedulers, which lmstack does not pass; name it `register`"
    )


# ---------------------------------------------------------------------------------------------
# Components are validated when they are declared
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DataclassOptions:
    block_size: int = 16


class LaxOptions(msgspec.Struct):  # no forbid_unknown_fields
    block_size: int = 16


def test_a_dataclass_options_type_names_the_fix():
    with pytest.raises(InvalidComponent) as info:
        component("dc", "allocator", options_type=DataclassOptions)
    assert str(info.value) == (
        "allocator 'dc': options_type must be a msgspec.Struct "
        "(class DataclassOptions(msgspec.Struct, forbid_unknown_fields=True)); got dataclass DataclassOptions"
    )


def test_an_options_type_must_forbid_unknown_fields():
    with pytest.raises(
        InvalidComponent, match=r"LaxOptions must forbid unknown fields.*forbid_unknown_fields=True"
    ):
        component("lax", "allocator", options_type=LaxOptions)


def test_an_invalid_component_in_a_named_plugin_is_an_error():
    class Sloppy:
        @hookimpl
        def lmstack_register_allocators(self, register):
            register(component("dc", "allocator", options_type=DataclassOptions))

    with pytest.raises(
        ResolutionError,
        match=r"Sloppy.*offers an invalid component in lmstack_register_allocators: allocator 'dc': options_type",
    ):
        fakes_only(Sloppy())


def test_the_api_range_is_checked():
    assert lmstack.PLUGIN_API_VERSION == PLUGIN_API_VERSION == "1.10"
    assert component("ok", "speculator", api=">=1.0,<2").api_mismatch() is None
    assert component("any", "speculator").api_mismatch() is None  # not declared: accepted
    refused = component("x", "speculator", api=">=2.0", distribution="pkg", version="1.2")
    assert refused.api_mismatch() == (
        "speculator 'x' (pkg 1.2) supports lmstack plugin API >=2.0, this lmstack provides 1.10; "
        "upgrade lmstack or install a pkg release for API 1.10"
    )
    with pytest.raises(InvalidComponent, match=r"api='version 2' is not a version range.*'>=1.10,<2'"):
        component("bad", "speculator", api="version 2")


def test_every_public_api_name_imports():
    for module_name, names in PUBLIC_API.items():
        module = importlib.import_module(module_name)
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{module_name} lacks {missing}"
    assert "lmstack.interfaces" in PUBLIC_API and "lmstack.testing" in PUBLIC_API


def test_extra_plugins_may_be_module_names(no_env):
    registry = build_registry(
        make_plugin_manager(autoload=False, default_plugins=(), extra_plugins=["lmstack.components.builtins"])
    )
    assert registry.get("scheduler", "continuous").distribution == "lmstack"


# ---------------------------------------------------------------------------------------------
# Entry points and the environment switches
# ---------------------------------------------------------------------------------------------


class FakeInstall:
    """Installs fake distributions with `lmstack` entry points into a temporary sys.path entry."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.modules: list[str] = []
        self.tag = uuid.uuid4().hex[:8]  # fresh module names: nothing cached from other tests

    def add(self, dist: str, entry_point: str, source: str, version: str = "1.2.3") -> str:
        module = f"{dist.replace('-', '_')}_{self.tag}"
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[lmstack]\n{entry_point} = {module}\n")
        self.modules.append(module)
        return module

    def activate(self) -> None:
        self.monkeypatch.syspath_prepend(str(self.root))

    def cleanup(self) -> None:
        for module in self.modules:
            sys.modules.pop(module, None)


GOOD_PLUGIN = """
from lmstack.hookspecs import hookimpl
from lmstack.registry import Component

@hookimpl
def lmstack_register_speculators(register):
    register(Component(name="fake-ngram", kind="speculator", factory=lambda options, ctx: None))
"""

OTHER_PLUGIN = """
from lmstack.hookspecs import hookimpl
from lmstack.registry import Component

@hookimpl
def lmstack_register_quantizers(register):
    register(Component(name="fake-fp8", kind="quantizer", factory=lambda options, ctx: None))
"""

BROKEN_PLUGIN = """
import lmstack_this_dependency_is_not_installed
"""


@pytest.fixture
def installed(tmp_path, monkeypatch, no_env):
    fake = FakeInstall(tmp_path, monkeypatch)
    fake.add("lmstack-fake-ngram", "fake_ngram", GOOD_PLUGIN, version="0.4.2")
    fake.add("lmstack-fake-fp8", "fake_fp8", OTHER_PLUGIN)
    yield fake
    fake.cleanup()


def test_entry_point_plugins_are_attributed_to_their_distribution(installed, monkeypatch):
    installed.activate()
    monkeypatch.setenv("LMSTACK_PLUGINS", "fake_ngram,fake_fp8")
    registry = build_registry(make_plugin_manager())
    ngram = registry.get("speculator", "fake-ngram")
    assert (ngram.distribution, ngram.version) == ("lmstack-fake-ngram", "0.4.2")
    assert registry.get("quantizer", "fake-fp8").distribution == "lmstack-fake-fp8"
    # The built-ins are still there, next to the plugins.
    assert registry.get("speculator", "none").distribution == "lmstack"


def test_allow_list_loads_only_the_named_entry_points(installed, monkeypatch):
    installed.activate()
    monkeypatch.setenv("LMSTACK_PLUGINS", " fake_fp8 ")
    registry = build_registry(make_plugin_manager())
    assert "fake-fp8" in registry.names("quantizer")
    assert "fake-ngram" not in registry.names("speculator")


def test_allow_list_naming_a_missing_entry_point_is_an_error(installed, monkeypatch):
    installed.activate()
    monkeypatch.setenv("LMSTACK_PLUGINS", "fake_fp8,not_installed")
    with pytest.raises(ResolutionError, match=r"LMSTACK_PLUGINS names not_installed.*fake_fp8"):
        make_plugin_manager()


def test_disabling_autoload_skips_entry_points(installed, monkeypatch):
    installed.activate()
    monkeypatch.setenv("LMSTACK_PLUGINS", "fake_ngram")
    monkeypatch.setenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = default_registry()
    assert registry.names("speculator") == ["none"]
    # The keyword overrides the environment.
    registry = build_registry(make_plugin_manager(autoload=True))
    assert "fake-ngram" in registry.names("speculator")


def test_autoload_keyword_false_overrides_the_environment(installed, monkeypatch):
    installed.activate()
    monkeypatch.setenv("LMSTACK_PLUGINS", "fake_ngram")
    assert "fake-ngram" in default_registry().names("speculator")
    assert "fake-ngram" not in build_registry(make_plugin_manager(autoload=False)).names("speculator")


def test_a_plugin_that_fails_to_import_is_one_clear_line(installed, monkeypatch):
    installed.add("lmstack-broken", "broken", BROKEN_PLUGIN, version="9.9")
    installed.activate()
    monkeypatch.setenv("LMSTACK_PLUGINS", "fake_ngram,broken")
    with pytest.raises(ResolutionError) as info:
        make_plugin_manager()
    msg = str(info.value)
    assert "\n" not in msg
    assert "plugin 'broken'" in msg and "lmstack-broken 9.9" in msg
    assert "ModuleNotFoundError" in msg and "lmstack_this_dependency_is_not_installed" in msg
    assert "LMSTACK_PLUGINS" in msg  # the way out

    # Leaving it out of the allow-list gets the rest working.
    monkeypatch.setenv("LMSTACK_PLUGINS", "fake_ngram")
    assert "fake-ngram" in default_registry().names("speculator")


# ---------------------------------------------------------------------------------------------
# A broken autoloaded plugin is skipped, with one warning, and kept in registry.problems
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def autoloaded(installed, monkeypatch):
    """No allow-list, and only the fake distributions installed: the way a user's machine loads
    every plugin it has, without depending on what this environment has installed."""
    original = importlib.metadata.distributions
    monkeypatch.setattr(
        importlib.metadata, "distributions", lambda **kw: original(path=[str(installed.root)])
    )
    monkeypatch.setattr(plugins, "_WARNED", set())  # each test sees its own warnings
    installed.activate()
    return installed


def plugin_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "lmstack.stack.plugins" and r.levelno == logging.WARNING
    ]


def test_a_plugin_that_fails_to_import_is_skipped_with_one_warning(autoloaded, caplog):
    autoloaded.add("lmstack-broken", "broken", BROKEN_PLUGIN, version="9.9")
    with caplog.at_level(logging.WARNING, logger="lmstack.stack.plugins"):
        registry = default_registry()
    # The good plugins work.
    assert "fake-ngram" in registry.names("speculator") and "fake-fp8" in registry.names("quantizer")
    (problem,) = registry.problems
    assert (problem.plugin, problem.distribution, problem.version, problem.skipped) == (
        "broken",
        "lmstack-broken",
        "9.9",
        True,
    )
    assert (
        "ModuleNotFoundError" in problem.message
        and "lmstack_this_dependency_is_not_installed" in problem.message
    )
    (line,) = plugin_warnings(caplog)
    assert "\n" not in line
    assert line.startswith("plugin 'broken' (lmstack-broken 9.9) failed to import")
    assert "skipped" in line and "lmstack plugins --check" in line

    # Selecting a name no plugin provides mentions the broken one: it may have provided it.
    with pytest.raises(ResolutionError) as info:
        registry.get("speculator", "fancy")
    msg = str(info.value)
    assert msg.startswith("unknown speculator 'fancy'; installed speculator components: fake-ngram, none")
    assert re.search(
        r"; plugins with problems, which may provide it: plugin 'broken' \(lmstack-broken 9.9\) "
        r"failed to import \w+: ModuleNotFoundError",
        msg,
    )


BAD_PLUGINS = {
    "misnamed-argument": (
        """
        from lmstack.hookspecs import hookimpl
        from lmstack.registry import Component

        @hookimpl
        def lmstack_register_speculators(reg):
            reg(Component(name="fake-bad", kind="speculator", factory=lambda o, c: None))
        """,
        "declares argument `reg` in lmstack_register_speculators, which lmstack does not pass; "
        "name it `register`",
    ),
    "misspelled-hook": (
        """
        from lmstack.hookspecs import hookimpl
        from lmstack.registry import Component

        @hookimpl
        def lmstack_register_speculator(register):
            register(Component(name="fake-bad", kind="speculator", factory=lambda o, c: None))
        """,
        "implements lmstack_register_speculator, which lmstack does not define; did you mean "
        "lmstack_register_speculators?",
    ),
    "dataclass-options": (
        """
        import dataclasses
        from lmstack.hookspecs import hookimpl
        from lmstack.registry import Component

        @dataclasses.dataclass
        class Opts:
            k: int = 4

        @hookimpl
        def lmstack_register_speculators(register):
            register(Component(name="fake-bad", kind="speculator", factory=lambda o, c: None, options_type=Opts))
        """,
        "offers an invalid component in lmstack_register_speculators: speculator 'fake-bad': options_type must be a msgspec.Struct "
        "(class Opts(msgspec.Struct, forbid_unknown_fields=True)); got dataclass Opts",
    ),
    "raising-hook": (
        """
        from lmstack.hookspecs import hookimpl

        @hookimpl
        def lmstack_register_speculators(register):
            raise KeyError("draft_model")
        """,
        "failed in lmstack_register_speculators: KeyError: 'draft_model'",
    ),
    "unsupported-api": (
        """
        from lmstack.hookspecs import hookimpl
        from lmstack.registry import Component

        @hookimpl
        def lmstack_register_speculators(register):
            register(Component(name="fake-bad", kind="speculator", factory=lambda o, c: None, api=">=2.0"))
        """,
        "is refused: speculator 'fake-bad' (lmstack-bad 1.2) supports lmstack plugin API >=2.0, this "
        "lmstack provides 1.10; upgrade lmstack or install a lmstack-bad release for API 1.10",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PLUGINS))
def test_an_invalid_plugin_is_skipped_and_named_when_selected(autoloaded, caplog, case):
    source, expected = BAD_PLUGINS[case]
    autoloaded.add("lmstack-bad", "bad", source, version="1.2")
    with caplog.at_level(logging.WARNING, logger="lmstack.stack.plugins"):
        registry = default_registry()
    assert "fake-ngram" in registry.names("speculator")
    assert "fake-bad" not in registry.names("speculator")
    (problem,) = registry.problems
    assert str(problem) == f"plugin 'bad' (lmstack-bad 1.2) {expected}"
    assert [line.startswith(str(problem)) for line in plugin_warnings(caplog)] == [True]
    # Selecting its component is an error naming the problem (with both API versions).
    with pytest.raises(ResolutionError, match=re.escape(expected)):
        registry.get("speculator", "fake-bad")


def test_an_allow_listed_plugin_with_an_unsupported_api_is_an_error(installed, monkeypatch):
    installed.add("lmstack-bad", "bad", textwrap.dedent(BAD_PLUGINS["unsupported-api"][0]), version="1.2")
    installed.activate()
    monkeypatch.setenv("LMSTACK_PLUGINS", "bad,fake_ngram")
    with pytest.raises(
        ResolutionError, match=r"supports lmstack plugin API >=2.0, this lmstack provides 1.10"
    ):
        default_registry()


NO_HOOKIMPL = """
from lmstack.registry import Component

def lmstack_register_speculators(register):  # forgot @hookimpl
    register(Component(name="fake-forgot", kind="speculator", factory=lambda o, c: None))
"""

NEVER_REGISTERS = """
from lmstack.hookspecs import hookimpl

@hookimpl
def lmstack_register_speculators(register):
    pass
"""


def test_a_plugin_that_registers_nothing_is_a_warning(autoloaded, caplog):
    autoloaded.add("lmstack-forgot", "forgot", NO_HOOKIMPL)
    autoloaded.add("lmstack-idle", "idle", NEVER_REGISTERS)
    with caplog.at_level(logging.WARNING, logger="lmstack.stack.plugins"):
        registry = default_registry()
    by_plugin = {p.plugin: p for p in registry.problems}
    assert set(by_plugin) == {"forgot", "idle"}
    assert not any(p.skipped for p in registry.problems)  # nothing to skip: only a warning
    assert "registers nothing: its module has no @hookimpl functions" in by_plugin["forgot"].message
    assert "registers nothing: its registration hooks never call register()" in by_plugin["idle"].message
    assert len(plugin_warnings(caplog)) == 2
    with pytest.raises(ResolutionError, match=r"plugin 'forgot' \(lmstack-forgot 1.2.3\) registers nothing"):
        registry.get("speculator", "fake-forgot")


def test_plugins_check_lists_every_problem(autoloaded, capsys):
    autoloaded.add("lmstack-broken", "broken", BROKEN_PLUGIN, version="9.9")
    # An options type that once crashed `lmstack plugins` (AttributeError: __struct_fields__).
    autoloaded.add("lmstack-bad", "bad", BAD_PLUGINS["dataclass-options"][0], version="1.2")
    code = cli.main(["plugins", "--check"])
    out, err = capsys.readouterr()
    assert code == 1
    lines = out.strip().splitlines()
    assert [line.split(")")[0] for line in lines] == [
        "plugin 'broken' (lmstack-broken 9.9",
        "plugin 'bad' (lmstack-bad 1.2",
    ]
    assert err == ""  # listed once, on stdout
    assert cli.main(["plugins", "--check", "--json"]) == 1
    (broken, bad) = json.loads(capsys.readouterr().out)
    assert (broken["plugin"], broken["distribution"], broken["version"], broken["skipped"]) == (
        "broken",
        "lmstack-broken",
        "9.9",
        True,
    )
    assert bad["text"] == lines[1] and bad["message"].startswith("offers an invalid component")

    # `lmstack plugins` still lists the rest, with one warning line per problem.
    code = cli.main(["plugins"])
    out, err = capsys.readouterr()
    assert code == 0 and "fake-ngram" in out and "fake-fp8" in out
    assert [line.split(" (")[0] for line in err.strip().splitlines()] == [
        "warning: plugin 'broken'",
        "warning: plugin 'bad'",
    ]


def test_plugins_check_without_problems(autoloaded, capsys):
    assert cli.main(["plugins", "--check"]) == 0
    assert capsys.readouterr().out == "no problems\n"


# ---------------------------------------------------------------------------------------------
# A factory that raises: one line naming the role, the component and its distribution
# ---------------------------------------------------------------------------------------------

BOOM_PLUGIN = """
from lmstack.hookspecs import hookimpl
from lmstack.registry import Component

def build(options, ctx):
    raise FileNotFoundError("draft weights not found: /nowhere/draft.gguf")

@hookimpl
def lmstack_register_quantizers(register):
    register(Component(name="boom", kind="quantizer", factory=build))

@hookimpl
def lmstack_register_speculators(register):
    register(Component(name="boom", kind="speculator", factory=build))
"""

BOOM = "failed to build: FileNotFoundError: draft weights not found: /nowhere/draft.gguf"


@pytest.fixture
def boom(installed, monkeypatch, smollm2_path):
    """The `boom` plugin installed and allow-listed (needs the real model's metadata)."""
    installed.add("lmstack-boom", "boom", BOOM_PLUGIN, version="0.3")
    installed.activate()
    monkeypatch.setenv("LMSTACK_PLUGINS", "boom")
    return installed


@pytest.fixture
def stack_file(tmp_path):
    """Writes a stack file for the real model."""

    def write(text: str) -> str:
        path = tmp_path / "stack.yaml"
        path.write_text(f"model: smollm2-135m-instruct\n{text}")
        return str(path)

    return write


def test_check_build_runs_the_factories(boom, stack_file, capsys):
    # Every factory before the speculator runs (the real allocator sizes itself from the
    # model's KV geometry); the speculator's error is one line.
    code = cli.main(["check", "--build", stack_file("speculator: {name: boom}\n")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.splitlines() == [f"error: speculator 'boom' (lmstack-boom 0.3) {BOOM}"]

    code = cli.main(["check", "--build", stack_file("")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.rstrip().endswith("fits the model and every component builds; no weights were loaded")
    # Without --build the factories do not run: the broken one passes.
    assert cli.main(["check", stack_file("speculator: {name: boom}\n")]) == 0
    capsys.readouterr()
    # The factories need the model's metadata.
    assert cli.main(["check", "--build", "--skip-model", stack_file("")]) == 2
    assert capsys.readouterr().err == "error: --build needs the model's metadata; leave out --skip-model\n"


def test_llm_raises_build_error(boom, stack_file):
    from lmstack.errors import BuildError

    with pytest.raises(BuildError) as info:
        lmstack.LLM(stack_file("quant: boom\n"))
    err = info.value
    assert (err.role, err.component, err.distribution, err.version) == (
        "quantizer",
        "boom",
        "lmstack-boom",
        "0.3",
    )
    assert str(err) == f"quantizer 'boom' (lmstack-boom 0.3) {BOOM}"
    assert isinstance(err.__cause__, FileNotFoundError)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # crosses process boundaries intact


def _run_cli(boom, *argv: str, plugins: str = "boom") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(boom.root), "LMSTACK_PLUGINS": plugins}
    return subprocess.run(
        [sys.executable, "-m", "lmstack.cli", *argv], capture_output=True, text=True, env=env, timeout=180
    )


@pytest.mark.slow
def test_generate_reports_a_factory_error_in_one_line(boom, stack_file):
    proc = _run_cli(boom, "generate", "--stack", stack_file("quant: boom\n"), "Hi")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"error: quantizer 'boom' (lmstack-boom 0.3) {BOOM}"]


@pytest.mark.slow
def test_serve_reports_a_factory_error_in_one_line(boom, stack_file):
    # The quantizer is built first: the server exits before any weight is read.
    proc = _run_cli(boom, "serve", stack_file("quant: boom\n"), "--port", "0", plugins="boom,api")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert f"error: quantizer 'boom' (lmstack-boom 0.3) {BOOM}" in proc.stderr.splitlines()


def test_a_stack_that_does_not_select_the_broken_plugin_resolves(autoloaded, capsys, tmp_path):
    autoloaded.add("lmstack-broken", "broken", BROKEN_PLUGIN, version="9.9")
    stack = tmp_path / "stack.yaml"
    stack.write_text("speculator: {name: fake-ngram}\n")
    assert cli.main(["check", str(stack), "--skip-model"]) == 0
    out, err = capsys.readouterr()
    assert "fake-ngram" in out
    (warning,) = err.splitlines()
    assert warning.startswith("warning: plugin 'broken' (lmstack-broken 9.9) failed to import")

    stack.write_text("speculator: {name: fancy}\n")
    assert cli.main(["check", str(stack), "--skip-model"]) == 2
    (error,) = capsys.readouterr().err.splitlines()  # warned once per process: only the error
    assert error.startswith("error: speculator.name: unknown speculator 'fancy'")
    assert "plugin 'broken' (lmstack-broken 9.9) failed to import" in error
