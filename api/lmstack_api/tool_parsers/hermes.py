"""Hermes / Qwen2.5 / Qwen3 tool calls: each call one JSON object between tags, several in a row::

<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
"""

from __future__ import annotations

from lmstack_api.tool_parsers.base import BufferedParser, ParseDelta

START, END = "<tool_call>", "</tool_call>"
GAP, TEXT, CALL = "gap", "text", "call"  # GAP: at the output's start or after a call


class HermesParser(BufferedParser):
    """Hermes, Qwen2.5, Qwen3: `<tool_call>{"name", "arguments"}</tool_call>`, several in a row.

    ``"parameters"`` is read as well as ``"arguments"``. A block whose JSON is malformed, or that names a function not
    in the request's tools, stays content, tags included; so does one the output leaves open."""

    name = "hermes"

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self.state = GAP

    @classmethod
    def matches(cls, chat_template: str | None, family: str | None) -> bool:
        if chat_template is not None:
            return START in chat_template
        return family is not None and family.lower().startswith(("qwen", "hermes"))

    def held(self) -> str:
        return START if self.state == CALL else ""

    def advance(self, final: bool) -> ParseDelta:
        out, buf, i = ParseDelta(), self.buffer, 0
        while i < len(buf):
            if self.state == CALL:
                j = buf.find(END, i)
                if j < 0:
                    break
                call = self.call_from_json(buf[i:j].strip(), args_keys=("arguments", "parameters"))
                if call is not None:
                    out.calls.append(call)
                    self.state = GAP
                else:
                    out.content += START + buf[i:j] + END
                    self.state = TEXT
                i = j + len(END)
            elif self.state == GAP:
                i, stop = self.after_calls(buf, i, START, CALL, final, out)
                if stop:
                    break
            else:
                i, stop = self.in_text(buf, i, START, CALL, final, out)
                if stop:
                    break
        self.buffer = buf[i:]
        return out
