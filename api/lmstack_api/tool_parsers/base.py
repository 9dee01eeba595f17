"""What a tool-call parser is: it reads a model's generated text as it streams and splits it into
plain content and complete tool calls.

One parser instance follows one generated choice. `feed(text)` takes the next text delta and
returns what is now certain: content that cannot be the start of a call, and calls whose text
is complete. `finish()` ends the output: whatever was held back (a call that never closed, a
marker's prefix) comes back as content. A parser never returns half a call, and parsing the text
whole or in any pieces gives the same content and calls (`lmstack.testing.ToolParserConformance`
checks both).

Content is the text outside calls, verbatim, except the whitespace that only separates calls
from each other or from the output's start or end (and a format's separators and markers). A
call naming a function that is not in the request's `tools`, or whose arguments are not a JSON
object, is not a call: its text stays content.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One complete call: the function's name and its arguments as compact JSON text
    (`json.dumps(args, separators=(",", ":"), ensure_ascii=False)`), as OpenAI's
    `function.arguments` carries them."""

    name: str
    arguments: str


@dataclass
class ParseDelta:
    """What one `feed` / `finish` makes certain: plain text, and the calls completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: ParseDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolParser(ABC):
    """Base of every tool-call parser, built-in or a plugin's (registered through the
    `lmstack_register_tool_parsers(register)` hook: ``register(MyParser)``).

    `name` is what `server.tool_parser` selects; `matches` says whether the parser fits a model
    that did not name one, from its chat template's text or its family (the Hugging Face
    `model_type` or architecture, e.g. ``qwen2``, ``Qwen2ForCausalLM``)."""

    name: ClassVar[str]

    def __init__(self, tools: list[dict]) -> None:
        """`tools`: the request's `tools`, OpenAI's shape (``{"type": "function", "function":
        {"name": ..., "parameters": {...}}}``)."""
        self.tool_names = frozenset(_tool_name(t) for t in tools or ())

    @classmethod
    @abstractmethod
    def matches(cls, chat_template: str | None, family: str | None) -> bool:
        """Whether this parser reads the calls of a model with this chat template (its Jinja
        text) or family; either may be None (unknown)."""

    @abstractmethod
    def feed(self, text: str) -> ParseDelta:
        """The next text delta: the content and calls it makes certain."""

    @abstractmethod
    def finish(self) -> ParseDelta:
        """The output ended: the rest (an unterminated or malformed call) as content."""

    # --- helpers for parsers ------------------------------------------------------------------

    def make_call(self, name: Any, arguments: Any) -> ToolCall | None:
        """A `ToolCall` when `name` is one of the request's tools and `arguments` a JSON object
        (a dict, or JSON text of one, which some models write); None otherwise (the text stays
        content)."""
        if not isinstance(name, str) or name not in self.tool_names:
            return None
        if isinstance(arguments, str):
            arguments = loads_or_none(arguments)
            if arguments is None:
                return None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None
        try:  # a pythonic call's values may be no JSON (a set, bytes, NaN): not a call then
            text = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            return None
        return ToolCall(name, text)

    def call_from_json(self, text: str, **how: Any) -> ToolCall | None:
        """A call from one JSON object ``{"name": ..., "arguments": {...}}``; None when the text
        is not one. `how`: as `call_from_obj`."""
        return self.call_from_obj(loads_or_none(text), **how)

    def call_from_obj(
        self,
        obj: Any,
        args_keys: tuple[str, ...] = ("arguments",),
        require_args: bool = False,
        ignored: tuple[str, ...] = (),
    ) -> ToolCall | None:
        """A call from a decoded JSON object: its ``name`` and its arguments under one of
        `args_keys` (missing: none, unless `require_args`); None when it is not one (other
        keys than these and `ignored` mean some other JSON, not a call)."""
        if not isinstance(obj, dict) or "name" not in obj:
            return None
        keys = [k for k in args_keys if k in obj]
        if set(obj) - {"name", *args_keys, *ignored} or len(keys) > 1 or (require_args and not keys):
            return None
        return self.make_call(obj["name"], obj[keys[0]] if keys else {})


class BufferedParser(ToolParser):
    """A parser over a buffer of the text not yet decided: `advance(final)` consumes what it can
    decide from `self.buffer` (all of it when `final`) and says what came of it. Deciding only
    from the buffered text, never from how it arrived, is what makes any split parse the same."""

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self.buffer = ""
        self.offset = 0  # where `buffer` starts in the whole output
        self._scan: BracketScan | None = None

    def feed(self, text: str) -> ParseDelta:
        self.buffer += text
        return self._advance(final=False)

    def finish(self) -> ParseDelta:
        out = self._advance(final=True)
        # What is still undecided never became a call: the marker that opened it and the rest.
        out.content += self.held() + self.buffer
        self.buffer = ""
        return out

    @abstractmethod
    def advance(self, final: bool) -> ParseDelta:
        """Consume the decided part of `self.buffer` into content and calls (`final`: the output
        ended; a call still open may be left in the buffer, `finish` makes it content)."""

    def held(self) -> str:
        """Text consumed from the buffer but not yet decided (the marker of an open call)."""
        return ""

    def closing(self, buf: str, start: int, quotes: str = '"') -> int | None:
        """`scan_balanced(buf, start, quotes)` resumed where the previous call for the same value
        stopped: each character of a long call is scanned once, however finely it streams in."""
        at = self.offset + start
        scan = self._scan
        if scan is None or scan.start != at or scan.quotes != quotes:
            scan = self._scan = BracketScan(at, quotes)
        end = scan.run(buf, self.offset)
        if end is None:
            return None
        self._scan = None
        return end - self.offset

    # The two states a marker-opened format shares (hermes, mistral; "text" also llama3_json and
    # pythonic): "gap" (the output's start, or just after calls) and "text"; `opened` is the
    # parser's state once `marker` is read. Each returns where the buffer is consumed to, and
    # whether to stop until more text comes.

    def after_calls(
        self, buf: str, i: int, marker: str, opened: str, final: bool, out: ParseDelta
    ) -> tuple[int, bool]:
        """State "gap" at `i`: whitespace here is content only if text (not a call, not the
        end) follows it."""
        k = skip_space(buf, i)
        if buf.startswith(marker, k):
            self.state = opened
            return k + len(marker), False
        if k == len(buf) or marker.startswith(buf[k:]):
            if final:
                out.content += buf[i:] if k < len(buf) else ""
                i = len(buf)
            return i, True
        self.state = "text"
        return i, False

    def in_text(
        self, buf: str, i: int, marker: str, opened: str, final: bool, out: ParseDelta
    ) -> tuple[int, bool]:
        """State "text" at `i`: content up to the next `marker` (holding back a possible start
        of one unless `final`)."""
        j, found = find_marker(buf, (marker,), i)
        if found is None:
            end = len(buf) if final else j
            out.content += buf[i:end]
            return end, True
        out.content += buf[i:j]
        self.state = opened
        return j + len(marker), False

    def _advance(self, final: bool) -> ParseDelta:
        size = len(self.buffer)
        out = self.advance(final)
        self.offset += size - len(self.buffer)  # advance only drops a prefix of the buffer
        return out


def _tool_name(tool: Any) -> str | None:
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    if isinstance(function, dict):
        return function.get("name")
    return tool.get("name")  # a bare function definition


def loads_or_none(text: str) -> Any:
    """The JSON value of `text`, or None when it is none (malformed, or nested past Python's
    recursion limit: a model may write anything)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


# ---------------------------------------------------------------------------------------------
# Scanning helpers: where a marker starts, where a bracketed value ends.
# ---------------------------------------------------------------------------------------------


def find_marker(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """The first full marker at or after `start`: ``(index, marker)``. With none,
    ``(safe, None)``: the text before `safe` cannot be part of a marker, the rest (a proper
    prefix of one) must wait for more text."""
    best, found = -1, None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, marker
    if found is not None:
        return best, found
    return len(text) - held_prefix(text, markers, start), None


def held_prefix(text: str, markers: tuple[str, ...], start: int = 0) -> int:
    """How many characters at the end of `text` (after `start`) are a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text) - start), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def scan_balanced(text: str, start: int, quotes: str = '"') -> int | None:
    """The index just past the bracket that closes the one at `text[start]` (``[``, ``{`` or
    ``(``, nested in any mix), skipping string literals quoted by any of `quotes` (with
    backslash escapes); None when the text ends first. A closing bracket of the wrong kind ends
    the value too (the caller's parse then fails and the text stays content)."""
    return BracketScan(start, quotes).run(text, 0)


class BracketScan:
    """`scan_balanced` that can stop at the end of the text and go on when more arrives.
    Positions are in the whole output; `run(text, base)` reads `text` as starting at `base`."""

    def __init__(self, start: int, quotes: str) -> None:
        self.start = self.pos = start
        self.quotes = quotes
        self.depth = 0
        self.quote: str | None = None
        self.escaped = False
        # Jump from one character that matters to the next (a long string is one search).
        self._outside = re.compile("[" + re.escape("[]{}()" + quotes) + "]")

    def run(self, text: str, base: int) -> int | None:
        """Where the value ends (a position in the whole output), or None: scanned up to the
        end of `text`, to be resumed."""
        i, n = self.pos - base, len(text)
        while i < n:
            if self.escaped:
                self.escaped, i = False, i + 1
            elif self.quote is not None:
                m = _INSIDE[self.quote].search(text, i)
                if m is None:
                    i = n
                    break
                i = m.end()
                if m.group() == "\\":
                    self.escaped = True
                else:
                    self.quote = None
            else:
                m = self._outside.search(text, i)
                if m is None:
                    i = n
                    break
                c, i = m.group(), m.end()
                if c in self.quotes:
                    self.quote = c
                elif c in "[{(":
                    self.depth += 1
                else:
                    self.depth -= 1
                    if self.depth == 0:
                        return base + i
        self.pos = base + i
        return None


_INSIDE = {q: re.compile("[" + re.escape("\\" + q) + "]") for q in "\"'"}


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
