"""The built-in components pass the same conformance kit third-party plugins must pass."""

import pytest

from lmstack.components.continuous import ContinuousOptions, ContinuousScheduler
from lmstack.components.paged import PagedAllocator
from lmstack.components.torch_attention import TorchAttention
from lmstack.testing import AllocatorConformance, AttentionConformance, SchedulerConformance


class TestPagedAllocator(AllocatorConformance):
    @pytest.fixture
    def make_allocator(self):
        return PagedAllocator


class TestContinuousScheduler(SchedulerConformance):
    @pytest.fixture
    def make_scheduler(self):
        return lambda alloc, limits, **opts: ContinuousScheduler(ContinuousOptions(**opts), alloc, limits)


class TestTorchAttention(AttentionConformance):
    max_len = 600  # longer than the prefill kernel's query tile (256)

    @pytest.fixture
    def backend(self):
        return TorchAttention()
