"""Stable content addresses for KV-cache blocks.

A full block's address is a hash over its parent block's address, its token ids and extra keys
(the fingerprint of the model and the KV layout, the request's cache salt, its tenant). Python's
`hash()` is salted per process, so it cannot name a block on disk or in another process; these
are BLAKE2b digests over a canonical byte encoding: the same value in every process and on
every machine.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Bump when the encoding below changes: stored blocks of another version are then misses.
HASH_VERSION = 1
DIGEST_SIZE = 16  # bytes: 128-bit addresses make an accidental collision out of reach


def block_hash(parent: int | None, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """The address of a full block: `parent` is the previous block's address (None for the
    first block), `extra` the extra keys already encoded (see `CacheGeometry.fingerprint` and
    `request_key`)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    if parent is None:
        h.update(b"\x00" + bytes(DIGEST_SIZE))
    else:
        h.update(b"\x01" + parent.to_bytes(DIGEST_SIZE, "little"))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    return int.from_bytes(h.digest(), "little")


def hash_hex(block_hash_value: int) -> str:
    """The address as 32 hex digits (file names of a disk tier)."""
    return block_hash_value.to_bytes(DIGEST_SIZE, "little").hex()


def request_key(cache_salt: str | None, tenant: str | None) -> bytes:
    """Extra keys of one request: requests whose keys differ never share a block."""
    if cache_salt is None and tenant is None:
        return b""
    return json.dumps([cache_salt, tenant], ensure_ascii=False).encode()


@dataclass(frozen=True)
class CacheGeometry:
    """What a stored block's bytes mean: which model produced them and how a block is laid out.
    Its `fingerprint` is an extra key of every block hash, so blocks of another model, dtype or
    block size never match, and a disk tier stores it in every file's header."""

    model: str  # the stack's model name or path
    # What else changes the numbers a block holds: the model's hyper-parameters (a digest of its
    # config), the compute dtype and the weights quantizer (with its options).
    model_config: str
    dtype: str
    quantizer: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str  # e.g. "bfloat16"
    block_size: int
    device: str = "cpu"  # where the device pool lives (not part of the fingerprint)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block's KV as tiers store it: [layers, 2 (K, V), block_size, heads, dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def fingerprint(self) -> bytes:
        fields = asdict(self)
        del fields["device"]  # a block computed on one device means the same on another
        fields["hash_version"] = HASH_VERSION
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).digest()


def config_digest(config: object) -> str:
    """A short digest of a (dataclass) model config: its fields, canonically encoded."""
    text = json.dumps(asdict(config), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).hexdigest()
