"""The parallel-layout conformance kit on `pp`: two stages of the tiny model's two layers give
the single-process engine's greedy tokens, with one and with several micro-batches."""

import pytest

from lmstack.testing import ParallelConformance


@pytest.mark.slow
class TestPipelineTwoStages(ParallelConformance):
    component = "pp"
    options = {"pp": 2}
