"""Text <-> token ids, and chat templates, for a model from a GGUF file or a Hugging Face folder.

The heavy lifting is the `tokenizers` library. From a GGUF file we rebuild the tokenizer the way
llama.cpp runs it: for `tokenizer.ggml.model` "gpt2", a byte-level BPE from the stored tokens and
merges, with the pre-tokenizer named by `tokenizer.ggml.pre` (Llama 3, Qwen, Phi-4-mini,
SmolLM2); for "llama", SentencePiece's BPE from the stored tokens and scores (Llama 2, Mistral,
Gemma, Phi-3). From a Hugging Face folder we load `tokenizer.json` as is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from lmstack.errors import ConfigError, InvalidRequestError

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL = 1
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4
_BYTE = 6
# SentencePiece's word-boundary mark: spaces are spelled with it in the vocabulary.
_SPM_SPACE = "\u2581"

# Pre-tokenizer split regexes, by `tokenizer.ggml.pre`, as llama.cpp applies them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's split, Phi-4-mini's: case-aware words with their contraction, digits by threes.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {
    "gpt-4o": _GPT4O_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp runs these as "\p{N}" (every digit alone) and then the GPT-2 regex. That is the
# original tokenizer.json of these models too (SmolLM2: Digits(individual_digits) + ByteLevel).
_DIGITS_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
# GPT-2's own regex (llama.cpp's default when a file names none).
_GPT2_PRE = frozenset({None, "default", "gpt-2", "gpt2"})
KNOWN_PRE_TOKENIZERS = sorted(p for p in _GPT2_PRE | _DIGITS_PRE | set(_SPLIT_PRE) if p is not None)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _byte_level_spelling(token: str) -> str:
    """A token as a byte-level vocabulary spells it (already spelled ones are kept)."""
    if all(c in _CHAR_TO_BYTE for c in token):
        return token
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


def _token_bytes(token: str) -> bytes:
    # Same rule as the tokenizers ByteLevel decoder: map each character back to its byte, unless one
    # is outside the byte alphabet (an added token written in plain text), then take it verbatim.
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer that llama.cpp uses for `tokenizer.ggml.pre` == `pre` (GPT-2's by default);
    one we do not know is an error, not GPT-2's regex guessed (that would split text differently)."""
    if pre not in _GPT2_PRE and pre not in _DIGITS_PRE and pre not in _SPLIT_PRE:
        raise ConfigError(
            f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(KNOWN_PRE_TOKENIZERS)})"
        )
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def gguf_eos_token_ids(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids of a GGUF model: the eos id, then the end-of-turn / end-of-message ids
    llama.cpp stores explicitly (`tokenizer.ggml.eot_token_id`, `eom_token_id`) when present.

    We add nothing guessed from the vocabulary: transformers' generation config for a GGUF file
    carries only the eos id, and for SmolLM2 that is `<|im_end|>` (2), its chat end token.
    """
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return _unique(int(meta[k]) for k in keys if meta.get(k) is not None)


def _unique(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF's assistant-mask marker; we render the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON (as transformers renders it).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox with the globals Hugging Face templates rely on."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Encode / decode text and render chat prompts.

    `template_tokens` are the special token strings a chat template may use (`bos_token`,
    `eos_token`, `unk_token`, `pad_token`), as transformers passes them.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        template_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids: tuple[int, ...] = _unique(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.template_tokens = dict(template_tokens or {})
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """From GGUF key/values (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind is None or "tokenizer.ggml.tokens" not in meta:
            raise ConfigError("GGUF file has no tokenizer (tokenizer.ggml.model / tokens missing)")
        if kind not in ("gpt2", "llama"):
            raise ConfigError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', byte-level BPE; "
                "'llama', SentencePiece BPE); use a Hugging Face folder with tokenizer.json instead"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ConfigError("GGUF tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
        if kind == "gpt2":
            backend = _byte_level_backend(tokens, types, meta.get("tokenizer.ggml.merges") or [])
            backend.pre_tokenizer = byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        else:
            scores = meta.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise ConfigError("GGUF SentencePiece tokenizer lacks tokenizer.ggml.scores (one per token)")
            unk = meta.get("tokenizer.ggml.unknown_token_id")
            backend = _sentencepiece_backend(
                tokens,
                list(scores),
                types,
                unk_id=int(unk) if unk is not None else None,
                # llama.cpp's default for SentencePiece vocabularies: a space before the text.
                add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            )
        # llama.cpp adds a bos by default to SentencePiece vocabularies, not to BPE ones.
        flag_default = {
            "tokenizer.ggml.add_bos_token": kind == "llama",
            "tokenizer.ggml.add_eos_token": False,
        }

        def special(key: str, flag: str) -> tuple[str, int] | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            wanted = meta.get(flag, flag_default[flag])
            return (tokens[int(i)], int(i)) if wanted and i is not None else None

        post = _bos_eos_post_processor(
            special("bos_token_id", "tokenizer.ggml.add_bos_token"),
            special("eos_token_id", "tokenizer.ggml.add_eos_token"),
        )
        if post is not None:
            backend.post_processor = post
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend,
            eos_token_ids=gguf_eos_token_ids(meta),
            bos_token_id=int(bos_id) if bos_id is not None else None,
            chat_template=meta.get("tokenizer.chat_template"),
            template_tokens=_gguf_template_tokens(meta, tokens),
        )

    @classmethod
    def from_hf_folder(
        cls, folder: Path, *, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None
    ) -> Tokenizer:
        """From `tokenizer.json`, with `tokenizer_config.json` / `chat_template.jinja` beside it."""
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(
                f"model folder {folder} has no tokenizer.json (only fast tokenizers are supported)"
            )
        backend = Backend.from_file(str(path))
        tok_config = _read_json(Path(folder) / "tokenizer_config.json")
        template_tokens = {
            name: content
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (content := _token_content(tok_config.get(name))) is not None
        }
        if (
            not eos_token_ids
            and (eos_id := backend.token_to_id(template_tokens.get("eos_token", ""))) is not None
        ):
            eos_token_ids = (eos_id,)
        if bos_token_id is None and "bos_token" in template_tokens:
            bos_token_id = backend.token_to_id(template_tokens["bos_token"])
        return cls(
            backend,
            eos_token_ids=eos_token_ids,
            bos_token_id=bos_token_id,
            chat_template=_hf_chat_template(Path(folder), tok_config),
            template_tokens=template_tokens,
        )

    # -- encode / decode -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary entry (byte-level spelling, e.g. 'Ġworld'); None for an unknown id."""
        return self.backend.id_to_token(i)

    @cached_property
    def byte_pieces(self) -> list[bytes] | None:
        """Raw bytes of every token id [vocab_size] when decoding is plain byte-level (the text is
        the UTF-8 decode of the tokens' bytes joined), else None."""
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None
        return [_token_bytes(self.backend.id_to_token(i) or "") for i in range(self.vocab_size)]

    # -- chat ----------------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ConfigError("this model has no chat template; send a plain prompt instead")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, rendered as transformers' `apply_chat_template(...,
        tokenize=False)` does. A template's `raise_exception` becomes an InvalidRequestError."""
        variables = {**self.template_tokens, **kwargs}
        try:
            return self._compiled_template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}", param="messages") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes any bos itself, so no special tokens are added on top (as in HF).
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )


def _byte_level_backend(tokens: list[str], types: list[int], merges: Iterable[str]) -> Backend:
    """A byte-level BPE over llama.cpp's token list; control tokens become special added tokens."""
    vocab = {_byte_level_spelling(tok): i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.decoder = decoders.ByteLevel()
    alphabet = set(_CHAR_TO_BYTE)
    # A control token spelled outside the byte alphabet is a converter mislabel; as in
    # transformers, it stays an ordinary vocabulary entry.
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, types, strict=True)
        if kind == _CONTROL and set(tok) <= alphabet
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, types, strict=True)
        if kind == _USER_DEFINED and tok in vocab
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


def _sentencepiece_backend(
    tokens: list[str], scores: list[float], types: list[int], unk_id: int | None, add_space_prefix: bool
) -> Backend:
    """SentencePiece BPE as llama.cpp runs it (its `spm` tokenizer): spaces spelled "▁" (one put
    before the text when `add_space_prefix`), characters merged pairwise, always the adjacent pair
    whose concatenation is the highest-scoring vocabulary entry, and what stays outside the
    vocabulary spelled as its UTF-8 bytes (`<0xNN>` tokens). As `tokenizers` BPE: a merge for every
    split of a vocabulary entry into two entries, ranked by the entry's score; byte fallback.
    Control tokens (and the unknown token) become special added tokens, user-defined ones added
    tokens, as llama.cpp splits both out of the text before merging."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    mergeable = {tok for tok, kind in zip(tokens, types, strict=True) if kind in (_NORMAL, _USER_DEFINED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != _NORMAL or len(tok) < 2:
            continue
        for cut in range(1, len(tok)):
            left = tok[:cut]
            if left in mergeable and (right := tok[cut:]) in mergeable:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    merges = [(left, right) for _, _, _, left, right in ranked]
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Backend(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    spaces = normalizers.Replace(" ", _SPM_SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), spaces]) if add_space_prefix else spaces
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the space put before the text is not part of it
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    backend.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind in (_CONTROL, _UNKNOWN)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == _USER_DEFINED
        ]
    )
    return backend


def _gguf_template_tokens(meta: Mapping[str, Any], tokens: list[str]) -> dict[str, str]:
    """bos_token / eos_token / unk_token / pad_token strings, as transformers names them for a GGUF."""
    keys = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in keys.items()}
    return {name: tokens[int(i)] for name, i in ids.items() if i is not None and 0 <= int(i) < len(tokens)}


def _bos_eos_post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing | None:
    """Makes `encode(add_special_tokens=True)` add bos / eos where the GGUF file asks for it."""
    if bos is None and eos is None:
        return None
    single = " ".join([*([bos[0]] if bos else []), "$A", *([eos[0]] if eos else [])])
    return processors.TemplateProcessing(
        single=single, special_tokens=[t for t in (bos, eos) if t is not None]
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(folder: Path, tok_config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    return template if isinstance(template, str) else None
