"""The conformance kit on `tiered` (its disk tier in a temporary directory): identity of greedy
outputs, isolation, eviction, a second engine on the same directory, damaged files."""

from pathlib import Path

from lmstack.testing import CacheConformance


class TestTieredCache(CacheConformance):
    component = "tiered"

    @classmethod
    def cache_options(cls, tmp_dir):
        return {"disk_path": str(tmp_dir / "kv"), "disk_capacity": "64MiB"}

    def corrupt_entries(self, options):
        files = sorted(Path(options["disk_path"]).glob("*.kv"))
        for i, f in enumerate(files):
            raw = bytearray(f.read_bytes())
            if i % 2:
                f.write_bytes(bytes(raw[: len(raw) // 2]))  # truncated
            else:
                raw[len(raw) // 3] ^= 0x5A  # a flipped byte
                f.write_bytes(bytes(raw))
        return len(files)
