"""The conformance kit for tool-call parsers (lmstack-api's `lmstack_register_tool_parsers`).

A parser turns a model's text into content and complete tool calls as the text streams in. The
kit feeds it a corpus of texts whole, split in two at every character boundary, one character
at a time and in seeded random pieces, and checks that every way gives the corpus's content and
calls, that what a parser has returned is never taken back (content only grows by what the
whole text yields, a call once returned is final) and that without tools nothing is a call::

    from lmstack.testing import ToolParserConformance

    class TestMyParser(ToolParserConformance):
        parser = MyParser                 # the class lmstack_register_tool_parsers registers
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}]
        corpus = [
            # (text, expected content, expected calls as (name, arguments))
            ("<call>get_weather {\\"city\\": \\"Paris\\"}</call>", "", [("get_weather", {"city": "Paris"})]),
            ("no call here", "no call here", []),
            ("<call>get_weather {oops</call>", "<call>get_weather {oops</call>", []),  # malformed
        ]

The kit knows parsers by their interface only: ``parser(tools)``, ``feed(text)`` and
``finish()`` returning objects with ``content`` (str) and ``calls`` (each with ``name`` and
``arguments``, JSON text of an object), and the class method ``matches(chat_template, family)``.
"""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

Corpus = list[tuple[str, str, list[tuple[str, dict[str, Any]]]]]

RANDOM_SPLITS = 20  # seeded random splits of each text into several pieces


class ToolParserConformance:
    """Set `parser` (the class), `tools` (a request's `tools`) and `corpus`; every check runs
    over every corpus entry and names the entry and the split that fails."""

    parser: ClassVar[Any] = None
    tools: ClassVar[list[dict[str, Any]]] = []
    corpus: ClassVar[Corpus] = []

    # --- running a parser --------------------------------------------------------------------------

    def parse(self, pieces: list[str], tools: list[dict[str, Any]] | None = None) -> tuple[str, list]:
        """Feed `pieces` then finish: the content and calls, checking after every step that
        nothing returned before is contradicted (the running content is a prefix of the whole
        text's, and so are the running calls)."""
        assert self.parser is not None, f"{type(self).__name__}.parser is not set"
        instance = self.parser(self.tools if tools is None else tools)
        content, calls = "", []
        for piece in [*pieces, None]:
            delta = instance.finish() if piece is None else instance.feed(piece)
            assert isinstance(delta.content, str), f"content is a {type(delta.content).__name__}"
            content += delta.content
            calls.extend(_call(c) for c in delta.calls)
        return content, calls

    def expected(self, entry: tuple) -> tuple[str, list]:
        text, content, calls = entry
        return content, [(name, dict(args)) for name, args in calls]

    def check(self, entry: tuple, pieces: list[str], how: str) -> None:
        text = entry[0]
        assert "".join(pieces) == text
        want_content, want_calls = self.expected(entry)
        instance = self.parser(self.tools)
        content, calls = "", []
        for step, piece in enumerate([*pieces, None]):
            delta = instance.finish() if piece is None else instance.feed(piece)
            content += delta.content
            calls.extend(_call(c) for c in delta.calls)
            where = (
                f"{how}, after piece {step} of {len(pieces)}" if piece is not None else f"{how}, at finish"
            )
            assert want_content.startswith(content), (
                f"{text!r} {where}: content so far {content!r} is not the start of {want_content!r}"
            )
            assert calls == want_calls[: len(calls)], (
                f"{text!r} {where}: calls so far {calls} are not the first of {want_calls} (a partial "
                "or wrong call was returned)"
            )
        assert content == want_content, f"{text!r} ({how}): content {content!r}, expected {want_content!r}"
        assert calls == want_calls, f"{text!r} ({how}): calls {calls}, expected {want_calls}"

    # --- the checks --------------------------------------------------------------------------------

    def test_corpus_is_given(self) -> None:
        assert self.parser is not None, f"{type(self).__name__}.parser is not set"
        assert self.corpus, f"{type(self).__name__}.corpus is empty: give texts with and without calls"
        assert isinstance(self.parser.name, str) and self.parser.name, "the parser needs a string `name`"
        for template, family in ((None, None), ("", None), (None, "")):
            assert isinstance(self.parser.matches(template, family), bool)

    def test_whole_text(self) -> None:
        for entry in self.corpus:
            self.check(entry, [entry[0]], "fed whole")

    def test_every_split_in_two(self) -> None:
        for entry in self.corpus:
            text = entry[0]
            for cut in range(1, len(text)):
                self.check(entry, [text[:cut], text[cut:]], f"split at {cut}")

    def test_one_character_at_a_time(self) -> None:
        for entry in self.corpus:
            self.check(entry, list(entry[0]), "one character at a time")

    def test_random_pieces(self) -> None:
        rng = random.Random(0)
        for entry in self.corpus:
            text = entry[0]
            for _ in range(RANDOM_SPLITS):
                cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
                pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
                self.check(entry, pieces, f"split at {cuts}")

    def test_empty_pieces_change_nothing(self) -> None:
        for entry in self.corpus:
            text = entry[0]
            pieces = [p for c in text for p in ("", c)] + [""]
            self.check(entry, pieces, "with empty pieces between characters")

    def test_calls_are_json_objects_of_the_tools(self) -> None:
        names = {_tool_name(t) for t in self.tools}
        for entry in self.corpus:
            instance = self.parser(self.tools)
            for delta in (instance.feed(entry[0]), instance.finish()):
                for call in delta.calls:
                    assert call.name in names, f"{entry[0]!r}: call of {call.name!r}, not one of the tools"
                    assert isinstance(call.arguments, str)
                    assert isinstance(json.loads(call.arguments), dict), call.arguments

    def test_without_tools_the_text_is_content(self) -> None:
        """A call of a function the request does not offer is no call: with no tools, every text
        that is not only whitespace comes back as content, unchanged."""
        for entry in self.corpus:
            text = entry[0]
            if not text.strip():
                continue
            for pieces, how in (([text], "whole"), (list(text), "one character at a time")):
                content, calls = self.parse(pieces, tools=[])
                assert calls == [], f"{text!r} ({how}) without tools: calls {calls}"
                assert content == text, f"{text!r} ({how}) without tools: content {content!r}"


def _call(call: Any) -> tuple[str, dict[str, Any]]:
    arguments = json.loads(call.arguments)
    return call.name, arguments


def _tool_name(tool: dict[str, Any]) -> str | None:
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else tool.get("name")
