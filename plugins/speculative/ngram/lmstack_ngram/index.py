"""One sequence's n-gram index, kept up to date as tokens arrive.

For every n in [min_n, max_n] it maps each n-gram to the position just after its latest
occurrence. Only n-grams followed by at least one token are indexed (the sequence's own
suffix must not find itself), so each call indexes the positions that became eligible since
the last one: O(new tokens x n range) per step, not a scan of the whole sequence.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> position after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are in the index

    def update(self, tokens: list[int]) -> None:
        """Index every n-gram of `tokens` that ends before its last token."""
        end = len(tokens) - 1  # n-grams must end at or before position end - 1
        for stop in range(max(self._indexed, self.min_n), end + 1):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                self._latest[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end + 1)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (length max_n down to min_n) that occurred before; [] if none did."""
        self.update(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pos = self._latest.get(tuple(tokens[-n:]))
            if pos is not None:
                return tokens[pos : pos + k]
        return []
