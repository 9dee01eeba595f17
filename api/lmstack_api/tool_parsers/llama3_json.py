"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the output is the call, one JSON object, optionally
after ``<|python_tag|>``; several are separated by ``;``::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}
"""

from __future__ import annotations

import re

from lmstack_api.tool_parsers.base import BufferedParser, ParseDelta, skip_space

TAG = "<|python_tag|>"
START, AFTER, TEXT = "start", "after", "text"  # START: the output's start, or just after the tag
# Llama 3's templates ask for `{"name": function name, "parameters": dictionary ...}` (the
# quotes escaped inside the Jinja string).
_TEMPLATE = re.compile(r'\\?"name\\?": function name, \\?"parameters\\?"')


class Llama3JsonParser(BufferedParser):
    """Llama 3.x: `{"name", "parameters"}` first or after `<|python_tag|>`, `;` between calls.

    ``"arguments"`` is read as well as ``"parameters"``. A JSON object later in the text
    is content: Llama 3 puts calls first. So is an object that is not exactly a call (other
    keys, no arguments), names a function not in the request's tools, or never closes."""

    name = "llama3_json"

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self.state = START
        self.tag = ""  # the tag that opened START: content again if no call follows it

    @classmethod
    def matches(cls, chat_template: str | None, family: str | None) -> bool:
        if chat_template is not None:
            return TAG in chat_template or _TEMPLATE.search(chat_template) is not None
        if family is None:
            return False
        family = family.lower()
        return family.startswith("llama") and not family.startswith("llama4")

    def held(self) -> str:
        return self.tag

    def advance(self, final: bool) -> ParseDelta:
        out, buf, i = ParseDelta(), self.buffer, 0
        while i < len(buf):
            if self.state == TEXT:
                i, stop = self.in_text(buf, i, TAG, START, final, out)
                if stop:
                    break
                self.tag = TAG
                continue
            # START or AFTER: whitespace (and after a call, one `;`), then maybe a call.
            k = skip_space(buf, i)
            separated = self.state == AFTER and k < len(buf) and buf[k] == ";"
            if separated:
                k = skip_space(buf, k + 1)
            if k == len(buf):
                if final:  # whitespace alone only separated the calls from the end
                    out.content += self.tag + buf[i:] if separated or self.tag else ""
                    i, self.tag = len(buf), ""
                break
            if buf[k] != "{" or (self.state == AFTER and not separated):
                # The held tag, whitespace and `;` are content, with what follows.
                out.content += self.tag
                self.state, self.tag = TEXT, ""
                continue
            end = self.closing(buf, k)
            if end is None:
                break
            call = self.call_from_json(buf[k:end], args_keys=("parameters", "arguments"), require_args=True)
            if call is not None:
                out.calls.append(call)
                self.state = AFTER
            else:
                out.content += self.tag + buf[i:end]
                self.state = TEXT
            i, self.tag = end, ""
        self.buffer = buf[i:]
        return out
