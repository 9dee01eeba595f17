"""Streaming detokenization: deltas joined equal a full decode, with no broken characters."""

from __future__ import annotations

from functools import cached_property

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers

from lmstack.model.detokenizer import IncrementalDetokenizer
from lmstack.model.source import open_model_source
from lmstack.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! 👋 How are you?",
    "Emoji run: 🤗🚀👍🏽🇫🇷👨‍👩‍👧 done",
    "中文：你好，世界！日本語のテキスト。한국어",
    "Accents: café naïve Ångström façade Zürich São Paulo",
    "Math ∑ ∫ √ ≈ ≠ and arrows → ⇒ ↔",
    "plain ascii with  double  spaces\nand\ttabs",
]


@pytest.fixture(scope="module")
def tok(smollm2_path) -> Tokenizer:
    return open_model_source(str(smollm2_path)).tokenizer


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[1, 4093, 198], skip_special_tokens=skip)
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    deltas = _stream(tok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_split_character_is_held_back(tok: Tokenizer) -> None:
    # 🤗 is 4 UTF-8 bytes spread over several byte tokens: nothing until its last byte.
    ids = tok.encode("🤗")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.step([i]) for i in ids] == [""] * (len(ids) - 1) + ["🤗"]
    assert detok.text == "🤗"


def test_special_tokens_never_appear(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi 🤗"}, {"role": "assistant", "content": "Hello 世界"}]
    ids = tok.encode_chat(messages, add_generation_prompt=False) + [0, 3, 2]
    deltas = _stream(tok, ids)
    joined = "".join(deltas)
    assert joined == tok.decode(ids)
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"):
        assert all(special not in d for d in deltas)
    assert "".join(_stream(tok, ids, skip=False)) == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in tok.decode(ids, skip_special_tokens=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=60))
def test_random_text_streams_to_its_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    # Not always == text: a few bytes (e.g. \x16, \xf1) have no token and are dropped.
    full = tok.decode(ids)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 300)), max_size=30), st.booleans())
def test_random_ids_stream_to_their_decode(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    # What a model may generate: any ids, including lone UTF-8 lead / continuation bytes.
    assert "".join(_stream(tok, ids, skip=skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_incomplete_tail_is_held_until_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🤗")[:-1]  # drop the last byte of the emoji
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.step([i]) for i in ids) == "ok "
    assert detok.flush() == "\ufffd" == tok.decode(ids)[-1]


# --------------------------------------------------------------------------------------------------
# The generic window path (tokenizers whose decoder is not plain byte-level)


class _WindowOnly(Tokenizer):
    @cached_property
    def byte_pieces(self) -> None:
        return None


def _sentencepiece_like() -> Tokenizer:
    """A Llama-2 style tokenizer: ▁ for spaces, byte fallback for characters not in the vocab."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz", "é"]:
        vocab[piece] = len(vocab)
    backend = Backend(
        models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, eos_token_ids=[2], bos_token_id=1)


def test_window_path_on_byte_fallback_tokenizer() -> None:
    sp = _sentencepiece_like()
    assert sp.byte_pieces is None
    for text in ["hello world", "café 🤗 你好 ok", "a  b 🚀🚀 é"]:
        ids = sp.encode(text)
        detok = IncrementalDetokenizer(sp)
        deltas = [detok.step([i]) for i in ids] + [detok.flush()]
        assert "".join(deltas) == sp.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas)
        at_once = IncrementalDetokenizer(sp)
        assert at_once.step(ids) + at_once.flush() == text
    ids = [1, *sp.encode("hi"), 2]
    detok = IncrementalDetokenizer(sp)
    assert "".join(detok.step([i]) for i in ids) == "hi"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40))
def test_window_path_matches_byte_path(tok: Tokenizer, text: str) -> None:
    window = _WindowOnly(tok.backend, eos_token_ids=tok.eos_token_ids)
    ids = tok.encode(text)
    deltas = _stream(window, ids)
    assert "".join(deltas) == "".join(_stream(tok, ids)) == tok.decode(ids)


def test_window_stays_small(tok: Tokenizer) -> None:
    window = _WindowOnly(tok.backend)
    detok = IncrementalDetokenizer(window, prompt_token_ids=list(range(100, 400)))
    ids = tok.encode("a long stream of words " * 50)
    for i in ids:
        detok.step([i])
        assert len(detok._impl._ids) <= 8  # decodes touch a few ids, never the whole output
    assert detok.text == tok.decode(ids)
