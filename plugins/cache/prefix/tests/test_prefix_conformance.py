"""The conformance kit on `prefix`: greedy outputs identical with and without it."""

from lmstack.testing import CacheConformance


class TestPrefixCache(CacheConformance):
    component = "prefix"
