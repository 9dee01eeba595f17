"""Sequences without an engine, for driving components directly."""

from __future__ import annotations

import itertools

from lmstack.sampling_params import SamplingParams
from lmstack.sequence import Request, Sequence

_ids = itertools.count(1_000_000)


def make_seq(
    prompt_len: int,
    max_tokens: int = 8,
    *,
    n: int = 1,
    priority: int = 0,
    arrival: float | None = None,
    vocab: int = 1000,
    streamed: bool = True,
) -> Sequence:
    """A fresh waiting sequence with a deterministic pseudo-random prompt; `streamed`: its
    request's `Request.streamed`."""
    sid = next(_ids)
    prompt = [(sid * 31 + i * 7) % vocab for i in range(prompt_len)]
    req = Request(
        f"r{sid}",
        prompt,
        SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0),
        priority=priority,
        streamed=streamed,
    )
    if arrival is not None:
        req.arrival_time = arrival
    seq = Sequence(sid, req, list(prompt))
    req.seqs.append(seq)
    return seq
