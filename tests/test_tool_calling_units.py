"""lmstack_api.tools without a server: the call grammars (checked with xgrammar's matcher over a
byte vocabulary), the generic format's parser, content held around calls, and the messages a
template gets."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lmstack_api import tools as T
from lmstack_api.errors import APIError
from lmstack_api.tool_parsers import HermesParser

xgr = pytest.importorskip("xgrammar")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},
]


def request(**kw):
    base = dict(tools=TOOLS, tool_choice=None, parallel_tool_calls=None, functions=None, function_call=None)
    return SimpleNamespace(**{**base, **kw})


def setup_for(template: str, **kw) -> T.ToolSetup:
    return T.tool_setup(request(**kw), template=template, family=None, parser_name=None, model="m")


HERMES_TEMPLATE = "{% for t in tools %}{{ t }}{% endfor %}<tool_call>"


def accepts(grammar, text: str) -> bool:
    """Whether xgrammar's matcher takes `text` whole and may then end (a byte vocabulary)."""
    info = xgr.TokenizerInfo(
        [bytes([i]) for i in range(256)] + [b""], xgr.VocabType.RAW, vocab_size=257, stop_token_ids=[256]
    )
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.accept_token(256)


def call_grammar(setup: T.ToolSetup, fmt_name: str):
    """The grammar `tool_grammar` compiles, built the same way."""
    fmt = T.CALL_FORMATS[fmt_name]
    schema = json.dumps(T.call_schema(setup, fmt.args_key))
    rules = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    text, root = T.call_grammar_ebnf(setup, fmt, str(rules))
    return xgr.Grammar.from_ebnf(text, root_rule_name=root)


def hermes_grammar(setup: T.ToolSetup):
    return call_grammar(setup, "hermes")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def test_hermes_grammar_takes_valid_calls_only():
    g = hermes_grammar(setup_for(HERMES_TEMPLATE, tool_choice="required"))
    assert accepts(g, CALL) and accepts(g, PING) and accepts(g, CALL + "\n" + PING)
    assert not accepts(g, "Sure! " + CALL)  # no text around forced calls
    assert not accepts(g, CALL.replace('"Paris"', "3"))  # arguments follow the schema
    assert not accepts(g, CALL.replace('"city": "Paris", ', ""))  # required property
    assert not accepts(g, PING.replace("ping", "pong"))  # only the tools' names
    one = hermes_grammar(setup_for(HERMES_TEMPLATE, tool_choice="required", parallel_tool_calls=False))
    assert accepts(one, CALL) and not accepts(one, CALL + "\n" + PING)
    named = hermes_grammar(
        setup_for(HERMES_TEMPLATE, tool_choice={"type": "function", "function": {"name": "ping"}})
    )
    assert accepts(named, PING) and not accepts(named, CALL)
    # and what the grammar allows, the template's parser reads back as the same calls
    parser = HermesParser(TOOLS)
    got = parser.feed(CALL + "\n" + PING)
    got.add(parser.finish())
    assert [c.name for c in got.calls] == ["get_weather", "ping"] and not got.content.strip()


def test_llama3_json_grammar_and_parser_agree():
    template = "{{ tools }}<|python_tag|>"
    s = setup_for(template, tool_choice="required", tools=TOOLS)
    if s.parser.name != "llama3_json":
        pytest.skip(f"this template picks {s.parser.name}")
    g = call_grammar(s, "llama3_json")
    calls = '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "ping", "parameters": {}}'
    assert accepts(g, calls) and not accepts(g, calls.replace("parameters", "arguments"))
    parser = s.parser(TOOLS)
    got = parser.feed(calls)
    got.add(parser.finish())
    assert [c.name for c in got.calls] == ["get_weather", "ping"] and not got.content.strip()


MISTRAL_TEMPLATE = "{{ tools }}[TOOL_CALLS]"


def test_mistral_grammar_and_parser_agree():
    s = setup_for(MISTRAL_TEMPLATE, tool_choice="required")
    assert s.parser.name == "mistral"
    g = call_grammar(s, "mistral")
    calls = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "ping", "arguments": {}}]'
    assert accepts(g, calls) and not accepts(g, calls.removeprefix("[TOOL_CALLS]"))
    assert not accepts(g, calls.replace('"Rome"', "1"))
    assert not accepts(g, "[TOOL_CALLS]ping[ARGS]{}")  # the list form only
    parser = s.parser(TOOLS)
    got = parser.feed(calls)
    got.add(parser.finish())
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Rome"}),
        ("ping", {}),
    ]
    assert not got.content.strip()
    one = call_grammar(
        setup_for(MISTRAL_TEMPLATE, tool_choice="required", parallel_tool_calls=False), "mistral"
    )
    assert accepts(one, '[TOOL_CALLS][{"name": "ping", "arguments": {}}]') and not accepts(one, calls)


def test_pythonic_forced_calls_are_the_generic_array():
    template = "{{ tools }}[func_name1(params_name1=params_value1)]"
    assert setup_for(template, tool_choice="auto").parser.name == "pythonic"
    for choice in ("required", {"type": "function", "function": {"name": "ping"}}):
        s = setup_for(template, tool_choice=choice)  # no longer a 400
        assert s.parser is T.GenericJSONParser and not s.generic
        g = call_grammar(s, s.parser.name)
        text = '[{"name": "ping", "arguments": {}}]'
        assert accepts(g, text) and not accepts(g, "[ping()]")
        content, calls = T.ChoiceCalls(s).whole(text)
        assert content is None and [c.name for _, _, c in calls] == ["ping"]


def test_generic_array_schema():
    s = setup_for("{{ messages }}", tool_choice="required")  # no `tools` in it: generic
    assert s.generic and s.parser is T.GenericJSONParser
    g = call_grammar(s, "generic")
    both = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "ping", "arguments": {}}]'
    assert accepts(g, both) and not accepts(g, "[]") and not accepts(g, both.replace('"Oslo"', "1"))
    s1 = setup_for("{{ messages }}", tool_choice="required", parallel_tool_calls=False)
    g1 = call_grammar(s1, "generic")
    assert not accepts(g1, both) and accepts(g1, '[{"name": "ping", "arguments": {}}]')


def test_length_bounded_strings_stay_json():
    # xgrammar 0.2.9 lets a maxLength string hold raw control characters, which JSON forbids.
    short = {
        "type": "object",
        "properties": {"code": {"type": "string", "maxLength": 4}},
        "required": ["code"],
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": short}}]
    g = call_grammar(setup_for(HERMES_TEMPLATE, tools=tools, tool_choice="required"), "hermes")
    call = '<tool_call>\n{"name": "f", "arguments": {"code": "%s"}}\n</tool_call>'
    assert accepts(g, call % "ab") and not accepts(g, call % "a\x0bb") and not accepts(g, call % "abcde")


@pytest.mark.parametrize("pieces", [1, 2, 5, 1000])
def test_generic_parser_and_choice_calls_split_anyhow(pieces):
    s = setup_for("{{ messages }}", tool_choice="auto")
    cases = [
        (' [{"name": "ping", "arguments": {}}]', None, ["ping"]),
        ("The weather is fine.", "The weather is fine.", []),
        ("[1, 2] are numbers", "[1, 2] are numbers", []),
        ('[{"name": "nope", "arguments": {}}]', '[{"name": "nope", "arguments": {}}]', []),
        ('[{"name": "ping", "arguments": {}}', '[{"name": "ping", "arguments": {}}', []),  # cut short
    ]
    for text, content, names in cases:
        whole = T.ChoiceCalls(s).whole(text)
        cc = T.ChoiceCalls(s)
        size = max(1, len(text) // pieces)
        streamed, calls = "", []
        for i in range(0, len(text), size):
            c, new = cc.feed(text[i : i + size])
            streamed, calls = streamed + c, calls + new
        c, new = cc.finish()
        streamed, calls = streamed + c, calls + new
        assert whole[0] == content and [call.name for _, _, call in whole[1]] == names
        assert (streamed or None) == (content or None)
        assert [call for _, _, call in calls] == [call for _, _, call in whole[1]]


def test_content_is_null_around_calls_but_kept_with_text():
    s = setup_for(HERMES_TEMPLATE, tool_choice="auto")
    assert T.ChoiceCalls(s).whole("\n" + CALL + "\n")[0] is None
    content, calls = T.ChoiceCalls(s).whole("Checking.\n" + CALL)
    assert content == "Checking.\n" and len(calls) == 1
    content, calls = T.ChoiceCalls(setup_for(HERMES_TEMPLATE, parallel_tool_calls=False)).whole(CALL + PING)
    assert [c.name for _, _, c in calls] == ["get_weather"]  # one call when parallel is off
    assert T.finish_reason("stop", T.ChoiceCalls(s)) == "stop"


def test_messages_for_a_template_without_tools():
    s = setup_for("{{ messages }}", tool_choice="auto")
    call = {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ping it"},
        {"role": "assistant", "content": ""} | T.message_tool_fields("assistant", [call], None, None, 2),
        {"role": "tool", "content": "pong"} | T.message_tool_fields("tool", None, "call_1", None, 3),
    ]
    out, tools = T.for_template(s, msgs, "{{ messages }}")
    assert tools is None
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\nYou can call")
    assert json.loads(out[2]["content"]) == [{"name": "ping", "arguments": {}}]
    assert out[3] == {"role": "user", "content": "Result of ping: pong"}
    # a template that takes tools gets them, and the messages as they are (name filled in)
    out, tools = T.for_template(s, msgs, HERMES_TEMPLATE)
    assert (
        tools == TOOLS and out[3]["name"] == "ping" and out[2]["tool_calls"][0]["function"]["arguments"] == {}
    )


def test_bad_tool_fields_are_400():
    bad = [
        dict(tools=[{"type": "function", "function": {"name": "has space"}}]),
        dict(tools=[TOOLS[1], TOOLS[1]]),
        dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tools=None, tool_choice="required"),
        dict(functions=[{"name": "f"}]),
    ]
    for kw in bad:
        with pytest.raises(APIError) as e:
            setup_for(HERMES_TEMPLATE, **kw)
        assert e.value.status == 400 and e.value.param in ("tools", "tool_choice", "functions")
    with pytest.raises(APIError):
        T.message_tool_fields("tool", None, None, None, 0)  # a tool result answers a call id
    with pytest.raises(APIError):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
        T.message_tool_fields("assistant", [call], None, None, 0)
    assert setup_for(HERMES_TEMPLATE, tools=None) is None
    assert setup_for(HERMES_TEMPLATE, tool_choice="none").parser is None


@pytest.mark.parametrize("style", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_tiny_tool_templates_pick_their_parser_and_render_calls_it_reads(style):
    # The tiny end-to-end models' templates: each selects its family's parser, and the calls it
    # renders in an earlier assistant turn are what that parser reads back (and, without the
    # ids Mistral adds, what the forced grammar allows; pythonic calls are forced as the array).
    from lmstack.model.tokenizer import compile_chat_template
    from lmstack.testing.tiny_tools import TOOL_TEMPLATES

    source = TOOL_TEMPLATES[style]
    s = setup_for(source, tool_choice="auto")
    assert s.parser.name == style and not s.generic
    forced = setup_for(source, tool_choice="required")
    assert forced.parser is (T.GenericJSONParser if style == "pythonic" else s.parser)
    args = [{"city": "Paris", "days": 2}, {}]
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(zip(["get_weather", "ping"], args, strict=True))
    ]
    ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    template = compile_chat_template(source)
    tokens = dict(bos_token="<|im_start|>", eos_token="<|im_end|>")
    prompt = template.render(messages=ask, tools=TOOLS, add_generation_prompt=True, **tokens)
    turn = {"role": "assistant", "content": None, "tool_calls": calls}
    full = template.render(messages=[*ask, turn], tools=TOOLS, add_generation_prompt=False, **tokens)
    assert full.startswith(prompt) and "Be brief." in prompt and "get_weather" in prompt
    answer = full[len(prompt) :].split("<|im_end|>")[0]
    parser = s.parser(TOOLS)
    got = parser.feed(answer)
    got.add(parser.finish())
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", args[0]), ("ping", {})]
    assert not got.content.strip()
    if style in ("hermes", "llama3_json"):
        assert accepts(call_grammar(forced, style), answer)
    # a tool result renders too, after the call
    result = {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "21 C"}
    later = template.render(messages=[*ask, turn, result], tools=TOOLS, add_generation_prompt=True, **tokens)
    assert later.startswith(full.rstrip("\n")) and "21 C" in later


def test_forced_mistral_marker_is_text_when_it_is_a_special_token(tmp_path):
    # Real Mistral tokenizers have [TOOL_CALLS] as a special token. No grammar allows a special
    # token, so the forced format makes the model spell the marker in ordinary tokens, and the
    # text decoded with skip_special_tokens (the default) still holds it for the parser.
    import torch
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    from lmstack.model.tokenizer import Tokenizer
    from lmstack.sample.grammar import GrammarCompiler, GrammarError
    from lmstack.testing.tiny_model import write_tokenizer_files

    write_tokenizer_files(tmp_path, 1024)
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_hf_folder(tmp_path)
    (marker,) = tok.encode("[TOOL_CALLS]")
    assert marker in tok.special_token_ids

    s = setup_for(MISTRAL_TEMPLATE, tool_choice="required", parallel_tool_calls=False)
    assert s.parser.name == "mistral"
    fmt = T.CALL_FORMATS["mistral"]
    rules = xgr.Grammar.from_json_schema(
        json.dumps(T.call_schema(s, fmt.args_key)), any_whitespace=False, strict_mode=True
    )
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    text, root = T.call_grammar_ebnf(s, fmt, str(rules))
    grammar = compiler.ebnf(text, root=root, param="tools")

    logits = torch.zeros(tok.vocab_size)
    grammar.new_state().apply(logits, [])
    assert logits[marker] == float("-inf") and logits[tok.encode("[")[0]] == 0
    with pytest.raises(GrammarError):
        grammar.new_state().apply(torch.zeros(tok.vocab_size), [marker])

    body = '[{"name": "ping", "arguments": {}}]'
    ids = tok.encode("[") + tok.encode("TOOL_CALLS]") + tok.encode(body)
    state = grammar.new_state()
    for k in range(len(ids) + 1):
        state.apply(torch.zeros(tok.vocab_size), ids[:k])  # each token allowed in turn
    out = tok.decode(ids + list(tok.eos_token_ids))
    assert out == "[TOOL_CALLS]" + body
    parser = s.parser(TOOLS)
    got = parser.feed(out)
    got.add(parser.finish())
    assert [c.name for c in got.calls] == ["ping"] and not got.content
