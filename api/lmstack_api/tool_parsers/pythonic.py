"""Pythonic tool calls (Llama 4, Llama 3.2 with a pythonic template): the output is a Python list
of calls with keyword arguments, optionally between ``<|python_start|>`` and ``<|python_end|>``::

    [get_weather(city="Paris", days=3), get_time(zone='UTC')]

The list is read with `ast`, never evaluated: the arguments must be literals (strings, numbers,
True / False / None, or JSON's true / false / null, and lists and dicts of them).
"""

from __future__ import annotations

import ast
import re
from typing import Any

from lmstack_api.tool_parsers.base import (
    BufferedParser,
    ParseDelta,
    ToolCall,
    skip_space,
)

START_TAG, END_TAG = "<|python_start|>", "<|python_end|>"
START, AFTER, TEXT = "start", "after", "text"  # START: output start or after the start tag
_JSON_NAMES = {"true": True, "false": False, "null": None}
# vLLM's and Meta's pythonic templates spell the format out: "[func_name1(params_name1=...".
_TEMPLATE = re.compile(r"\[func_name1\(")


class PythonicParser(BufferedParser):
    """Llama 4, Llama 3.2 pythonic: `[f(a=1, b="x"), g()]` first, literal arguments only.

    The list may follow ``<|python_start|>``. A list later in the text is content (the model writes its calls first); so is a list that is
    not all calls of the request's tools with literal keyword arguments, or that never closes."""

    name = "pythonic"

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self.state = START
        self.tag = ""  # the start tag that opened START: content again if no call follows it

    @classmethod
    def matches(cls, chat_template: str | None, family: str | None) -> bool:
        if chat_template is not None:
            return START_TAG in chat_template or _TEMPLATE.search(chat_template) is not None
        return family is not None and family.lower().startswith("llama4")

    def held(self) -> str:
        return self.tag

    def advance(self, final: bool) -> ParseDelta:
        out, buf, i = ParseDelta(), self.buffer, 0
        while i < len(buf):
            if self.state == TEXT:
                i, stop = self.in_text(buf, i, START_TAG, START, final, out)
                if stop:
                    break
                self.tag = START_TAG
                continue
            # START or AFTER: whitespace, then maybe a list of calls.
            k = skip_space(buf, i)
            if self.state == AFTER:  # the end tag after a list is the format's, not content
                if buf.startswith(END_TAG, k):
                    i = k + len(END_TAG)
                    continue
                if k < len(buf) and END_TAG.startswith(buf[k:]) and not final:
                    break
            if k == len(buf):
                if final:  # whitespace alone only separated the calls from the end
                    out.content += self.tag + buf[i:] if self.tag else ""
                    i, self.tag = len(buf), ""
                break
            if buf[k] != "[":
                # The held tag and whitespace are content, with what follows.
                out.content += self.tag
                self.state, self.tag = TEXT, ""
                continue
            end = self.closing(buf, k, quotes="'\"")
            if end is None:
                break
            calls = self._calls(buf[k:end])
            if calls:
                out.calls.extend(calls)
                self.state = AFTER
            else:
                out.content += self.tag + buf[i:end]
                self.state = TEXT
            i, self.tag = end, ""
        self.buffer = buf[i:]
        return out

    def _calls(self, text: str) -> list[ToolCall]:
        """The calls in a list's text; empty when it is not a list of calls of the tools."""
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return []
        if not isinstance(tree, ast.List) or not tree.elts:
            return []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return []
            try:
                args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return []
            call = self.make_call(node.func.id, args) if len(args) == len(node.keywords) else None
            if call is None:
                return []
            calls.append(call)
        return calls


def _literal(node: ast.expr) -> Any:
    """A literal's value; JSON's true / false / null as Python's. Anything else raises."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):  # {**other}
            raise ValueError("not a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)
