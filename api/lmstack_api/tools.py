"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`.

The request's tools reach the model through its chat template (``tools=`` and the `assistant`
/ `tool` messages, as transformers' `apply_chat_template` passes them). A template that never
mentions `tools` gets lmstack's generic rendering instead: the functions are described in the
system message and the model is asked to answer with a JSON array of calls; `assistant` calls
and `tool` results become text the template can show.

`auto` lets the model write what it likes and a tool-call parser (`lmstack_api.tool_parsers`,
one per choice) separates calls from text. `required` and a named function constrain the output
with a grammar built from the functions' `parameters` schemas in the parser's own format (Hermes
``<tool_call>`` blocks, Llama 3 JSON, Mistral's ``[TOOL_CALLS]`` list, or the generic array), so
the arguments always parse and validate; a pythonic model's forced calls are the generic array.
`none` parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from lmstack.errors import InvalidRequestError
from lmstack.sample.grammar import error_reason
from lmstack_api.errors import APIError, invalid, unsupported
from lmstack_api.grammar_guard import SCHEMA_PARAM, in_daemon_thread
from lmstack_api.tool_parsers import available_parsers, choose_parser
from lmstack_api.tool_parsers.base import ParseDelta, ToolCall, ToolParser, loads_or_none

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TOOLS_IN_TEMPLATE = re.compile(r"\btools\b")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]


@dataclass
class ToolSetup:
    """What a request's tool fields ask for, checked."""

    tools: list[dict[str, Any]]  # OpenAI's shape, for the template and the parser
    functions: list[Function]
    choice: str  # "none", "auto", "required" or "function" (one named function)
    forced: str | None  # the named function
    parallel: bool
    generic: bool  # lmstack renders the tools (the template does not take them)
    parser: type[ToolParser] | None  # None: nothing is parsed (tool_choice none)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")


def template_takes_tools(template: str | None) -> bool:
    return bool(template and _TOOLS_IN_TEMPLATE.search(template))


def model_family(engine: Any) -> str | None:
    """The model's architecture name (``llama``, ``qwen2``...), for parsers that match on it."""
    try:
        return engine.engine.source.architecture.name
    except AttributeError:
        return None


# --- the request -----------------------------------------------------------------------------


def _functions(tools: list[Any]) -> list[Function]:
    # Every error names `tools` as the parameter; the message says which entry and field.
    out: list[Function] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"{where} must be an object", param="tools")
        if tool.get("type") != "function":
            raise invalid(f"{where}.type must be 'function', got {tool.get('type')!r}", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{where}.function must be an object", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}"[:200],
                param="tools",
            )
        if any(f.name == name for f in out):
            raise invalid(f"{where}.function.name {name!r} is given twice", param="tools")
        params = fn.get("parameters")
        if params is None:
            params = _EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise invalid(f"{where}.function.parameters must be a JSON schema object", param="tools")
        desc = fn.get("description")
        out.append(Function(name, desc if isinstance(desc, str) else None, params))
    return out


def _choice(raw: Any, names: list[str]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if names else "none"), None
    if raw in ("none", "auto", "required"):
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if name not in names:
            raise invalid(
                f"tool_choice names function {name!r}, which is not in tools",
                param="tool_choice",
            )
        return "function", name
    raise invalid(
        'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def tool_setup(
    req: Any,
    *,
    template: str | None,
    family: str | None,
    parser_name: str | None,
    model: str,
) -> ToolSetup | None:
    """The checked tool fields of a chat request; None when it sends no tools (and no
    tool_choice other than none)."""
    if req.functions:
        raise unsupported("functions", "the legacy function-calling fields are not implemented; send tools")
    if req.function_call not in (None, "none"):
        raise unsupported("function_call", "the legacy function-calling fields are not implemented")
    tools = req.tools or []
    functions = _functions(tools)
    choice, forced = _choice(req.tool_choice, [f.name for f in functions])
    if not functions:
        if choice not in ("none", "auto"):
            raise invalid(f"tool_choice {choice} needs tools", param="tool_choice")
        return None
    if choice != "none" and not template:
        raise invalid(
            f"model {model} has no chat template; tools need one (server.chat_template: FILE)", "tools"
        )
    generic = not template_takes_tools(template)
    parser: type[ToolParser] | None = None
    if choice != "none":
        parser = GenericJSONParser if generic else choose_parser(parser_name, template, family)
        if parser is None:
            raise invalid(
                f"no tool-call parser fits model {model}'s chat template; name one with server.tool_parser "
                f"(available: {', '.join(sorted(available_parsers()))})",
                param="tools",
            )
        if choice in ("required", "function") and parser.name in READ_AS_GENERIC:
            parser = GenericJSONParser  # the forced format is the generic array: see READ_AS_GENERIC
        if choice in ("required", "function") and parser.name not in CALL_FORMATS:
            raise unsupported(
                "tool_choice",
                f"required and named tool_choice need a call format lmstack can constrain "
                f"({', '.join(sorted(CALL_FORMATS))}); model {model} uses the {parser.name} parser",
            )
    parallel = req.parallel_tool_calls is not False and choice != "function"
    return ToolSetup(list(tools), functions, choice, forced, parallel, generic, parser)


# --- messages for the template ---------------------------------------------------------------


def message_tool_fields(role: str, tool_calls: Any, tool_call_id: Any, name: Any, i: int) -> dict[str, Any]:
    """The tool parts of messages[i] as templates take them: `tool_calls` with `arguments` as a
    dict (transformers' convention; OpenAI sends JSON text), `tool_call_id` and `name`."""
    out: dict[str, Any] = {}
    if tool_calls:
        if role != "assistant":
            raise invalid(f"messages[{i}].tool_calls is only allowed on assistant messages", f"messages[{i}]")
        calls = []
        for j, call in enumerate(tool_calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise invalid(f"{where} must be {{id, type: function, function: {{name, arguments}}}}", where)
            args = fn.get("arguments", "{}")
            parsed = loads_or_none(args) if isinstance(args, str) else args
            if not isinstance(parsed, dict):
                raise invalid(
                    f"{where}.function.arguments must be a JSON object (as text)",
                    f"{where}.function.arguments",
                )
            calls.append(
                {
                    "id": call.get("id") or new_call_id(),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": parsed},
                }
            )
        out["tool_calls"] = calls
    if role == "tool":
        if not isinstance(tool_call_id, str):
            raise invalid(
                f"messages[{i}].tool_call_id is required on tool messages", f"messages[{i}].tool_call_id"
            )
        out["tool_call_id"] = tool_call_id
    if name is not None and role == "tool":
        out["name"] = name
    return out


def _call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    return {
        c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or () if c.get("id")
    }


def for_template(
    setup: ToolSetup | None, messages: list[dict[str, Any]], template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render. A template that takes tools gets them as they are, each
    tool result's function `name` filled in from the call it answers; any other template gets
    the generic rendering (plain text)."""
    names = _call_names(messages)
    for m in messages:
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
    if template_takes_tools(template):
        return messages, setup.tools if setup is not None else None
    if setup is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    return generic_messages(setup, messages), None


def generic_messages(setup: ToolSetup | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that does not take tools: calls and results written as text,
    and (unless tool_choice is none) the functions described in the system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in m["tool_calls"]
            ]
            text = json.dumps(calls, ensure_ascii=False)
            content = f"{m['content']}\n{text}" if m.get("content") else text
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            # As a user turn: templates that know no tool role often refuse one.
            out.append({"role": "user", "content": f"Result of {m.get('name', 'the call')}: {m['content']}"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if setup is None or setup.choice == "none":
        return out
    instructions = generic_instructions(setup.functions)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{instructions}"}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


def generic_instructions(functions: list[Function]) -> str:
    lines = ["You can call these functions:"]
    for f in functions:
        sig = {"name": f.name, "description": f.description or "", "parameters": f.parameters}
        lines.append(json.dumps(sig, ensure_ascii=False))
    lines.append(
        'To call functions, answer with only a JSON array of calls: [{"name": "<function>", '
        '"arguments": {<arguments>}}]. Otherwise answer in plain text.'
    )
    return "\n".join(lines)


def template_error(model: str, exc: Exception) -> APIError:
    return invalid(
        f"model {model}'s chat template cannot render this conversation with tools ({exc}); "
        "give the server a template that takes tools (server.chat_template: FILE)",
        param="messages",
    )


# --- the constraining grammar ----------------------------------------------------------------


@dataclass(frozen=True)
class CallFormat:
    """How a parser's calls are written, for the grammar that forces them."""

    args_key: str  # the JSON key holding the arguments
    prefix: str  # before each call
    suffix: str  # after each call
    separator: str  # between two calls
    open: str = ""  # before the first call
    close: str = ""  # after the last


# Formats lmstack can constrain, by parser name; "generic" is lmstack's own: a JSON array of calls.
#
# Mistral's is its list form, ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. In real
# Mistral tokenizers ``[TOOL_CALLS]`` is a special token, but no grammar ever allows a special
# token (the GrammarCompiler gives them empty pieces), so under this grammar the model writes
# the marker in ordinary tokens: the decoded text holds it whatever skip_special_tokens says,
# and the mistral parser reads it there.
CALL_FORMATS = {
    "generic": CallFormat("arguments", "", "", ", ", "[", "]"),
    "hermes": CallFormat("arguments", "<tool_call>\n", "\n</tool_call>", "\n"),
    "llama3_json": CallFormat("parameters", "", "", "; "),
    "mistral": CallFormat("arguments", "", "", ", ", "[TOOL_CALLS][", "]"),
}

# Parsers whose forced calls are written in the generic array instead, and read back by
# GenericJSONParser. Pythonic calls (``[f(a=1)]``): a grammar of Python call syntax whose keyword
# values follow arbitrary JSON schemas (Python literals, not JSON) is a large piece of work for
# little gain; the array is as easy for the model to write and its arguments validate the same.
READ_AS_GENERIC = frozenset({"pythonic"})


def call_schema(setup: ToolSetup, args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call: {"name": <a function>, <args_key>: <its parameters>}."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, args_key: f.parameters},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for f in setup.functions
        if setup.forced is None or f.name == setup.forced
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


_XGR_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_PLAIN_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _ebnf_literal(text: str) -> str:
    return json.dumps(text)  # EBNF string literals take JSON's escapes


def call_grammar_ebnf(setup: ToolSetup, fmt: CallFormat, call_rules: str) -> tuple[str, str]:
    """(EBNF text, root rule) for calls in `fmt`: `call_rules` is xgrammar's EBNF for one
    call's JSON (root rule `root`); one call, or (parallel) one or more."""
    one = f"{_ebnf_literal(fmt.prefix)} root {_ebnf_literal(fmt.suffix)}"
    rule = f"lmstack_tool_calls ::= {_ebnf_literal(fmt.open)} {one}"
    if setup.parallel:
        rule += f" ({_ebnf_literal(fmt.separator)} {one}){{0, -1}}"
    rule += f" {_ebnf_literal(fmt.close)}"
    # xgrammar (0.2.9) writes a string with maxLength as characters that exclude only quote,
    # backslash, CR and LF: a raw control character there is not JSON. Such strings take no
    # escapes either, so excluding every control character keeps them plain, valid JSON.
    call_rules = call_rules.replace(_XGR_BOUNDED_STRING_CHAR, _JSON_PLAIN_STRING_CHAR)
    return f"{call_rules}\n{rule}\n", "lmstack_tool_calls"


# Schemas the compile guard has passed, per compiler: the bounds do not change, so a schema
# that compiled within them once needs no second trial in the child process.
_GUARDED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_GUARDED_MAX = 1024


async def tool_grammar(setup: ToolSetup, compiler: Any, guard: Any, cfg: Any) -> Any:
    """The grammar that forces `setup`'s calls, compiled within the server's bounds: the
    functions' schemas (what can be expensive) are compiled first by the guard's child process;
    the format around them adds a few rules."""
    limits = {"max_bytes": cfg.grammar_max_schema_bytes, "max_properties": cfg.grammar_max_schema_properties}
    try:
        fmt = CALL_FORMATS["generic" if setup.generic else setup.parser.name]
        try:
            prepared = compiler.prepare(call_schema(setup, fmt.args_key), **limits)
        except InvalidRequestError as exc:
            raise invalid(str(exc), param="tools") from None
        passed = _GUARDED.setdefault(compiler, set())
        if prepared.key not in passed:
            await guard.check(compiler, prepared)
            if len(passed) >= _GUARDED_MAX:
                passed.clear()
            passed.add(prepared.key)

        def build() -> Any:
            import xgrammar

            try:
                rules = xgrammar.Grammar.from_json_schema(
                    prepared.text, any_whitespace=False, strict_mode=True
                )
            except (RuntimeError, ValueError, TypeError) as exc:
                raise InvalidRequestError(f"invalid JSON schema: {error_reason(exc)}", param="tools") from exc
            text, root = call_grammar_ebnf(setup, fmt, str(rules))
            return compiler.ebnf(text, root=root, param="tools")

        try:
            return await in_daemon_thread(build)
        except InvalidRequestError as exc:
            raise invalid(str(exc), param="tools") from None
    except APIError as exc:
        if exc.param == SCHEMA_PARAM:  # the guard's wording is about response_format
            exc.param = "tools"
        raise


# --- calls in the response -------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceCalls:
    """One choice's output through its parser: content and calls, ids assigned in order.

    Content that is only whitespace (between or around calls) is held back until text follows
    it, and dropped when the answer turns out to be calls only: the message's content is then
    null, streamed or not."""

    def __init__(self, setup: ToolSetup) -> None:
        assert setup.parser is not None
        self.parser = setup.parser(setup.tools)
        self.parallel = setup.parallel
        self.calls: list[tuple[str, ToolCall]] = []
        self._held = ""
        self._shown = False  # some content that is not whitespace went out

    def _take(self, delta: ParseDelta, final: bool) -> tuple[str, list[tuple[int, str, ToolCall]]]:
        new = []
        for call in delta.calls:
            if self.calls and not self.parallel:
                break  # parallel_tool_calls false: the first call only
            self.calls.append((new_call_id(), call))
            new.append((len(self.calls) - 1, *self.calls[-1]))
        content = self._held + delta.content
        self._held = ""
        if not self._shown and not content.strip():
            if final and not self.calls:
                return content, new
            self._held = "" if final else content
            return "", new
        self._shown = True
        return content, new

    def feed(self, text: str) -> tuple[str, list[tuple[int, str, ToolCall]]]:
        return self._take(self.parser.feed(text), False) if text else ("", [])

    def finish(self) -> tuple[str, list[tuple[int, str, ToolCall]]]:
        return self._take(self.parser.finish(), True)

    def whole(self, text: str) -> tuple[str | None, list[tuple[int, str, ToolCall]]]:
        """The full output at once: (content, or None when there are only calls; calls)."""
        content, calls = self.feed(text)
        rest, more = self.finish()
        content += rest
        return (None if self.calls and not content else content), calls + more


def finish_reason(reason: str | None, calls: ChoiceCalls | None) -> str | None:
    """OpenAI's `tool_calls` when the model stopped after calling; a length cut stays `length`."""
    if calls is not None and calls.calls and reason == "stop":
        return "tool_calls"
    return reason


# --- the generic format's parser -------------------------------------------------------------


class GenericJSONParser(ToolParser):
    """The generic rendering's format: an answer that is only a JSON array of
    ``{"name": ..., "arguments": {...}}`` objects is calls; anything else is content. Text that
    starts with ``[`` is held until the output ends (it may be the array)."""

    name = "generic"

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._held = ""
        self._plain = False  # the output has shown it is not an array of calls

    @classmethod
    def matches(cls, chat_template: str | None, family: str | None) -> bool:
        return not template_takes_tools(chat_template)

    def feed(self, text: str) -> ParseDelta:
        if self._plain:
            return ParseDelta(text)
        self._held += text
        start = self._held.lstrip()
        if not start or start.startswith("["):
            return ParseDelta()
        self._plain, out, self._held = True, self._held, ""
        return ParseDelta(out)

    def finish(self) -> ParseDelta:
        text, self._held = self._held, ""
        if self._plain or not text.strip():
            return ParseDelta(text)
        items = loads_or_none(text)
        if not isinstance(items, list) or not items:
            return ParseDelta(text)
        calls = []
        for item in items:
            call = self.call_from_json(json.dumps(item)) if isinstance(item, dict) else None
            if call is None:
                return ParseDelta(text)  # not all calls: the whole answer stays text
            calls.append(call)
        return ParseDelta("", calls)
