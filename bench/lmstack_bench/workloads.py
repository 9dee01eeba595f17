"""The work a benchmark sends: sessions of one or more turns, sized in tokens.

A *session* is what one client does: a single request for the `random`, `shared-prefix` and
`sharegpt` workloads, a growing conversation for `multi-turn` (each turn is sent after the previous
answer arrived, with that answer in its history). Prompts are made of whole-word tokens of the
model's own vocabulary, so a prompt of N words is N tokens to that tokenizer and every prompt is
different (nothing is served from a prefix cache unless the workload shares a prefix on purpose).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

WORKLOADS = ("random", "shared-prefix", "multi-turn", "sharegpt")

_WORD = re.compile(r"^ [a-z]{3,}$")


class TextTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class Turn:
    user: str  # the new user text of this turn
    max_tokens: int
    expected_prompt_tokens: int  # the user text's own tokens (the server adds template tokens)


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]
    system: str | None = None


@dataclass(frozen=True)
class LengthRange:
    """A length drawn uniformly from ``[mean * (1 - spread), mean * (1 + spread)]``."""

    mean: int
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"a length must be at least 1, got {self.mean}")
        if not 0.0 <= self.spread < 1.0:
            raise ValueError(f"a length spread must be within [0, 1), got {self.spread}")

    def draw(self, rng: random.Random) -> int:
        if self.spread == 0.0:
            return self.mean
        lo = max(1, round(self.mean * (1.0 - self.spread)))
        hi = max(lo, round(self.mean * (1.0 + self.spread)))
        return rng.randint(lo, hi)


@dataclass
class WordSource:
    """Random text whose length in tokens is known: whole-word tokens of the vocabulary."""

    words: list[str]  # " word": one token each, with its leading space
    firsts: list[str]  # "word": one token without the space too (a prompt's first word)
    tokenizer: TextTokenizer
    _checked: bool = field(default=False, repr=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: TextTokenizer) -> WordSource:
        words = []
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.decode([i], skip_special_tokens=True)
            if _WORD.match(piece) and tokenizer.encode(piece) == [i]:
                words.append(piece)
        firsts = [w[1:] for w in words if len(tokenizer.encode(w[1:])) == 1]
        if len(words) < 100 or len(firsts) < 10:
            raise ValueError("the tokenizer has too few whole-word tokens to build prompts from")
        return cls(words=words, firsts=firsts, tokenizer=tokenizer)

    def text(self, n_tokens: int, rng: random.Random) -> str:
        text = rng.choice(self.firsts) + "".join(rng.choice(self.words) for _ in range(n_tokens - 1))
        if not self._checked:
            # Word tokens concatenate without merging for byte-level BPE; check it once.
            got = len(self.tokenizer.encode(text))
            if abs(got - n_tokens) > max(2, n_tokens // 50):
                raise ValueError(
                    f"this tokenizer splits generated text unexpectedly ({got} tokens for {n_tokens})"
                )
            self._checked = True
        return text


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "random"
    input_len: LengthRange = LengthRange(200)
    output_len: LengthRange = LengthRange(128)
    # shared-prefix: this many system prompts of prefix_len tokens; sessions pick one at random.
    num_prefixes: int = 4
    prefix_len: int = 512
    # multi-turn: turns per conversation.
    turns: int = 4
    dataset: Path | None = None  # sharegpt
    max_prompt_tokens: int = 1536  # sharegpt: longer prompts are skipped
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}; choose one of {', '.join(WORKLOADS)}")
        if self.kind == "sharegpt" and self.dataset is None:
            raise ValueError("the sharegpt workload needs --dataset-path FILE")
        if self.num_prefixes < 1 or self.prefix_len < 1 or self.turns < 1:
            raise ValueError("--num-prefixes, --prefix-len and --turns must be at least 1")


def sessions(spec: WorkloadSpec, tokenizer: TextTokenizer) -> Iterator[Session]:
    """An endless, seeded stream of sessions: the same spec gives the same sessions. The slow part
    (reading the vocabulary or the dataset) happens here, before the first session is drawn, so
    it never delays a timed arrival."""
    rng = random.Random(spec.seed)
    if spec.kind == "sharegpt":
        return _sharegpt(_sharegpt_turns(spec, tokenizer), rng)
    return _generated(spec, WordSource.from_tokenizer(tokenizer), rng)


def _generated(spec: WorkloadSpec, words: WordSource, rng: random.Random) -> Iterator[Session]:
    def turn() -> Turn:
        n = spec.input_len.draw(rng)
        return Turn(user=words.text(n, rng), max_tokens=spec.output_len.draw(rng), expected_prompt_tokens=n)

    if spec.kind == "random":
        while True:
            yield Session(turns=(turn(),))
    elif spec.kind == "shared-prefix":
        prefixes = [words.text(spec.prefix_len, rng) for _ in range(spec.num_prefixes)]
        while True:
            yield Session(turns=(turn(),), system=rng.choice(prefixes))
    else:  # multi-turn
        while True:
            yield Session(turns=tuple(turn() for _ in range(spec.turns)))


def load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(first human message, first model reply) pairs from a ShareGPT-format JSON file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = []
    for item in data:
        conv = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") != "human" or second.get("from") not in ("gpt", "chatgpt", "bard"):
            continue
        human, reply = first.get("value"), second.get("value")
        if isinstance(human, str) and isinstance(reply, str) and human.strip() and reply.strip():
            pairs.append((human, reply))
    if not pairs:
        raise ValueError(f"{path}: no conversation starts with a human turn followed by a reply")
    return pairs


def _sharegpt_turns(spec: WorkloadSpec, tokenizer: TextTokenizer) -> list[Turn]:
    """The reply's length in tokens is the request's max_tokens (the usual ShareGPT convention)."""
    assert spec.dataset is not None
    usable = []
    for human, reply in load_sharegpt(spec.dataset):
        n_in, n_out = len(tokenizer.encode(human)), len(tokenizer.encode(reply))
        if 4 <= n_in <= spec.max_prompt_tokens and n_out >= 4:
            usable.append(Turn(user=human, max_tokens=n_out, expected_prompt_tokens=n_in))
    if not usable:
        raise ValueError(
            f"{spec.dataset}: no usable conversation (prompt 4..{spec.max_prompt_tokens} tokens)"
        )
    return usable


def _sharegpt(turns: list[Turn], rng: random.Random) -> Iterator[Session]:
    while True:
        rng.shuffle(turns)
        for t in turns:
            yield Session(turns=(t,))
