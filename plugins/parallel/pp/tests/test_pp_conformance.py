"""The parallel-layout conformance kit on `pp`: two stages of the tiny model's two layers (two
micro-batches per step), alone and with two tensor-parallel ranks per stage, give the
single-process engine's greedy tokens and shut down cleanly."""

import pytest

from lmstack.testing import ParallelConformance


@pytest.mark.slow
class TestPipelineTwoStages(ParallelConformance):
    component = "pp"
    options = {"pp": 2}


@pytest.mark.slow
class TestPipelineTimesTensor(ParallelConformance):
    """tp x pp: two stages of two tensor-parallel ranks each (4 workers); activations go between
    ranks of the same tp position, the last stage's tp rank 0 returns the gathered logits."""

    component = "pp"
    options = {"pp": 2, "tp": 2}
