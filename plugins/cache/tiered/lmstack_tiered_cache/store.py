"""The disk tier: one file per KV block, named by the block's content hash.

File layout: ``LMKV`` | header length (u32, little endian) | header (JSON: format version,
geometry fingerprint, block hash, dtype, shape) | payload (the block's KV bytes) | BLAKE2b-128
digest of everything before it. A file is used only when the digest, the header and the payload
size all check out against what the reader expects; anything else (a flipped bit, a truncated
write, a block of another model, dtype or block size) is a miss and a log line.

Files are written to a temporary name and renamed, so a crash leaves no half file under a real
name. The directory is bounded by a byte capacity: past it, the least recently used files go.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from lmstack.content_hash import CacheGeometry, hash_hex

log = logging.getLogger("lmstack.cache.tiered")

MAGIC = b"LMKV"
FORMAT_VERSION = 1
SUFFIX = ".kv"
_DIGEST = 16


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_block(geometry: CacheGeometry, block_hash: int, data: torch.Tensor) -> bytes:
    header = json.dumps(
        {
            "version": FORMAT_VERSION,
            "fingerprint": geometry.fingerprint.hex(),
            "hash": hash_hex(block_hash),
            "dtype": _dtype_name(data.dtype),
            "shape": list(data.shape),
        },
        sort_keys=True,
    ).encode()
    payload = data.contiguous().view(torch.uint8).numpy().tobytes()
    body = MAGIC + struct.pack("<I", len(header)) + header + payload
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


class CorruptEntry(ValueError):
    """A stored block that does not check out (the message says why)."""


def decode_block(raw: bytes, geometry: CacheGeometry, block_hash: int, dtype: torch.dtype) -> torch.Tensor:
    if len(raw) < len(MAGIC) + 4 + _DIGEST:
        raise CorruptEntry(f"truncated ({len(raw)} bytes)")
    body, digest = raw[:-_DIGEST], raw[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise CorruptEntry("checksum mismatch")
    if body[:4] != MAGIC:
        raise CorruptEntry("not a KV block file")
    (n,) = struct.unpack("<I", body[4:8])
    try:
        header = json.loads(body[8 : 8 + n])
    except ValueError:
        raise CorruptEntry("unreadable header") from None
    payload = body[8 + n :]
    expected = {
        "version": FORMAT_VERSION,
        "fingerprint": geometry.fingerprint.hex(),
        "hash": hash_hex(block_hash),
        "dtype": _dtype_name(dtype),
        "shape": list(geometry.block_shape),
    }
    for key, want in expected.items():
        if header.get(key) != want:
            raise CorruptEntry(f"foreign block: {key} is {header.get(key)!r}, expected {want!r}")
    if len(payload) != dtype.itemsize * torch.Size(geometry.block_shape).numel():
        raise CorruptEntry(f"payload of {len(payload)} bytes does not match the shape")
    return torch.frombuffer(bytearray(payload), dtype=dtype).reshape(geometry.block_shape)


class DiskStore:
    """Block files under `root`, at most `capacity` bytes, LRU. Thread-safe: the engine thread
    reads, a writer thread writes."""

    def __init__(self, root: str | os.PathLike, capacity: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # hash hex -> size, oldest first
        self._bytes = 0
        found = []
        for path in self.root.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime, path.stem, st.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self._bytes += size

    def path(self, block_hash: int) -> Path:
        return self.root / f"{hash_hex(block_hash)}{SUFFIX}"

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return hash_hex(block_hash) in self._files

    def __len__(self) -> int:
        return len(self._files)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def read(self, block_hash: int) -> bytes | None:
        name = hash_hex(block_hash)
        with self._lock:
            if name not in self._files:
                return None
            self._files.move_to_end(name)
        try:
            return self.path(block_hash).read_bytes()
        except OSError as exc:
            log.warning("disk tier: cannot read %s: %s", name, exc)
            self.discard(block_hash)
            return None

    def discard(self, block_hash: int) -> None:
        name = hash_hex(block_hash)
        with self._lock:
            size = self._files.pop(name, None)
            if size is not None:
                self._bytes -= size
        self.path(block_hash).unlink(missing_ok=True)

    def write(self, block_hash: int, raw: bytes) -> None:
        if len(raw) > self.capacity:
            return
        name = hash_hex(block_hash)
        final = self.path(block_hash)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(raw)
        os.replace(tmp, final)  # atomic: readers see the old file or the whole new one
        victims = []
        with self._lock:
            old = self._files.pop(name, 0)
            self._files[name] = len(raw)
            self._bytes += len(raw) - old
            while self._bytes > self.capacity and len(self._files) > 1:
                victim, size = self._files.popitem(last=False)
                self._bytes -= size
                victims.append(victim)
        for victim in victims:
            (self.root / f"{victim}{SUFFIX}").unlink(missing_ok=True)
