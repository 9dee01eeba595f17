"""The role table: one place that says which kinds exist, how they register, where a stack names
them, and which capabilities each may declare."""

from __future__ import annotations

import msgspec
import pytest

from lmstack import hookspecs, interfaces
from lmstack.errors import ResolutionError
from lmstack.hookspecs import hookimpl
from lmstack.registry import Component
from lmstack.roles import KINDS, ROLES, capability_names
from lmstack.stack.config import NAMED_SECTIONS, StackConfig, load_stack
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack.stack.resolve import resolve


def test_every_kind_has_its_hook_interface_and_capabilities():
    assert hookspecs.REGISTRATION_HOOKS == {k.name: k.hook for k in KINDS}
    for kind in KINDS:
        assert callable(getattr(hookspecs, kind.hook)), kind.hook
        assert isinstance(getattr(interfaces, kind.interface), type), kind.interface
        assert "devices" in capability_names(kind.name)  # every kind may say where it runs


def test_every_role_is_a_stack_key_and_a_resolved_attribute():
    stack_fields = set(StackConfig.__struct_fields__)
    for role in ROLES:
        assert role.section in stack_fields, role.key
        if role.key == f"{role.section}.name":
            assert NAMED_SECTIONS[role.section] == role.default
    resolved = resolve(load_stack({}), build_registry(make_plugin_manager(autoload=False)))
    # roles() comes in build order, and each role is an attribute with its default component.
    assert list(resolved.roles()) == [r.name for r in ROLES]
    for role in ROLES:
        sel = getattr(resolved, role.name)
        assert sel.component.kind == role.kind and sel.name == role.default
    with pytest.raises(AttributeError):
        _ = resolved.no_such_role


def _build(capabilities):
    return Component(name="k", kind="attention", factory=lambda o, c: None, capabilities=capabilities)


def test_a_misspelled_capability_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"unknown attention capability 'phase'; did you mean 'phases'\?"):
        _build({"phase": ("decode",)})
    # A capability of another kind is as wrong here.
    with pytest.raises(ValueError, match="unknown attention capability 'world_size'"):
        _build({"world_size": 2})


def test_capability_values_are_typed():
    with pytest.raises(ValueError, match=r"invalid capability: sliding_window: expected bool"):
        _build({"sliding_window": "yes"})
    with pytest.raises(ValueError, match=r"head_dims\[1\]: expected int"):
        _build({"head_dims": (64, "128")})
    # Right types, and the plugin's own "x-" keys, pass.
    ok = _build({"head_dims": (64, 128), "sliding_window": False, "x-tile": {"m": 64}})
    assert ok.capabilities["x-tile"] == {"m": 64}


class _Misspelled:
    @hookimpl
    def lmstack_register_attention(self, register):
        register(_build({"chunked_contxt": True}))


def test_registration_reports_the_plugin_and_the_key():
    pm = make_plugin_manager(autoload=False, extra_plugins=[_Misspelled()])
    with pytest.raises(ResolutionError) as info:
        build_registry(pm)
    msg = str(info.value)
    assert "offers an invalid component in lmstack_register_attention: attention 'k'" in msg
    assert "did you mean 'chunked_context'?" in msg


class _Opts(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    wide: bool = False


class _OptionDependent:
    @hookimpl
    def lmstack_register_attention(self, register):
        register(
            Component(
                name="odd",
                kind="attention",
                factory=lambda o, c: None,
                options_type=_Opts,
                capabilities={"devices": ("cpu",)},
                # A typo in the options-dependent capabilities shows when a stack selects them.
                capabilities_for=lambda o: {"device": ("cpu", "cuda")} if o.wide else {"devices": ("cpu",)},
            )
        )


def test_options_dependent_capabilities_are_checked_too():
    reg = build_registry(make_plugin_manager(autoload=False, extra_plugins=[_OptionDependent()]))
    assert resolve(load_stack({"attention": "odd"}), reg).attention_prefill.capabilities == {
        "devices": ("cpu",)
    }
    with pytest.raises(ValueError, match="did you mean 'devices'"):
        resolve(load_stack({"attention": {"name": "odd", "wide": True}}), reg)
