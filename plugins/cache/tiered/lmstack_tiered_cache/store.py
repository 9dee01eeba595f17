"""The disk tier: one file per KV block, named by the block's content hash.

File layout: ``LMKV`` | header length (u32, little endian) | header (JSON: format version,
geometry fingerprint, block hash, dtype, shape) | payload (the block's KV bytes) | BLAKE2b-128
digest of everything before it. A file is used only when the digest, the header and the payload
size all check out against what the reader expects; anything else (a flipped bit, a truncated
write, a block of another model, dtype or block size) is a miss and a log line.

Files are written to a temporary name and renamed, so a crash leaves no half file under a real
name (temporaries left by a crash are deleted when the next server opens the directory). The
directory is bounded by a byte capacity that counts the temporary being written: past it, the
least recently used files go first.

Faults. The directory is a cache, so no I/O error (a read-only or full file system, a file
replaced by a directory, permissions, a file deleted by someone else) ever reaches the engine:
a failed read is a miss, a failed write is a block not stored (offered again the next time it
is computed), and each kind of error logs one warning a minute. A full file system
(ENOSPC) also evicts a few of the oldest files, so later writes find room again. A file larger
than a block file is never read whole: it is a miss and is removed.

Two servers on one directory. A server holds an exclusive lock (`flock`) on ``.lock`` in the
directory it uses; a second server finds it held and uses ``ns1`` under it (then ``ns2``, ...),
with its own lock, index and capacity, so neither evicts the other's files or miscounts its
bytes. With every namespace taken, the tier is off (one warning).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from lmstack.content_hash import CacheGeometry, hash_hex

log = logging.getLogger("lmstack.cache.tiered")

MAGIC = b"LMKV"
FORMAT_VERSION = 1
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
NAMESPACES = 8  # the directory itself, then ns1 .. ns7
WARN_INTERVAL_S = 60.0  # at most one warning of each kind this often
REOPEN_INTERVAL_S = 60.0  # a directory that could not be opened is tried again this often
# After ENOSPC, free this many blocks' worth of the oldest files: the file system is fuller than
# the capacity assumed (other writers), and a few blocks of room let the next writes succeed
# without wiping the tier.
FULL_DISK_EVICT_BLOCKS = 8
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_DIGEST = 16


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _header(geometry: CacheGeometry, block_hash: int, dtype: torch.dtype, shape) -> bytes:
    return json.dumps(
        {
            "version": FORMAT_VERSION,
            "fingerprint": geometry.fingerprint.hex(),
            "hash": hash_hex(block_hash),
            "dtype": _dtype_name(dtype),
            "shape": list(shape),
        },
        sort_keys=True,
    ).encode()


def encode_block(geometry: CacheGeometry, block_hash: int, data: torch.Tensor) -> bytes:
    header = _header(geometry, block_hash, data.dtype, data.shape)
    payload = data.contiguous().view(torch.uint8).numpy().tobytes()
    body = MAGIC + struct.pack("<I", len(header)) + header + payload
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def block_file_bytes(geometry: CacheGeometry, dtype: torch.dtype) -> int:
    """The size of every block file of `geometry` and `dtype` (hashes all have one length)."""
    header = _header(geometry, 0, dtype, geometry.block_shape)
    payload = dtype.itemsize * torch.Size(geometry.block_shape).numel()
    return len(MAGIC) + 4 + len(header) + payload + _DIGEST


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
    if not isinstance(header, dict):
        raise CorruptEntry("unreadable header")
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


class RateLimitedWarnings:
    """At most one warning of each kind per `interval_s`; the ones held back are counted and
    the count goes with the next warning of that kind."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: object) -> bool:
        """Log `msg % args` unless a warning of `kind` was logged less than `interval_s` ago;
        True when it was logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            msg += " (%d more like it since the last warning)"
            args = (*args, held)
        log.warning(msg, *args)
        return True


_CONSEQUENCE = {
    "open": "the disk tier is off until it can be opened (tried again in a minute)",
    "index": "the file is left out",
    "read": "treated as a miss",
    "write": "the block is not stored (it is offered again the next time it is computed)",
    "remove": "the file stays",
}


class _Unfit(Exception):
    """A block's file that is not one (a directory, or larger than a block file)."""


def _file_name(block_hash: int) -> str:
    return hash_hex(block_hash) + SUFFIX


class DiskStore:
    """Block files in one namespace of `root`, at most `capacity` bytes (temporaries counted),
    LRU. `file_bytes`: the exact size of a block file when known (reads are bounded by it);
    otherwise reads are bounded by the capacity. Thread-safe: reader threads read, a writer
    thread writes. Every file operation goes through `os` (the fault tests replace it)."""

    def __init__(
        self,
        root: str | os.PathLike,
        capacity: int,
        file_bytes: int | None = None,
        *,
        warnings: RateLimitedWarnings | None = None,
    ) -> None:
        self.base = Path(root)
        self.capacity = capacity
        self.file_bytes = file_bytes
        self.warnings = warnings or RateLimitedWarnings()
        self.root: Path | None = None  # the namespace in use; None while the tier is off
        self.io_errors = 0  # I/O errors met (each a miss, a skipped write or a file left)
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # file name -> size, oldest first
        self._bytes = 0
        self._lock_fd: int | None = None
        self._next_open = 0.0
        self.open()

    # --- opening and closing ---------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the tier is on (a namespace is locked and indexed)."""
        return self.root is not None

    def open(self) -> bool:
        """Claim a namespace, delete the temporaries a crash left there and index its files.
        After a failure, tried again at most once every REOPEN_INTERVAL_S; True when open."""
        if self.root is not None:
            return True
        now = time.monotonic()
        if now < self._next_open:
            return False
        self._next_open = now + REOPEN_INTERVAL_S
        try:
            os.makedirs(self.base, exist_ok=True)
            claimed = self._claim()
            if claimed is None:
                self.warnings.warn(
                    "busy",
                    "disk tier: %s and its %d namespaces are each locked by another server; the disk tier "
                    "is off (tried again in a minute)",
                    self.base,
                    NAMESPACES - 1,
                )
                return False
            root, fd = claimed
            try:
                files = self._scan(root)
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:
            self._fault("open", exc, str(self.base))
            return False
        with self._lock:
            self.root, self._lock_fd = root, fd
            self._files = files
            self._bytes = sum(files.values())
        if root != self.base:
            log.info("disk tier: %s is locked by another server; this one uses %s", self.base, root)
        return True

    def _claim(self) -> tuple[Path, int] | None:
        """The first namespace whose lock is free, and the locked descriptor."""
        for i in range(NAMESPACES):
            root = self.base / f"ns{i}" if i else self.base
            if i:
                os.makedirs(root, exist_ok=True)
            # Read-only: flock needs no write access, and a read-only directory still serves reads.
            fd = os.open(root / LOCK_NAME, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            except OSError:
                os.close(fd)
                raise
            return root, fd
        return None

    def _scan(self, root: Path) -> OrderedDict[str, int]:
        """Index the block files under `root` by modification time (oldest first). Holding its
        lock, any temporary there is a dead writer's: deleted, or, where that fails, counted
        (oldest) so an eviction tries again."""
        with os.scandir(root) as it:
            entries = list(it)
        stray: list[tuple[str, int]] = []
        found: list[tuple[float, str, int]] = []
        for entry in entries:
            name = entry.name
            if not name.endswith((SUFFIX, TMP_SUFFIX)):
                continue
            try:
                st = os.stat(entry.path, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._fault("index", exc, name)
                continue
            if name.endswith(TMP_SUFFIX):
                if not self._remove(root / name):
                    stray.append((name, st.st_size))
            elif not stat.S_ISREG(st.st_mode):
                continue  # not a file of ours (a directory, a link)
            elif st.st_size > self._read_limit:
                # Cannot be a block file of this server; reading it would cost its size.
                self._remove(root / name)
            else:
                found.append((st.st_mtime, name, st.st_size))
        files: OrderedDict[str, int] = OrderedDict(stray)
        for _, name, size in sorted(found):
            files[name] = size
        return files

    def close(self) -> None:
        """Forget the index and release the namespace's lock (callers stopped their reads and
        writes first). A later write opens the directory again."""
        with self._lock:
            fd, self._lock_fd, self.root = self._lock_fd, None, None
            self._files.clear()
            self._bytes = 0
            self._next_open = 0.0
        if fd is not None:
            os.close(fd)

    # --- the index ---------------------------------------------------------------------------

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return _file_name(block_hash) in self._files

    def __len__(self) -> int:
        return len(self._files)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    @property
    def _read_limit(self) -> int:
        return self.file_bytes if self.file_bytes is not None else self.capacity

    # --- reads ---------------------------------------------------------------------------------

    def read(self, block_hash: int) -> bytes | None:
        """The block's file, or None (not stored, unreadable, or not a block file: a miss)."""
        name = _file_name(block_hash)
        with self._lock:
            if self.root is None or name not in self._files:
                return None
            self._files.move_to_end(name)
            path = self.root / name
        try:
            return self._read_file(path)
        except FileNotFoundError:
            self._forget(name, remove=False)  # deleted by someone else: a plain miss
        except _Unfit as exc:
            self.warnings.warn("unfit", "disk tier: %s %s; treated as a miss and removed", name, exc)
            self._forget(name, remove=True)
        except OSError as exc:
            self._fault("read", exc, name)
            self._forget(name, remove=True)
        return None

    def _read_file(self, path: Path) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Unfit("is not a regular file")
            limit = self._read_limit
            if st.st_size > limit:
                raise _Unfit(f"has {st.st_size} bytes, more than a block file's {limit}")
            chunks, left = [], limit + 1  # one byte past the limit tells a file that grew
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            if left <= 0:
                raise _Unfit(f"grew past a block file's {limit} bytes")
            return b"".join(chunks)
        finally:
            os.close(fd)

    def discard(self, block_hash: int) -> None:
        """Drop a block (its file did not check out)."""
        self._forget(_file_name(block_hash), remove=True)

    def _forget(self, name: str, remove: bool) -> None:
        with self._lock:
            size = self._files.pop(name, None)
            if size is not None:
                self._bytes -= size
            root = self.root
        if remove and root is not None:
            self._remove(root / name)

    def _remove(self, path: Path) -> bool:
        """Delete a file, or an empty directory squatting on a file's name; True when gone."""
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            failure = exc
        if failure.errno in (errno.EISDIR, errno.EPERM):  # a directory (EPERM on macOS)
            try:
                os.rmdir(path)
                return True
            except FileNotFoundError:
                return True
            except NotADirectoryError:
                pass
            except OSError as exc:
                failure = exc
        self._fault("remove", failure, path.name)
        return False

    # --- writes --------------------------------------------------------------------------------

    def write(self, block_hash: int, raw: bytes) -> bool:
        """Store a block's file; False when it was not written (no room, a fault, the tier off)."""
        if len(raw) > self.capacity or not self.open():
            return False
        name = _file_name(block_hash)
        with self._lock:
            root = self.root
            victims = self._pop_oldest(self._bytes + len(raw) - self.capacity)
            self._bytes += len(raw)  # the temporary's room, taken before it exists
        assert root is not None
        if not self._delete(root, victims):
            with self._lock:
                self._bytes -= len(raw)
            return False
        tmp = f"{name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        created = False
        try:
            fd = os.open(root / tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            created = True
            try:
                view = memoryview(raw)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(root / tmp, root / name)  # atomic: readers see the old file or the new one
        except OSError as exc:
            self._fault("write", exc, name)
            left = created and not self._remove(root / tmp)
            with self._lock:
                self._bytes -= len(raw)
                if left:  # still on disk: counted, oldest, so the next eviction tries again
                    self._files[tmp] = len(raw)
                    self._files.move_to_end(tmp, last=False)
                    self._bytes += len(raw)
                full = exc.errno in _DISK_FULL
                victims = self._pop_oldest(FULL_DISK_EVICT_BLOCKS * len(raw)) if full else []
            self._delete(root, victims)
            if exc.errno == errno.ENOENT and not os.path.isdir(root):
                self.close()  # the directory was deleted under us: the next write makes it again
            return False
        with self._lock:
            self._bytes -= self._files.pop(name, 0)  # a file it replaced
            self._files[name] = len(raw)
        return True

    def _pop_oldest(self, nbytes: int) -> list[tuple[str, int]]:
        """Take the least recently used files holding at least `nbytes` out of the index
        (under the lock); the caller deletes them."""
        victims = []
        freed = 0
        while freed < nbytes and self._files:
            victim = self._files.popitem(last=False)
            victims.append(victim)
            freed += victim[1]
        self._bytes -= freed
        return victims

    def _delete(self, root: Path, victims: list[tuple[str, int]]) -> bool:
        """Delete evicted files; the ones that stay are counted again (oldest). True when all went."""
        stayed = [(name, size) for name, size in victims if not self._remove(root / name)]
        if stayed:
            with self._lock:
                for name, size in reversed(stayed):
                    self._files[name] = size
                    self._files.move_to_end(name, last=False)
                    self._bytes += size
        return not stayed

    def _fault(self, op: str, exc: OSError, what: str) -> None:
        with self._lock:
            self.io_errors += 1
        kind = f"{op}:{errno.errorcode.get(exc.errno or 0, type(exc).__name__)}"
        self.warnings.warn(
            kind, "disk tier: cannot %s %s: %s; %s", op, what, exc.strerror or exc, _CONSEQUENCE[op]
        )
