"""The conformance kit on `prefix`: greedy outputs identical with and without it."""

import pytest

from lmstack.testing import CacheConformance

pytestmark = pytest.mark.slow


class TestPrefixCache(CacheConformance):
    component = "prefix"
