"""The conformance kit on `tp`: the tiny model (4 query heads, 2 KV heads) split over 2 ranks
gives the single-process engine's greedy tokens, and shuts its workers down."""

from lmstack.testing import ParallelConformance


class TestTensorParallel(ParallelConformance):
    component = "tp"
    options = {"tp": 2}
