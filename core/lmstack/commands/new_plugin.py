"""`lmstack new-plugin KIND NAME`: write a ready-to-install plugin package for one component kind.

The package holds a component that subclasses the core's reference implementation of its kind
(so it passes the kind's conformance kit before its author changes a line), the entry point and
the plugin API range it supports, a test file running the kit on the *registered* component plus
one end-to-end generation on a tiny random-weight model, and a README listing what to fill in.

Everything kind-specific is one `KindTemplate` in `TEMPLATES`; the rest (registration hook,
where a stack selects the component, the reference component and its capabilities) is read from
the role table (`lmstack.roles`) and the registry. A new kind needs one entry here.
"""

from __future__ import annotations

import argparse
import re
import string
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmstack.errors import LmstackError
from lmstack.hookspecs import hookimpl
from lmstack.roles import KIND, KIND_NAMES, ROLES


class ScaffoldError(LmstackError):
    """`lmstack new-plugin` cannot write the package (bad name, existing folder, unknown kind)."""


@dataclass(frozen=True)
class KindTemplate:
    """What differs between kinds in a generated plugin. `$Camel` in the code is the plugin's
    name in CamelCase (``fair-share`` -> ``FairShare``)."""

    imports: tuple[str, ...]  # the reference class (and options) the generated code extends, and types
    base: str  # the reference class the generated class subclasses
    suffix: str  # the generated class is `$Camel<suffix>`
    options_base: str | None  # the reference's options Struct to extend; None: a fresh Struct
    body: str  # the generated class's body: overrides that delegate to the reference
    build: str  # the factory's body
    # The greedy output on the tiny model must equal the reference stack's. A quantizer changes
    # the numbers, so its end-to-end test checks that it generates instead.
    lossless: bool = True
    # Extra class attributes of the generated conformance test (the kit's knobs).
    kit_settings: str = ""
    # What the generated class does beyond the reference, as the docstring and README say it.
    change: str = "changes nothing yet"


TEMPLATES: dict[str, KindTemplate] = {
    "scheduler": KindTemplate(
        imports=(
            "from lmstack.components.continuous import ContinuousOptions, ContinuousScheduler",
            "from lmstack.sequence import Sequence",
        ),
        base="ContinuousScheduler",
        suffix="Scheduler",
        options_base="ContinuousOptions",
        body='''
"""Continuous batching as the reference does it (token budget, chunked prefill, preemption
by recompute). Change the admission order here, or override `schedule()` for more."""

def waiting_order_key(self, seq: Sequence) -> tuple:
    # Lower is admitted first and preempted last; the reference's order is arrival time.
    return super().waiting_order_key(seq)
''',
        build="""
if ctx.allocator is None or ctx.limits is None:
    raise RuntimeError("a scheduler is built after the allocator and the engine limits")
return $Camel$suffix(options, ctx.allocator, ctx.limits, ctx.step_cost)
""",
    ),
    "allocator": KindTemplate(
        imports=(
            "from lmstack.components import paged",
            "from lmstack.sequence import Sequence",
        ),
        base="paged.PagedAllocator",
        suffix="Allocator",
        options_base="paged.PagedOptions",
        body='''
"""The reference paged allocator: ref-counted fixed-size blocks, copy-on-write forks,
truncation. Change how blocks are handed out here."""

def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
    # Make room for the next tokens; return the (src, dst) block copies to apply first.
    return super().allocate(seq, num_new_tokens)
''',
        build="""
# The reference's factory sizes the pool from the memory budget (or `num_blocks`); reuse its answer.
sized = paged.COMPONENT.factory(options, ctx)
return $Camel$suffix(sized.num_blocks, sized.block_size)
""",
    ),
    "attention": KindTemplate(
        imports=(
            "import torch",
            "from lmstack.batch import AttentionMetadata",
            "from lmstack.components.torch_attention import TorchAttention",
        ),
        base="TorchAttention",
        suffix="Attention",
        options_base=None,
        body='''
"""The reference kernels in plain PyTorch. Replace `prefill` and/or `decode` with your
kernel (and declare the phases you implement in the capabilities)."""

def prefill(
    self,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    # q [T, Hq, D]; k, v [T, Hkv, D] (already in the cache); each sequence also attends to its
    # `meta.context_lens` earlier cached tokens. Returns [T, Hq, D]. k_scale / v_scale [Hkv]:
    # per-KV-head scales of a float8 cache (None otherwise; drop float8 from the declared
    # kv_cache_dtypes if your kernel does not read them). logit_softcap: Gemma 2's tanh cap on
    # the scores (passed only with the `logit_softcap` capability: drop it if you do not cap).
    kw = {"scale": scale, "sliding_window": sliding_window, "k_scale": k_scale, "v_scale": v_scale}
    kw["logit_softcap"] = logit_softcap
    return super().prefill(q, k, v, k_cache, v_cache, meta, **kw)

def decode(
    self,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    # q [B, Hq, D]: one query per sequence over its `meta.seq_lens` cached tokens. Returns [B, Hq, D].
    kw = {"scale": scale, "sliding_window": sliding_window, "k_scale": k_scale, "v_scale": v_scale}
    kw["logit_softcap"] = logit_softcap
    return super().decode(q, k_cache, v_cache, meta, **kw)
''',
        build="""
return $Camel$suffix()
""",
        kit_settings="""
# Random (dtype, head_dim, block_size, GQA ratio) combinations per check, fresh each run and
# together covering every value; None runs every combination (slower).
cases = 3
""",
    ),
    "quantizer": KindTemplate(
        imports=(
            "from collections.abc import Callable",
            "from torch import nn",
            "from lmstack.components.none_quantizer import NoQuantizer",
            "from lmstack.interfaces import LinearSpec",
        ),
        base="NoQuantizer",
        suffix="Quantizer",
        options_base=None,
        body='''
"""No quantization yet: plain linears in the serving dtype. Return your own linear modules
from `linear_factory`, and set `kv_cache_dtype` for a quantized KV cache."""

def linear_factory(self) -> Callable[[LinearSpec], nn.Module]:
    # The model builds every linear layer through the factory returned here: LinearSpec (sizes,
    # name, how tensor parallelism splits it) -> a module mapping [..., in] -> [..., out].
    return super().linear_factory()

def process_model(self, model: nn.Module) -> None:
    # Runs once after the weights are loaded: repack or swap modules here.
    super().process_model(model)
''',
        build="""
return $Camel$suffix()
""",
        lossless=False,
    ),
    "speculator": KindTemplate(
        imports=(
            "from lmstack.components.none_speculator import NoSpeculator",
            "from lmstack.sequence import Sequence",
            "from lmstack.sample.verification import Draft",
        ),
        base="NoSpeculator",
        suffix="Speculator",
        options_base=None,
        body='''
"""Proposes nothing yet. Set `num_draft_tokens` (the most you propose per step; 0 means the
engine never asks) and return up to that many draft tokens per sequence from `propose`."""

num_draft_tokens = 0

def propose(self, seqs: list[Sequence]) -> dict[int, list[int] | Draft]:
    # seq_id -> draft tokens for each sequence in decode (`seq.token_ids` is prompt + output).
    # The core verifies every draft against the model, so output never changes, only speed.
    return super().propose(seqs)
''',
        build="""
return $Camel$suffix()
""",
    ),
    "parallel": KindTemplate(
        imports=(
            "from lmstack.components.single import SingleLayout, SingleOptions",
            "from lmstack.exec.executor import ExecutorSpec",
            "from lmstack.interfaces import Executor",
        ),
        base="SingleLayout",
        suffix="Layout",
        options_base="SingleOptions",
        body='''
"""One process, one device, as the reference does it. Start workers and shard the model in
`create_executor`, and declare `world_size` in the capabilities."""

def create_executor(self, spec: ExecutorSpec) -> Executor:
    # The executor that loads the model and runs each step (the reference: in-process).
    return super().create_executor(spec)
''',
        build="""
return $Camel$suffix()
""",
    ),
    "cache": KindTemplate(
        imports=("from lmstack.components.none_cache import NoCache",),
        base="NoCache",
        suffix="Cache",
        options_base=None,
        body='''
"""Prefix reuse in its simplest form: the reference `none` reuses nothing, so this subclass
turns reuse on and remembers which device block holds which content hash. Add lower tiers with
`holds` / `fetch` / `take_transfers` / `offloaded` (see `lmstack.interfaces.BlockCache`)."""

reuses_blocks = True

def __init__(self) -> None:
    self.blocks: dict[int, int] = {}  # content hash -> device block holding it

def lookup(self, block_hash: int) -> int | None:
    return self.blocks.get(block_hash)

def register(self, block_hash: int, block_id: int) -> None:
    self.blocks[block_hash] = block_id

def evict(self, block_hash: int, block_id: int) -> None:
    # Only if this block is the one remembered (the same content may sit in two blocks).
    if self.blocks.get(block_hash) == block_id:
        del self.blocks[block_hash]
''',
        build="""
return $Camel$suffix()
""",
        # The reference reuses nothing, and the cache kit asks a cache to hit.
        change="turns on the simplest prefix reuse",
    ),
}

NAME_RULE = "lowercase letters, digits and single dashes, starting with a letter (e.g. fair-share)"
_NAME = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
_MAX_NAME = 40


@dataclass(frozen=True)
class PluginNames:
    """Every name derived from the component's NAME and KIND."""

    kind: str
    name: str  # the component's name, what a stack selects: "fair-share"

    @property
    def distribution(self) -> str:  # what pip installs: "lmstack-fair-share-scheduler"
        return f"lmstack-{self.name}-{self.kind}"

    @property
    def package(self) -> str:  # the import name: "lmstack_fair_share_scheduler"
        return self.distribution.replace("-", "_")

    @property
    def entry_point(self) -> str:
        # Unique per kind, so that plugins of several kinds with the same NAME install side by
        # side (lmstack keys entry points by name); LMSTACK_PLUGINS allow-lists this name.
        return f"{self.name}-{self.kind}"

    @property
    def camel(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("-"))

    @property
    def test_file(self) -> str:
        # Unique per package, so one pytest run can collect the tests of several plugins.
        return f"test_{self.name.replace('-', '_')}_{self.kind}.py"


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ScaffoldError(f"invalid plugin name {name!r}: use {NAME_RULE}")
    if len(name) > _MAX_NAME:
        raise ScaffoldError(f"plugin name {name!r} is longer than {_MAX_NAME} characters; shorten it")


def check_kind(kind: str) -> None:
    if kind not in KIND_NAMES:
        raise ScaffoldError(
            f"unknown kind {kind!r}; lmstack new-plugin makes one of: {', '.join(KIND_NAMES)}"
        )
    if kind not in TEMPLATES:
        raise ScaffoldError(
            f"lmstack new-plugin has no template for kind {kind!r} yet; add one to lmstack.commands.new_plugin.TEMPLATES"
        )


# ---------------------------------------------------------------------------------------------
# What the templates read from the rest of the core
# ---------------------------------------------------------------------------------------------


def stack_selection(kind: str, name: str) -> dict[str, dict[str, str]]:
    """The stack sections selecting `name` for every role of `kind`: ``{"scheduler": {"name":
    "x"}}``, ``{"attention": {"prefill": "x", "decode": "x"}}``, ``{"quant": {"weights": "x"}}``."""
    sections: dict[str, dict[str, str]] = {}
    for role in ROLES:
        if role.kind == kind:
            section, _, field = role.key.partition(".")
            sections.setdefault(section, {})[field] = name
    return sections


def builtin_registry():
    """The core's own components (no installed plugins): the references the templates extend."""
    from lmstack.stack.plugins import build_registry, make_plugin_manager

    return build_registry(make_plugin_manager(autoload=False))


def reference_component(kind: str):
    """The built-in component a stack gets for `kind` when it names none (the role's default),
    which the generated component extends."""
    default = next(role.default for role in ROLES if role.kind == kind)
    return builtin_registry().get(kind, default)


def plugin_api_range() -> str:
    """The API range generated components declare: this lmstack's plugin API major."""
    from lmstack.plugin_api import PLUGIN_API_VERSION

    major = int(PLUGIN_API_VERSION.split(".")[0])
    return f">={major}.0,<{major + 1}"


def lmstack_requirement() -> str:
    """The `lmstack` requirement: at least this release, below the next one that may carry a new
    plugin-API major. lmstack raises the first non-zero part of its version with each plugin-API
    major (the minor while it is 0.x, the major from 1.0 on; docs/plugins.md, "Version")."""
    from lmstack.stack.plugins import lmstack_version

    major, minor = (int(part) for part in lmstack_version().split(".")[:2])
    cap = f"0.{minor + 1}" if major == 0 else str(major + 1)
    return f"lmstack>={major}.{minor},<{cap}"


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def py_literal(value: Any, indent: int = 0, inline: bool = False) -> str:
    """`value` as Python source in the house style: double quotes; a top-level dict one key per
    line, nested ones on one line."""
    if isinstance(value, Mapping):
        items = [f"{py_literal(k)}: {py_literal(v, inline=True)}" for k, v in value.items()]
        if inline or not items:
            return "{" + ", ".join(items) + "}"
        pad = " " * indent
        return "{\n" + "".join(f"{pad}    {item},\n" for item in items) + f"{pad}}}"
    if isinstance(value, tuple | list):
        inner = ", ".join(py_literal(v, inline=True) for v in value)
        if isinstance(value, tuple) and len(value) == 1:
            inner += ","
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def yaml_flow(sections: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Stack-file lines for `stack_selection`: ``scheduler: {name: x}``."""
    return [f"{s}: {{{', '.join(f'{k}: {v}' for k, v in fields.items())}}}" for s, fields in sections.items()]


_COMMON_IMPORTS = (
    "from lmstack.hookspecs import hookimpl",
    "from lmstack.interfaces import BuildContext",
    "from lmstack.registry import Component",
)


def import_block(lines: list[str]) -> str:
    """Import lines merged per module and sorted as isort sorts them in a plugin's own repository:
    the standard library, then the rest (lmstack, torch and msgspec are all third-party there);
    in each, `import x` lines before `from x import` lines."""
    sections: dict[bool, tuple[set[str], dict[str, set[str]]]] = {True: (set(), {}), False: (set(), {})}
    for line in lines:
        words = line.split()
        plain, froms = sections[words[1].partition(".")[0] in sys.stdlib_module_names]
        if words[0] == "import":
            plain.add(words[1])
        else:
            froms.setdefault(words[1], set()).update(n.strip(",") for n in words[3:])
    blocks = []
    for plain, froms in sections.values():
        block = [f"import {m}" for m in sorted(plain)]
        block += [f"from {m} import {', '.join(sorted(froms[m], key=_name_order))}" for m in sorted(froms)]
        if block:
            blocks.append("\n".join(block))
    return "\n\n".join(blocks)


def _name_order(name: str) -> tuple[int, str]:
    # isort's order of imported names: CONSTANTS, then Classes, then functions and modules.
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name


def _indent(code: str, spaces: int) -> str:
    return textwrap.indent(textwrap.dedent(code).strip("\n"), " " * spaces)


def _sub(template: str, **values: str) -> str:
    return string.Template(template).substitute(values)


MODULE = '''\
"""lmstack $kind plugin `$name`.

Generated by `lmstack new-plugin $kind $name`. `$Camel$suffix` subclasses the core's reference
$kind (`$reference`) and $change, so it passes the $kind conformance kit from the
start. Make it your own, keeping `python -m pytest tests` green: the tests build the component
through the entry point below, as lmstack does.
"""

from __future__ import annotations

$imports

__all__ = ["COMPONENT", "$Camel$suffix", "${Camel}Options", "$hook"]


class ${Camel}Options($options_base, forbid_unknown_fields=True):
    """What a stack may set beside the name (`$selection`).
$options_doc
    Add fields with defaults, each with the line `lmstack plugins $name` shows for it:
    `tile: Annotated[int, msgspec.Meta(description="keys per tile")] = 64`.
    A key the stack gives that is no field here is refused."""


class $Camel$suffix($base):
$body


def build(options: ${Camel}Options, ctx: BuildContext) -> $Camel$suffix:
    """Called once per engine with the stack's options; `ctx` holds the model config, the device,
    dtypes and the components built before this one (`lmstack.roles.ROLES` gives the order)."""
$build


COMPONENT = Component(
    name="$name",
    kind="$kind",
    factory=build,
    options_type=${Camel}Options,
    # What the component supports; the stack is checked against it before any weights load,
    # and the conformance kit tests exactly what is declared here.
    capabilities=$capabilities,
    description="$description",
    # The lmstack plugin API versions this component is written against; lmstack refuses to
    # load it (naming both versions) outside this range.
    api="$api",
)


# lmstack calls this hook (entry point `$entry_point` in group `lmstack`, see pyproject.toml).
@hookimpl
def $hook(register) -> None:
    register(COMPONENT)
'''

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$distribution"
version = "0.1.0"
description = "lmstack $kind plugin: $name"
readme = "README.md"
requires-python = ">=3.11"
# The lmstack releases this plugin installs with: the plugin API's next major may break it.
dependencies = ["$requirement"]

[project.optional-dependencies]
test = ["pytest>=8"]

# lmstack finds plugins through entry points in group `lmstack`: the name is what
# LMSTACK_PLUGINS allow-lists, the value the module holding the @hookimpl function.
[project.entry-points.lmstack]
$entry_point = "$package"

# Every subpackage goes into the wheel (a plain `packages = [...]` list would leave them out).
[tool.setuptools.packages.find]
include = ["$package", "$package.*"]

# The lmstack repository's code style, which the generated code follows; change it freely.
[tool.ruff]
line-length = 110

[tool.ruff.lint]
select = ["E", "F", "I", "UP", "B", "W"]
"""

TESTS = '''\
"""Tests of the $kind plugin `$name`: the core's $kind conformance kit on the component as
registered (found through the entry point, built through its factory), and one generation on a
tiny random-weight Llama (written once per session; nothing is downloaded).

    pip install -e .[test] && python -m pytest tests
"""

from __future__ import annotations

from lmstack import LLM, SamplingParams
from lmstack.testing import $kit

# Provides the `tiny_model_path` fixture.
pytest_plugins = ["lmstack.testing.fixtures"]

MAX_TOKENS = 8


class Test$Camel${suffix}Conformance($kit):
    component = "$name"  # the registered name; the kit builds it with `options`
    options = {}$kit_settings


# The tiny model with the reference components, and with this plugin selected in its place.
# Small KV pool and batch limits keep it fast.
REFERENCE_STACK = $reference_stack
PLUGIN_STACK = {
    **REFERENCE_STACK,
$plugin_sections
}


def generate(stack: dict, model_path) -> list[int]:
    llm = LLM({**stack, "model": str(model_path)})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate("The capital of France is", params)[0].outputs[0].token_ids


$end_to_end
'''

LOSSLESS_TEST = """\
def test_generates_what_the_reference_stack_generates(tiny_model_path):
    # Greedy output is the reference's unless the $kind changes the numbers (it should not).
    tokens = generate(PLUGIN_STACK, tiny_model_path)
    assert len(tokens) == MAX_TOKENS
    assert tokens == generate(REFERENCE_STACK, tiny_model_path)"""

LOSSY_TEST = """\
def test_generates(tiny_model_path):
    # A quantizer changes the numbers, so its output may differ from the reference stack's;
    # compare logits with a tolerance you can justify once it quantizes.
    tokens = generate(PLUGIN_STACK, tiny_model_path)
    assert len(tokens) == MAX_TOKENS
    assert len(generate(REFERENCE_STACK, tiny_model_path)) == MAX_TOKENS"""

README = """\
# $distribution

An lmstack $kind plugin: component `$name`, generated by `lmstack new-plugin $kind $name`.
It starts as a subclass of the core's reference $kind `$reference` that $change_readme.

## Fill in

- [ ] **What it does**: the technique, and when to choose it over `$reference`.
- [ ] **Options**: every field of `${Camel}Options` in `$package/__init__.py`: meaning, default, range.
- [ ] **Capabilities**: what `COMPONENT.capabilities` declares (devices, dtypes, ...) and why; the
      conformance kit tests exactly what is declared.
- [ ] **Measured numbers**: what it gains against `$reference`, on which hardware (name the CPU or GPU),
      with the command that measured it. Only numbers you measured.
- [ ] **Tests**: what the tests below cover beyond the conformance kit.

## Install

```sh
pip install -e .[test]
lmstack plugins            # lists: $kind  $name  $distribution ...
```

## Select it

```yaml
$selection_yaml
```

`lmstack check stack.yaml` shows it in the resolved stack.

## Test

```sh
python -m pytest tests
```

`tests/$test_file` runs the core's $kind conformance kit on the registered component and
generates a few tokens on a tiny random-weight model.

## Compatibility

The component declares lmstack plugin API `$api`; lmstack refuses to load it outside that range.
"""


def render(kind: str, name: str) -> dict[str, str]:
    """The generated package's files: relative path -> text."""
    check_kind(kind)
    check_name(name)
    if name in builtin_registry().names(kind):
        # Two components of one kind and name cannot both be installed.
        raise ScaffoldError(f"{kind} {name!r} is one of lmstack's own components; pick another name")
    names = PluginNames(kind, name)
    template = TEMPLATES[kind]
    reference = reference_component(kind)
    selection = stack_selection(kind, name)
    api = plugin_api_range()

    options_base = template.options_base or "msgspec.Struct"
    options_doc = (
        f"    Every option of the reference `{reference.name}` applies too.\n"
        if template.options_base
        else "    The reference takes no options.\n"
    )
    common = {
        "kind": kind,
        "name": name,
        "Camel": names.camel,
        "suffix": template.suffix,
        "reference": reference.name,
        "package": names.package,
        "distribution": names.distribution,
        "entry_point": names.entry_point,
        "api": api,
        "test_file": names.test_file,
        "change": template.change,
        "change_readme": template.change.removesuffix(" yet"),
    }
    module = _sub(
        MODULE,
        **common,
        imports=import_block(
            [*template.imports, *_COMMON_IMPORTS, *([] if template.options_base else ["import msgspec"])]
        ),
        hook=KIND[kind].hook,
        options_base=options_base,
        options_doc=options_doc,
        selection="; ".join(yaml_flow(selection)),
        base=template.base,
        body=_indent(_sub(template.body, **common), 4),
        build=_indent(_sub(template.build, **common), 4),
        capabilities=py_literal(dict(reference.capabilities), 4),
        description=f"{kind.capitalize()} {name}: the reference {reference.name} {kind}, to be changed.",
    )
    # Small limits: the tiny model's KV pool and batch do not need the defaults' gigabyte.
    reference_stack: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "scheduler": {"name": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": 256},
        "allocator": {"name": "paged", "kv_cache_memory": "16MiB"},
    }
    # The reference stack with the plugin's sections in place (keeping their small limits).
    changed = {
        section: {**reference_stack.get(section, {}), **fields} for section, fields in selection.items()
    }
    tests = _sub(
        TESTS,
        **common,
        kit=f"{kind.capitalize()}Conformance",
        kit_settings="\n" + _indent(template.kit_settings, 4) if template.kit_settings else "",
        reference_stack=py_literal(reference_stack),
        plugin_sections="\n".join(
            f"    {py_literal(k)}: {py_literal(v, inline=True)}," for k, v in changed.items()
        ),
        end_to_end=_sub(LOSSLESS_TEST if template.lossless else LOSSY_TEST, **common),
    )
    return {
        "pyproject.toml": _sub(PYPROJECT, **common, requirement=lmstack_requirement()),
        f"{names.package}/__init__.py": module,
        f"tests/{names.test_file}": tests,
        "README.md": _sub(README, **common, selection_yaml="\n".join(yaml_flow(selection))),
    }


def write_plugin(kind: str, name: str, directory: str | Path | None = None) -> Path:
    """Write the package for a `kind` component called `name` into `directory` (default:
    ``./lmstack-<name>-<kind>``), which must not exist or be empty. Returns the directory."""
    files = render(kind, name)
    target = Path(directory if directory is not None else PluginNames(kind, name).distribution)
    if target.exists() and not target.is_dir():
        raise ScaffoldError(f"{target} exists and is not a folder; choose another --dir")
    if target.is_dir() and any(target.iterdir()):
        raise ScaffoldError(
            f"{target} already exists and is not empty; new-plugin never overwrites: choose another "
            "--dir or remove it"
        )
    for relative, text in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return target


def next_steps(kind: str, name: str, target: Path) -> str:
    names = PluginNames(kind, name)
    # pip takes a bare folder name for a package name; "./" says it is a path. The quotes keep
    # shells that expand brackets (zsh) away from the extra.
    where = str(target) if target.is_absolute() else f"./{target}"
    return "\n".join(
        [
            f"wrote {kind} plugin {name!r} ({names.distribution}) to {where}",
            "next:",
            f'  pip install -e "{where}[test]"',
            f"  lmstack plugins               # lists {kind} {name}",
            f"  python -m pytest {Path(where) / 'tests'}",
            f"  select it in a stack: {'; '.join(yaml_flow(stack_selection(kind, name)))}",
        ]
    )


# ---------------------------------------------------------------------------------------------
# The command: registered through the same hook a plugin's commands use (`DEFAULT_PLUGINS`)
# ---------------------------------------------------------------------------------------------


@hookimpl
def lmstack_register_commands(subparsers: argparse._SubParsersAction) -> None:
    command = subparsers.add_parser(
        "new-plugin",
        help="write a ready-to-install plugin package for one component kind",
        description="Write a plugin package: a component of KIND named NAME that extends the core's "
        "reference implementation, its entry point, tests running the kind's conformance kit, and a "
        "README to fill in. An existing non-empty folder is never overwritten.",
    )
    command.add_argument("kind", metavar="KIND", help=f"one of: {', '.join(KIND_NAMES)}")
    command.add_argument(
        "name", metavar="NAME", help="the component's name: lowercase letters, digits and dashes"
    )
    command.add_argument(
        "--dir", metavar="D", default=None, help="where to write it (default: ./lmstack-NAME-KIND)"
    )
    command.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    target = write_plugin(args.kind, args.name, args.dir)
    print(next_steps(args.kind, args.name, target))
    return 0
