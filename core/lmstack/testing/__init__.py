"""Conformance kit: reusable pytest checks every scheduler, allocator and attention backend must
pass, built-in or third-party.

Subclass the suite in your own test module and provide the factory fixture::

    from lmstack.testing import SchedulerConformance

    class TestMyScheduler(SchedulerConformance):
        @pytest.fixture
        def make_scheduler(self):
            return lambda allocator, limits, **opts: MyScheduler(MyOptions(**opts), allocator, limits)
"""

from lmstack.testing.allocator import AllocatorConformance
from lmstack.testing.attention import AttentionConformance, plain_attention, reference_attention
from lmstack.testing.fakes import make_seq
from lmstack.testing.scheduler import SchedulerConformance, simulate

__all__ = [
    "AllocatorConformance",
    "AttentionConformance",
    "SchedulerConformance",
    "make_seq",
    "plain_attention",
    "reference_attention",
    "simulate",
]
