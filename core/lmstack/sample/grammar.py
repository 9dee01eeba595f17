"""Structured output: grammars compiled with xgrammar from a JSON schema (or any JSON object),
a regular expression, an EBNF grammar or a list of choices.

`GrammarCompiler` turns a schema into a `Grammar` (compiled once, cached, shared by every request
that uses the same schema); each sequence gets its own `GrammarState`, which the sampler asks to
mask that sequence's logits row before anything else touches it. Other rows of the batch are
never read or written.

xgrammar is optional (`pip install lmstack[structured]`): it is imported inside the functions
that need it, so the core imports and serves plain requests without it.

Whitespace: schemas are compiled with ``any_whitespace=False``: the JSON is written on one line
with fixed separators (``", "`` and ``": "``). With free whitespace a small model can put its
probability mass on spaces and newlines between tokens and loop there until max_tokens; a fixed
layout removes that failure mode and costs nothing in validity.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from lmstack.errors import InvalidRequestError

_SCHEMA_PARAM = "response_format.json_schema.schema"
_NEG_INF = float("-inf")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise InvalidRequestError(
            "structured output needs the xgrammar package: pip install xgrammar", param="response_format"
        ) from e
    return xgrammar


def error_reason(exc: BaseException) -> str:
    """xgrammar's C++ errors carry a '[time] file.cc:line:' prefix and check text: keep the reason."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    msg = lines[0] if lines else type(exc).__name__
    msg = re.sub(r"^\[[\d:.]+\]\s+\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: .*? is false:\s*", "", msg)
    return msg


class GrammarError(ValueError):
    """A sequence's tokens left its grammar (raised by `GrammarState.apply`)."""


class CacheInfo(NamedTuple):
    hits: int
    misses: int  # = number of compilations
    size: int
    max_size: int
    bytes: int = 0  # xgrammar's size estimate of the cached grammars
    max_bytes: int | None = None


class PreparedSchema(NamedTuple):
    """A grammar source checked and canonicalised for compiling: `key` names its cache entry,
    `text` is what xgrammar compiles as `kind` ("json" schema, "regex" or "ebnf"), `param` is the
    request field a compile error is reported against."""

    key: str
    text: str
    strict: bool
    kind: str = "json"
    param: str = _SCHEMA_PARAM


# What each kind of source is called in error messages.
KIND_NOUNS = {"json": "JSON schema", "regex": "regex", "ebnf": "grammar"}


def compile_source(compiler: Any, kind: str, text: str, strict: bool) -> Any:
    """`text` compiled by an xgrammar GrammarCompiler as `kind` (xgrammar's exceptions pass through)."""
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=strict)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(_xgrammar().Grammar.from_ebnf(text))
    raise ValueError(f"unknown grammar kind {kind!r}")


def ebnf_literal(text: str) -> str:
    """`text` as an xgrammar EBNF string literal (JSON's escapes are EBNF's)."""
    return json.dumps(text, ensure_ascii=False)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices) + "\n"


def count_properties(schema: Any) -> int:
    """Entries of every `properties` map in `schema`, nested ones included (iterative, so a
    deeply nested schema cannot exhaust the stack here)."""
    total, todo = 0, [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                total += len(props)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return total


class GrammarCompiler:
    """Compiles grammars for one tokenizer. Thread-safe. Compiled grammars are kept in an LRU
    cache keyed by the schema's compact JSON (a dict and its JSON text, however spaced, share an
    entry) and the strict flag, bounded by entry count and (`limit_cache`) by bytes."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], *, cache_size: int = 128
    ) -> None:
        xgr = _xgrammar()
        pieces = tokenizer.byte_pieces
        if callable(pieces):
            pieces = pieces()
        if pieces is None:
            raise InvalidRequestError(
                "structured output needs a byte-level BPE tokenizer; this model's tokenizer is not one",
                param="response_format",
            )
        pieces = list(pieces[:vocab_size])
        # An empty piece makes xgrammar treat the token as special (never allowed by a grammar):
        # control tokens such as <|im_start|> must not be written inside the JSON. Ids between
        # the tokenizer's and the model's vocabulary size (padding) are special too.
        for i in getattr(tokenizer, "special_token_ids", ()):
            if i < len(pieces):
                pieces[i] = b""
        self.stop_token_ids = tuple(sorted(set(stop_token_ids)))
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo(
            pieces, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(self.stop_token_ids)
        )
        # xgrammar's own cache is off: ours bounds the entries and keeps object identity.
        self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._max_size = cache_size
        self._max_bytes: int | None = None
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def limit_cache(self, max_bytes: int | None) -> None:
        """Bound the cache by xgrammar's size estimate of its grammars (None: entries only)."""
        with self._lock:
            self._max_bytes = max_bytes
            self._evict()

    def tokenizer_info_json(self) -> str:
        """The xgrammar tokenizer description, for compiling in another process."""
        return self._info.serialize_json()

    def json_schema(self, schema: dict | str, *, strict: bool = True) -> Grammar:
        """A grammar for JSON documents valid under `schema` (a dict, or its JSON text). `strict`
        forbids properties the schema does not list (xgrammar's strict mode). Raises
        InvalidRequestError (param ``response_format.json_schema.schema``) for an invalid schema."""
        prepared = self.prepare(schema, strict=strict)
        return self.lookup(prepared) or self.compile(prepared)

    def prepare(
        self,
        schema: dict | str,
        *,
        strict: bool = True,
        max_bytes: int | None = None,
        max_properties: int | None = None,
    ) -> PreparedSchema:
        """Check and canonicalise `schema` without compiling it; InvalidRequestError when it is
        not a JSON object or is larger than `max_bytes` (compact JSON) / `max_properties`."""
        if isinstance(schema, str | bytes):
            if max_bytes is not None and len(schema) > 4 * max_bytes:  # spacing aside, too big
                raise _too_big(len(schema), max_bytes)
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:
                raise InvalidRequestError(f"JSON schema is not valid JSON: {e}", param=_SCHEMA_PARAM) from e
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"JSON schema must be a JSON object, got {type(schema).__name__}", param=_SCHEMA_PARAM
            )
        try:
            # Compact, key order kept: properties are generated in the order the schema lists them,
            # so two schemas that differ only in that order are different grammars.
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise InvalidRequestError(
                f"JSON schema is not serialisable as JSON: {e}", param=_SCHEMA_PARAM
            ) from e
        if max_bytes is not None and len(text) > max_bytes:
            raise _too_big(len(text), max_bytes)
        if max_properties is not None and (n := count_properties(schema)) > max_properties:
            raise InvalidRequestError(
                f"JSON schema has {n} properties, more than this server's limit of {max_properties} "
                "(server.grammar_max_schema_properties)",
                param=_SCHEMA_PARAM,
            )
        return PreparedSchema(f"schema:{int(bool(strict))}:{text}", text, bool(strict))

    @staticmethod
    def prepare_source(kind: str, text: str, *, param: str, max_bytes: int | None = None) -> PreparedSchema:
        """A regex (`kind` "regex") or EBNF grammar ("ebnf", start rule `root`) ready to compile;
        InvalidRequestError naming `param` when it is empty or longer than `max_bytes`."""
        if kind not in ("regex", "ebnf"):
            raise ValueError(f"unknown grammar kind {kind!r}")
        if not text:
            raise InvalidRequestError(f"the {KIND_NOUNS[kind]} must not be empty", param=param)
        size = len(text.encode())
        if max_bytes is not None and size > max_bytes:
            raise InvalidRequestError(
                f"the {KIND_NOUNS[kind]} is {size} bytes, more than this server's limit of {max_bytes} "
                "bytes (server.grammar_max_schema_bytes)",
                param=param,
            )
        return PreparedSchema(f"source:{kind}:{text}", text, False, kind, param)

    def lookup(self, prepared: PreparedSchema) -> Grammar | None:
        """The cached grammar for `prepared`, or None (counted as a hit when found)."""
        with self._lock:
            g = self._cache.get(prepared.key)
            if g is not None:
                self._cache.move_to_end(prepared.key)
                self._hits += 1
            return g

    def compile(self, prepared: PreparedSchema) -> Grammar:
        """Compile `prepared` here (blocking; no bound) and cache it."""

        def build():
            try:
                return compile_source(self._compiler, prepared.kind, prepared.text, prepared.strict)
            except (RuntimeError, ValueError, TypeError) as e:
                raise InvalidRequestError(
                    f"invalid {KIND_NOUNS[prepared.kind]}: {error_reason(e)}", param=prepared.param
                ) from e

        return self._get(prepared.key, build)

    def json_object(self) -> Grammar:
        """A grammar for any JSON object (OpenAI's ``response_format: {type: json_object}``)."""

        def build():
            # An object schema without properties; strict mode off so any keys are allowed.
            return self._compiler.compile_json_schema(
                '{"type":"object"}', any_whitespace=False, strict_mode=False
            )

        return self._get("json_object", build)

    def ebnf(self, text: str, *, root: str = "root", param: str = "grammar") -> Grammar:
        """A grammar from xgrammar EBNF text whose start rule is `root` (compiled here, blocking,
        and cached). Raises InvalidRequestError naming `param` when xgrammar rejects the text."""

        def build():
            xgr = _xgrammar()
            try:
                return self._compiler.compile_grammar(xgr.Grammar.from_ebnf(text, root_rule_name=root))
            except (RuntimeError, ValueError, TypeError) as e:
                raise InvalidRequestError(f"invalid grammar: {error_reason(e)}", param=param) from e

        return self._get(f"ebnf:{root}:{text}", build)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(
                self._hits, self._misses, len(self._cache), self._max_size, self._bytes, self._max_bytes
            )

    def _get(self, key: str, build) -> Grammar:
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return g
        # Compile outside the lock: one slow schema does not hold up others. Two threads may
        # compile the same new schema at once; the first to finish wins and both get its object.
        compiled = build()
        with self._lock:
            g = self._cache.get(key)
            if g is None:
                self._misses += 1
                g = self._cache[key] = Grammar(compiled, self)
                self._bytes += g.nbytes
            else:
                self._hits += 1
            self._cache.move_to_end(key)
            self._evict()
            return g

    def _evict(self) -> None:
        # Oldest first; a grammar larger than the whole budget is evicted too (its requests
        # keep their reference, so it lives exactly as long as they do).
        while self._cache and (
            len(self._cache) > self._max_size
            or (self._max_bytes is not None and self._bytes > self._max_bytes)
        ):
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.nbytes


def _too_big(size: int, limit: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"JSON schema is {size} bytes, more than this server's limit of {limit} bytes "
        "(server.grammar_max_schema_bytes)",
        param=_SCHEMA_PARAM,
    )


class Grammar:
    """A compiled grammar: immutable, shared by every request (and thread) that uses it."""

    def __init__(self, compiled: Any, compiler: GrammarCompiler) -> None:
        self._compiled = compiled
        # xgrammar's estimate of the compiled grammar's memory (0 where it has none).
        self.nbytes = int(getattr(compiled, "memory_size_bytes", 0) or 0)
        self.vocab_size = compiler.vocab_size
        self.stop_token_ids = frozenset(compiler.stop_token_ids)

    def new_state(self) -> GrammarState:
        return GrammarState(self)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return t


class GrammarState:
    """One sequence's position in a grammar. Not thread-safe (one sequence, one engine thread)."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self._matcher = self._new_matcher()
        self._tokens: list[int] = []  # the output tokens the state has consumed
        # How many of them the matcher accepted; tokens past that are stop tokens sampled after the
        # grammar terminated (possible with ignore_eos), which the matcher itself would refuse.
        self._matched = 0
        self._bitmask = _xgrammar().allocate_token_bitmask(1, grammar.vocab_size)

    def _new_matcher(self):
        return _xgrammar().GrammarMatcher(self.grammar._compiled)

    def apply(self, logits: torch.Tensor, output_ids: list[int]) -> None:
        """Sync to exactly `output_ids` (this sequence's generated tokens so far), then set to -inf,
        in place, every entry of `logits` [V] the grammar forbids next. Raises GrammarError (a ValueError) if
        `output_ids` holds a token the grammar rejects (the state is then left at the longest
        accepted prefix)."""
        self._sync(output_ids)
        if self._matcher.is_terminated():  # grammar complete and a stop token taken: stops only
            keep = torch.tensor(sorted(self.grammar.stop_token_ids), dtype=torch.long, device=logits.device)
            allowed = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
            allowed[keep[keep < logits.shape[0]]] = True
        else:
            # False means "everything allowed"; older xgrammar returns None, so test for False.
            if self._matcher.fill_next_token_bitmask(self._bitmask) is False:
                return
            words = self._bitmask[0].to(logits.device)
            allowed = ((words.unsqueeze(-1) >> _bit_shifts(logits.device)) & 1).bool().flatten()
            n = min(logits.shape[0], allowed.shape[0])
            if n < logits.shape[0]:  # ids past the grammar's vocabulary are never allowed
                allowed = torch.cat([allowed[:n], allowed.new_zeros(logits.shape[0] - n)])
            else:
                allowed = allowed[:n]
        logits.masked_fill_(~allowed, _NEG_INF)

    def _sync(self, output_ids: list[int]) -> None:
        have = self._tokens
        k = len(have)
        if output_ids[:k] != have:  # diverged (rejected drafts, a rewrite): keep the common prefix
            k = self._common_prefix(have, output_ids)
        if k < len(have):
            self._rollback_to(k)
        for tok in output_ids[k:]:
            self._accept(tok)

    @staticmethod
    def _common_prefix(a: list[int], b: list[int]) -> int:
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return i
        return min(len(a), len(b))

    def _rollback_to(self, k: int) -> None:
        if k < self._matched:
            try:
                self._matcher.rollback(self._matched - k)
            except Exception:  # rollback unsupported or out of range: rebuild by replay
                self._matcher = self._new_matcher()
                for tok in self._tokens[:k]:
                    self._matcher.accept_token(tok)
            self._matched = k
        del self._tokens[k:]

    def _accept(self, tok: int) -> None:
        if not self._matcher.is_terminated():
            if not self._matcher.accept_token(tok):
                raise GrammarError(
                    f"token {tok} at output position {len(self._tokens)} is not allowed by the grammar"
                )
            self._matched += 1
        elif tok not in self.grammar.stop_token_ids:
            raise GrammarError(
                f"token {tok} at output position {len(self._tokens)} follows the end of the grammar"
            )
        self._tokens.append(tok)
