"""Mistral tool calls, after the ``[TOOL_CALLS]`` control token, in either of its two forms::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is the v3 tokenizers' (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo), the second the
v11+ ones' (Mistral Small 3.2, Magistral, Devstral), which may also write ``[CALL_ID]id`` before
``[ARGS]``. The markers are special tokens: the text must keep them (no skip_special_tokens).
"""

from __future__ import annotations

from lmstack_api.tool_parsers.base import (
    BufferedParser,
    ParseDelta,
    ToolCall,
    loads_or_none,
    skip_space,
)

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
GAP, TEXT, CALLS = "gap", "text", "calls"  # GAP: the output's start or after calls
NEED = "need"  # the text so far may still become a call


def _name_char(c: str) -> bool:
    return c.isalnum() or c in "_-."


class MistralParser(BufferedParser):
    """Mistral: `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` per call.

    In the list, each call is ``{"name", "arguments"}`` (an ``"id"`` is ignored). The marker and what follows stay content when that is not a complete
    call of the request's tools (a list with one bad entry stays content whole)."""

    name = "mistral"

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self.state = GAP

    @classmethod
    def matches(cls, chat_template: str | None, family: str | None) -> bool:
        if chat_template is not None:
            return MARKER in chat_template
        return family is not None and family.lower().startswith(("mistral", "mixtral", "ministral"))

    def held(self) -> str:
        return MARKER if self.state == CALLS else ""

    def advance(self, final: bool) -> ParseDelta:
        out, buf, i = ParseDelta(), self.buffer, 0
        while i < len(buf):
            if self.state == CALLS:  # just after a marker
                found = self._calls(buf, i)
                if found == NEED:
                    break
                calls, end = found
                if calls:
                    out.calls.extend(calls)
                    self.state = GAP
                else:
                    out.content += MARKER + buf[i:end]
                    self.state = TEXT
                i = end
            elif self.state == GAP:
                i, stop = self.after_calls(buf, i, MARKER, CALLS, final, out)
                if stop:
                    break
            else:
                i, stop = self.in_text(buf, i, MARKER, CALLS, final, out)
                if stop:
                    break
        self.buffer = buf[i:]
        return out

    def _calls(self, buf: str, i: int) -> tuple[list[ToolCall], int] | str:
        """The calls after a marker at `i` and where they end (no calls: that text is
        content), or NEED."""
        k = skip_space(buf, i)
        if k == len(buf):
            return NEED
        if buf[k] != "[":
            return self._named_call(buf, k)
        end = self.closing(buf, k)
        if end is None:
            return NEED
        items = loads_or_none(buf[k:end])
        if not isinstance(items, list):
            return [], end
        calls = [self.call_from_obj(item, ignored=("id",)) for item in items]
        if not calls or any(c is None for c in calls):
            return [], end
        return [c for c in calls if c is not None], end

    def _named_call(self, buf: str, k: int) -> tuple[list[ToolCall], int] | str:
        """``name[CALL_ID]id[ARGS]{...}`` at `k` (the call id optional)."""
        j = k
        while j < len(buf) and _name_char(buf[j]):
            j += 1
        if j == len(buf):
            return NEED
        name = buf[k:j]
        if buf.startswith(CALL_ID, j):
            j += len(CALL_ID)
            while j < len(buf) and buf[j].isalnum():
                j += 1
        elif CALL_ID.startswith(buf[j:]):
            return NEED
        if not buf.startswith(ARGS, j):
            return NEED if ARGS.startswith(buf[j:]) else ([], j)
        j = skip_space(buf, j + len(ARGS))
        if j == len(buf):
            return NEED
        if buf[j] != "{":
            return [], j
        end = self.closing(buf, j)
        if end is None:
            return NEED
        args = loads_or_none(buf[j:end])
        call = self.make_call(name, args) if isinstance(args, dict) else None
        return ([call], end) if call is not None else ([], end)
