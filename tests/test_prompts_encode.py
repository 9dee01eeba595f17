"""`encode_texts`: token-id prompts (no texts) never reach the tokenizer or the loop's default
executor, which every text request's tokenizing shares (issue 59: a Batch API line is one)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from lmstack_api.prompts import encode_texts


class _Backend:
    def __init__(self) -> None:
        self.calls = 0

    def encode_batch(self, texts, add_special_tokens=False):
        self.calls += 1
        return [SimpleNamespace(ids=[len(t)]) for t in texts]


class _CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


def _run(texts: list[str]) -> tuple[list[list[int]], int, int]:
    backend = _Backend()
    executor = _CountingExecutor()

    async def main() -> list[list[int]]:
        asyncio.get_running_loop().set_default_executor(executor)
        return await encode_texts(SimpleNamespace(backend=backend), texts)

    try:
        ids = asyncio.run(main())
    finally:
        executor.shutdown(wait=True)
    return ids, backend.calls, executor.submitted


def test_no_texts_take_no_thread():
    assert _run([]) == ([], 0, 0)


def test_texts_are_encoded_in_the_executor():
    assert _run(["ab", "abcd"]) == ([[2], [4]], 1, 1)
