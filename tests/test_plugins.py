"""Plugin discovery (built-ins, entry points, environment switches) and the registry it fills."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import lmstack
from lmstack.errors import ResolutionError
from lmstack.hookspecs import REGISTRATION_HOOKS, hookimpl
from lmstack.plugins import (
    DEFAULT_PLUGINS,
    UNKNOWN_DISTRIBUTION,
    build_registry,
    default_registry,
    make_plugin_manager,
)
from lmstack.registry import KINDS, Component


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
    assert DEFAULT_PLUGINS == ("lmstack.components.builtins",)
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


def test_a_misspelled_hook_is_reported():
    class Typo:
        @hookimpl
        def lmstack_register_scheduler(self, register):  # missing the final "s"
            pass

    with pytest.raises(ResolutionError, match=r"Typo.*lmstack_register_scheduler\b"):
        make_plugin_manager(autoload=False, default_plugins=(), extra_plugins=[Typo()])


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
