"""Tool-call parsers (lmstack-api): each built-in parser's corpus through the conformance kit
(parsed whole, split at every character boundary, one character at a time), how a parser is
chosen, and a third-party parser registered through `lmstack_register_tool_parsers`."""

from __future__ import annotations

import importlib.metadata
import json
import sys

import pytest

from lmstack.commands import plugins as plugins_command
from lmstack.errors import ConfigError, ResolutionError
from lmstack.hookspecs import hookimpl
from lmstack.stack.config import stack_from_mapping
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack.stack.resolve import resolve
from lmstack.testing import ToolParserConformance
from lmstack_api.config import server_config
from lmstack_api.tool_parsers import (
    BufferedParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParseDelta,
    PythonicParser,
    available_parsers,
    check_tool_parser,
    choose_parser,
)
from lmstack_api.tool_parsers.base import scan_balanced, skip_space


def _tool(name: str, **properties: str) -> dict:
    props = {k: {"type": t} for k, t in properties.items()}
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": props}},
    }


TOOLS = [
    _tool("get_weather", city="string", unit="string"),
    _tool("get_time", zone="string"),
    _tool("search", query="string"),
]
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
UTC = ("get_time", {"zone": "UTC"})


# ---------------------------------------------------------------------------------------------
# Hermes / Qwen
# ---------------------------------------------------------------------------------------------

H_PARIS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)
H_UTC = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


class TestHermes(ToolParserConformance):
    parser = HermesParser
    tools = TOOLS
    corpus = [
        (H_PARIS, "", [PARIS]),
        (f"{H_PARIS}\n{H_UTC}", "", [PARIS, UTC]),
        (f"{H_PARIS}\n{H_UTC}\n", "", [PARIS, UTC]),
        (f"Let me check the weather for you.\n{H_PARIS}", "Let me check the weather for you.\n", [PARIS]),
        (f"{H_PARIS}\nDone.", "\nDone.", [PARIS]),
        (
            f"<think>\nThe user wants the weather.\n</think>\n\n{H_PARIS}",
            "<think>\nThe user wants the weather.\n</think>\n\n",
            [PARIS],
        ),
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
        ("Wrap it in <tool> or <tool_call tags; a < b.", "Wrap it in <tool> or <tool_call tags; a < b.", []),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": "a } b"}}\n</tool_call>',
            "",
            [("get_weather", {"city": "Zürich", "note": "a } b"})],
        ),
        # Arguments as a JSON string, as some fine-tunes write them.
        (
            '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
            "",
            [UTC],
        ),
        # Malformed: they stay content, tags and all.
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
            [],
        ),
        (
            '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
            '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
            [],
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
            [],
        ),
        (
            f'{H_PARIS}\n<tool_call>["get_time"]</tool_call>\n{H_UTC}',
            '<tool_call>["get_time"]</tool_call>\n',
            [PARIS, UTC],
        ),
        (f"Check this: {H_PARIS[:20]}", f"Check this: {H_PARIS[:20]}", []),
        ("<tool_call>", "<tool_call>", []),
        ('<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>', "", [UTC]),
        (" \n", "", []),
    ]


# ---------------------------------------------------------------------------------------------
# Llama 3 JSON
# ---------------------------------------------------------------------------------------------

L_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
L_UTC = '{"name": "get_time", "parameters": {"zone": "UTC"}}'


class TestLlama3Json(ToolParserConformance):
    parser = Llama3JsonParser
    tools = TOOLS
    corpus = [
        (L_PARIS, "", [PARIS]),
        (f"<|python_tag|>{L_PARIS}", "", [PARIS]),
        (f"{L_PARIS}; {L_UTC}", "", [PARIS, UTC]),
        (f"<|python_tag|>{L_PARIS};{L_UTC}\n", "", [PARIS, UTC]),
        (f"\n\n{L_PARIS}", "", [PARIS]),
        (f"Let me look that up.<|python_tag|>{L_PARIS}", "Let me look that up.", [PARIS]),
        (f"{L_PARIS} Anything else?", " Anything else?", [PARIS]),
        (f"{L_PARIS}; and that is all", "; and that is all", [PARIS]),
        ('{"name": "get_time", "arguments": {"zone": "UTC"}}', "", [UTC]),
        (
            '{"name": "search", "parameters": {"query": "a } b { \\" c"}}',
            "",
            [("search", {"query": 'a } b { " c'})],
        ),
        ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
        # Not calls: other JSON, a call later in the text, unknown functions, no end.
        ('{"city": "Paris", "temp": 21}', '{"city": "Paris", "temp": 21}', []),
        ('{"name": "get_time"}', '{"name": "get_time"}', []),
        (f"Here is the JSON: {L_PARIS}", f"Here is the JSON: {L_PARIS}", []),
        ('{"name": "launch_rockets", "parameters": {}}', '{"name": "launch_rockets", "parameters": {}}', []),
        (L_PARIS[:-3], L_PARIS[:-3], []),
        (
            '<|python_tag|>brave_search.call(query="weather in Paris")',
            '<|python_tag|>brave_search.call(query="weather in Paris")',
            [],
        ),
        (f"{L_PARIS}; {{broken", "; {broken", [PARIS]),
        ("<|python_tag|>", "<|python_tag|>", []),
        ("<|python_tag|>  ", "<|python_tag|>  ", []),
    ]


# ---------------------------------------------------------------------------------------------
# Mistral
# ---------------------------------------------------------------------------------------------


class TestMistral(ToolParserConformance):
    parser = MistralParser
    tools = TOOLS
    corpus = [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
            "",
            [PARIS],
        ),
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": '
            '"a1b2c3d4e"}, {"name": "get_time", "arguments": {"zone": "UTC"}, "id": "f5g6h7i8j"}]',
            "",
            [PARIS, UTC],
        ),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "", [PARIS]),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
            "",
            [PARIS, UTC],
        ),
        ('[TOOL_CALLS]get_time[CALL_ID]abc123XYZ[ARGS]{"zone": "UTC"}', "", [UTC]),
        ('Sure, checking.[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', "Sure, checking.", [UTC]),
        ('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"} Done.', " Done.", [UTC]),
        ("Paris is [mostly] sunny [TOOL] today.", "Paris is [mostly] sunny [TOOL] today.", []),
        # Malformed: stays content, the marker included.
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]',
            [],
        ),
        (
            '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "launch", "arguments": {}}]',
            '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "launch", "arguments": {}}]',
            [],
        ),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', []),
        ("[TOOL_CALLS]get weather now", "[TOOL_CALLS]get weather now", []),
        ("[TOOL_CALLS]get_time[ARGS][1, 2]", "[TOOL_CALLS]get_time[ARGS][1, 2]", []),
        ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ]


# ---------------------------------------------------------------------------------------------
# Pythonic
# ---------------------------------------------------------------------------------------------


class TestPythonic(ToolParserConformance):
    parser = PythonicParser
    tools = TOOLS
    corpus = [
        ('[get_weather(city="Paris", unit="celsius")]', "", [PARIS]),
        ("[get_weather(city='Paris', unit='celsius'), get_time(zone=\"UTC\")]", "", [PARIS, UTC]),
        ('<|python_start|>[get_time(zone="UTC")]<|python_end|>', "", [UTC]),
        ("[get_time()]", "", [("get_time", {})]),
        (
            '[search(query="x", filters={"recent": true, "limit": 5, "max": -1.5}, tags=("a", "b"), exact=None)]',
            "",
            [
                (
                    "search",
                    {
                        "query": "x",
                        "filters": {"recent": True, "limit": 5, "max": -1.5},
                        "tags": ["a", "b"],
                        "exact": None,
                    },
                )
            ],
        ),
        ("[search(query='a ] b [ c \\' d')]", "", [("search", {"query": "a ] b [ c ' d"})]),
        ('[get_time(zone="UTC")]\nDone.', "\nDone.", [UTC]),
        ("Paris is sunny today.", "Paris is sunny today.", []),
        # Not calls: plain lists, positional or non-literal arguments, text first, no end.
        ("[1] Smith, J. (2020).", "[1] Smith, J. (2020).", []),
        ("[]", "[]", []),
        ('[get_weather("Paris")]', '[get_weather("Paris")]', []),
        (
            '[get_weather(city=__import__("os").getcwd())]',
            '[get_weather(city=__import__("os").getcwd())]',
            [],
        ),
        ("[get_weather(**opts)]", "[get_weather(**opts)]", []),
        ("[get_weather(city={1, 2})]", "[get_weather(city={1, 2})]", []),
        ('Calling: [get_time(zone="UTC")]', 'Calling: [get_time(zone="UTC")]', []),
        ('[get_weather(city="Par', '[get_weather(city="Par', []),
        ('[launch(when="now")]', '[launch(when="now")]', []),
        ('<|python_start|>print("hi")', '<|python_start|>print("hi")', []),
        ("<|python_start|>", "<|python_start|>", []),
        ('[get_time(zone="UTC")]<|python_end', "<|python_end", [UTC]),
    ]


# ---------------------------------------------------------------------------------------------
# Choosing a parser
# ---------------------------------------------------------------------------------------------

# Excerpts of the chat templates the families ship (as tokenizer_config.json holds them).
QWEN25_TEMPLATE = (
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, ...'
)
LLAMA31_TEMPLATE = (
    '{{- "Given the following functions, please respond with a JSON for a function call with its proper '
    'arguments that best answers the given prompt.\\n\\n" }}\n{{- \'Respond in the format {"name": function '
    'name, "parameters": dictionary of argument name and its value}.\' }}{{- "<|python_tag|>" + ...'
)
MISTRAL_TEMPLATE = "{%- if message.tool_calls is defined %}{{- '[TOOL_CALLS][' }}{%- for tool_call in ..."
PYTHONIC_TEMPLATE = (
    "you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...)]"
)


@pytest.mark.parametrize(
    ("template", "family", "expected"),
    [
        (QWEN25_TEMPLATE, None, "hermes"),
        (LLAMA31_TEMPLATE, None, "llama3_json"),
        (LLAMA31_TEMPLATE.replace("<|python_tag|>", ""), None, "llama3_json"),
        (MISTRAL_TEMPLATE, None, "mistral"),
        (PYTHONIC_TEMPLATE, None, "pythonic"),
        (None, "qwen2", "hermes"),
        (None, "Qwen3ForCausalLM", "hermes"),
        (None, "llama", "llama3_json"),
        (None, "llama4", "pythonic"),
        (None, "MistralForCausalLM", "mistral"),
        (QWEN25_TEMPLATE, "llama", "hermes"),  # the template says more than the family
        ("{{ messages }}", "gemma2", None),
        (None, None, None),
    ],
)
def test_the_parser_follows_the_template_then_the_family(template, family, expected):
    chosen = choose_parser(None, template, family)
    assert (chosen.name if chosen else None) == expected


def test_every_builtin_is_available_and_named():
    assert set(available_parsers()) >= {"hermes", "llama3_json", "mistral", "pythonic"}
    for name, parser in available_parsers().items():
        assert parser.name == name
        assert choose_parser(name, None, None) is parser


# ---------------------------------------------------------------------------------------------
# A third-party parser, registered through the hook
# ---------------------------------------------------------------------------------------------


class AngleParser(BufferedParser):
    """Angle calls: `<<name {json}>>`, anywhere in the text."""

    name = "angle"

    @classmethod
    def matches(cls, chat_template, family):
        return "<<name" in (chat_template or "")

    def advance(self, final: bool) -> ParseDelta:
        out, buf, i = ParseDelta(), self.buffer, 0
        while i < len(buf):
            start = buf.find("<<", i)
            if start < 0:
                keep = 0 if final or not buf.endswith("<") else 1
                out.content += buf[i : len(buf) - keep]
                i = len(buf) - keep
                break
            out.content += buf[i:start]
            space = skip_space(buf, start + 2)
            brace = buf.find("{", space)
            end = scan_balanced(buf, brace) if brace >= 0 else None
            if end is None or not buf.startswith(">>", end):
                if not final and (end is None or len(buf) < end + 2):
                    i = start
                    break
                out.content += buf[start : start + 2]
                i = start + 2
                continue
            call = self.make_call(buf[space:brace].strip(), json.loads(buf[brace:end]))
            if call is None:
                out.content += buf[start : end + 2]
            else:
                out.calls.append(call)
            i = end + 2
        self.buffer = buf[i:]
        return out


class AnglePlugin:
    @hookimpl
    def lmstack_register_tool_parsers(self, register):
        register(AngleParser)


class TestAngleThroughTheKit(ToolParserConformance):
    """The kit checks a third-party parser as it checks the built-ins."""

    parser = AngleParser
    tools = TOOLS
    corpus = [
        ('Hi <<get_time {"zone": "UTC"}>> bye', "Hi  bye", [UTC]),
        ("a << b", "a << b", []),
    ]


def _angle_pm(*extra):
    return make_plugin_manager(autoload=False, extra_plugins=[AnglePlugin(), "lmstack_api.plugin", *extra])


def test_a_plugin_parser_is_listed_chosen_and_selected_by_server_tool_parser(capsys):
    pm = _angle_pm()  # registered before lmstack-api, whose hook it implements: still fine
    registry = build_registry(pm)
    parsers = available_parsers(pm)
    assert parsers["angle"] is AngleParser and parsers["hermes"] is HermesParser
    ext = next(e for e in registry.extensions["lmstack_register_tool_parsers"] if e.name == "angle")
    assert (ext.kind, ext.obj, ext.description) == (
        "tool parser",
        AngleParser,
        "Angle calls: `<<name {json}>>`, anywhere in the text",
    )

    plugins_command.run(registry, None, as_json=False)
    listing = capsys.readouterr().out
    rows = [line.split() for line in listing.splitlines() if line.startswith("tool parser")]
    assert {r[2] for r in rows} == {"angle", "hermes", "llama3_json", "mistral", "pythonic"}
    plugins_command.run(registry, None, as_json=True)
    assert {"kind": "tool parser", "name": "angle"}.items() <= {
        k: v for row in json.loads(capsys.readouterr().out) if row["name"] == "angle" for k, v in row.items()
    }.items()

    # A plugin's parser is asked before the built-ins; `server.tool_parser` overrides both.
    assert choose_parser(None, "<<name {args}>> <tool_call>", None, pm) is AngleParser
    stack = resolve(
        stack_from_mapping({"model": "tiny", "server": {"tool_parser": "angle"}}),
        registry,
        check_device=False,
    )
    config = server_config(stack)
    check_tool_parser(config, pm)
    assert choose_parser(config.tool_parser, QWEN25_TEMPLATE, "qwen2", pm) is AngleParser


def test_an_unknown_tool_parser_is_a_config_error_naming_the_available_ones():
    pm = _angle_pm()
    stack = resolve(
        stack_from_mapping({"model": "tiny", "server": {"tool_parser": "hermez"}}), build_registry(pm)
    )
    with pytest.raises(ConfigError) as err:
        check_tool_parser(server_config(stack), pm)
    assert str(err.value) == (
        "server.tool_parser: unknown tool parser 'hermez'; available: angle, hermes, llama3_json, mistral, pythonic"
    )


def test_a_parser_name_clashing_with_a_builtin_is_refused():
    class Clash(AngleParser):
        """Another hermes."""

        name = "hermes"

    class ClashPlugin:
        @hookimpl
        def lmstack_register_tool_parsers(self, register):
            register(Clash)

    with pytest.raises(ResolutionError, match="tool parser 'hermes' is registered twice"):
        build_registry(_angle_pm(ClashPlugin()))


def test_registering_something_without_a_name_is_a_plugin_problem():
    class Nameless:
        @hookimpl
        def lmstack_register_tool_parsers(self, register):
            register(object())

    with pytest.raises(ResolutionError, match="which has no `name`"):
        build_registry(_angle_pm(Nameless()))


EARLY_PLUGIN = """
from lmstack.hookspecs import hookimpl
from lmstack_api.tool_parsers import HermesParser

class EarlyParser(HermesParser):
    '''Hermes again, from a distribution whose entry point loads before lmstack-api's.'''

    name = "early"

@hookimpl
def lmstack_register_tool_parsers(register):
    register(EarlyParser)
"""


def test_an_entry_point_implementing_the_hook_may_load_before_lmstack_api(tmp_path, monkeypatch):
    """Entry points load by name: `aaa` before the one that owns the hook. The owner's
    hookspecs are added first, so `aaa` is checked against them, not refused as unknown."""
    module = f"aaa_parsers_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{module}.py").write_text(EARLY_PLUGIN)
    for dist, ep, target in (
        ("aaa-parsers", "aaa", module),
        ("lmstack-api-here", "zzz", "lmstack_api.plugin"),
    ):
        info = tmp_path / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[lmstack]\n{ep} = {target}\n")
    original = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: original(path=[str(tmp_path)]))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        pm = make_plugin_manager(autoload=True)
        registry = build_registry(pm)
        assert registry.problems == []
        listed = {e.name: e.distribution for e in registry.extensions["lmstack_register_tool_parsers"]}
        assert listed["early"] == "aaa-parsers" and listed["hermes"] == "lmstack-api-here"
        assert available_parsers(pm)["early"].__module__ == module
    finally:
        sys.modules.pop(module, None)


def test_a_registered_class_that_is_no_tool_parser_is_skipped(caplog):
    class NotAParser:
        """Has a name, but no feed / finish."""

        name = "bogus"

    class BogusPlugin:
        @hookimpl
        def lmstack_register_tool_parsers(self, register):
            register(NotAParser)

    pm = _angle_pm(BogusPlugin())
    assert "bogus" in {e.name for e in build_registry(pm).extensions["lmstack_register_tool_parsers"]}
    assert "bogus" not in available_parsers(pm)
    assert "is not a subclass of lmstack_api.tool_parsers.ToolParser" in caplog.text


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser, MistralParser, PythonicParser])
def test_values_nested_past_the_recursion_limit_stay_content(parser):
    deep = {
        "hermes": '<tool_call>{"name": "get_time", "arguments": {"zone": DEEP}}</tool_call>',
        "llama3_json": '{"name": "get_time", "parameters": {"zone": DEEP}}',
        "mistral": '[TOOL_CALLS]get_time[ARGS]{"zone": DEEP}',
        "pythonic": "[get_time(zone=DEEP)]",
    }[parser.name].replace("DEEP", "[" * 100_000 + "]" * 100_000)
    instance = parser(TOOLS)
    content = instance.feed(deep).content
    assert content + instance.finish().content == deep


def test_serve_stops_at_an_unknown_tool_parser_in_one_line_before_the_model_loads(tmp_path, capsys):
    from lmstack.cli import main

    stack = tmp_path / "stack.yaml"
    stack.write_text("model: /nowhere/model\nserver: {tool_parser: hermez}\n")
    assert main(["serve", str(stack)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: server.tool_parser: unknown tool parser 'hermez'; available: hermes, ")
