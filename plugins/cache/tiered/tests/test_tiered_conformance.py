"""The conformance kit on `tiered` (disk tier in a temporary directory), plus a restart: a
second engine on the same directory finds the first one's prefixes."""

import pytest

from lmstack.testing import CacheConformance
from lmstack.testing.cache import GREEDY, SYSTEM

pytestmark = pytest.mark.slow


class TestTieredCache(CacheConformance):
    component = "tiered"

    @classmethod
    def cache_options(cls, tmp_dir):
        return {"disk_path": str(tmp_dir / "kv"), "disk_capacity": "64MiB"}

    def corrupt_entries(self, options):
        from pathlib import Path

        files = sorted(Path(options["disk_path"]).glob("*.kv"))
        for i, f in enumerate(files):
            raw = bytearray(f.read_bytes())
            if i % 2:
                f.write_bytes(bytes(raw[: len(raw) // 2]))  # truncated
            else:
                raw[len(raw) // 3] ^= 0x5A  # a flipped byte
                f.write_bytes(bytes(raw))
        return len(files)

    def test_a_restart_finds_earlier_prefixes(self, llm, cache_section):
        prompt = llm.tokenizer.encode_chat(
            [{"role": "system", "content": "Restart check. " + SYSTEM}, {"role": "user", "content": "Hi"}]
        )
        first = llm.generate(prompt, GREEDY)[0]
        llm.engine.cache.flush()
        fresh = self.make_llm(cache_section)
        try:
            again = fresh.generate(prompt, GREEDY)[0]
            assert again.num_cached_tokens >= 16
            assert again.outputs[0].token_ids == first.outputs[0].token_ids
            assert fresh.engine.cache.disk_hits > 0
        finally:
            fresh.engine.shutdown()
