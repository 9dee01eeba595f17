"""Block content hashes are stable: the same in every process (unlike Python's salted hash())."""

from __future__ import annotations

import os
import subprocess
import sys

from lmstack.content_hash import CacheGeometry, block_hash, hash_hex, request_key

GEOMETRY = CacheGeometry(
    model="m",
    model_config="c",
    dtype="float32",
    quantizer="none",
    num_layers=2,
    num_kv_heads=1,
    head_dim=4,
    kv_cache_dtype="float32",
    block_size=4,
)

_CHAIN = """
from lmstack.content_hash import block_hash, request_key
from {mod} import GEOMETRY
extra = GEOMETRY.fingerprint + request_key("salt", "tenant-a")
h = block_hash(None, [1, 2, 3, 4], extra)
print(block_hash(h, [5, 6, 7, 2**40], extra))
"""


def _chain_here() -> int:
    extra = GEOMETRY.fingerprint + request_key("salt", "tenant-a")
    return block_hash(block_hash(None, [1, 2, 3, 4], extra), [5, 6, 7, 2**40], extra)


def test_hashes_are_the_same_in_another_process():
    # A different PYTHONHASHSEED changes hash() of str/bytes; ours must not move.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.path.dirname(__file__)}
    out = subprocess.run(
        [sys.executable, "-c", _CHAIN.format(mod="test_content_hash")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert int(out) == _chain_here()
    assert len(hash_hex(_chain_here())) == 32


def test_every_key_changes_the_hash():
    fp = GEOMETRY.fingerprint
    base = block_hash(None, [1, 2, 3, 4], fp)
    assert block_hash(None, [1, 2, 3, 5], fp) != base  # tokens
    assert block_hash(base, [1, 2, 3, 4], fp) != base  # parent
    assert block_hash(0, [1, 2, 3, 4], fp) != base  # a zero parent is not "no parent"
    assert block_hash(None, [1, 2, 3, 4], fp + request_key("s", None)) != base  # salt
    assert request_key("s", None) != request_key(None, "s")  # a salt is not a tenant
    other = CacheGeometry(**{**GEOMETRY.__dict__, "kv_cache_dtype": "bfloat16"})
    assert other.fingerprint != fp
    # The device does not change what a block holds.
    assert CacheGeometry(**{**GEOMETRY.__dict__, "device": "cuda"}).fingerprint == fp
    # Length-prefixed: moving bytes between the extra keys and the tokens cannot collide.
    assert block_hash(None, [1], b"") != block_hash(None, [], b"\x01" + bytes(7))
