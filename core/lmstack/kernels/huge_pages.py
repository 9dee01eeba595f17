"""Large, long-lived host tensors (the KV cache) in 2 MiB transparent huge pages.

Decode attention reads every context token's K and V rows each step from blocks scattered over a
cache far larger than the CPU's caches. In 4 KiB pages such a read walks a new page (a TLB miss,
and a stop for the hardware prefetcher, which does not cross pages) every 4 KiB; in 2 MiB pages,
once per 2 MiB. On hosts whose THP mode is `madvise` (the default of many distributions) an
allocation gets huge pages only when asked for them, which torch's allocator does not do unless
`THP_MEM_ALLOC_ENABLE` is set, so the cache asks itself: madvise(MADV_HUGEPAGE) on its memory
before the first write faults it in. Measured with `benchmarks/kernels/decode_attention_memory.py
--pages` (a 32-stream SmolLM2 decode step's attention, 4 KiB against 2 MiB pages in one process):
2-8 % off a step over scattered blocks, 1-5 % over contiguous ones (Zen 4); a fresh server's
cache, whose sequences' blocks are still mostly contiguous, showed no end-to-end change.

Where the kernel has no THP (mode `never`, another OS) or refuses the advice, the tensor is the
same zeroed tensor in ordinary pages: nothing depends on getting huge pages.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The host's transparent huge page mode (`always`, `madvise`, `never`), None off Linux or
    where the kernel does not say."""
    try:
        text = _THP_MODE.read_text(encoding="ascii")
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous host tensor in a fresh private anonymous mapping advised into huge
    pages before anything touched it (memory from the heap may already be resident in 4 KiB
    pages, which the advice does not change), zeroed (made resident) at once. The mapping is one
    huge page longer than the tensor so that the tensor can start on a 2 MiB boundary; the pages
    it does not use are never written, so never resident. The mapping lives as long as the
    tensor's storage. Tensors under one huge page, and hosts without THP (`thp_mode()` `never`
    or None), get `torch.zeros`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() in (None, "never"):
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping open
    skip = -raw.data_ptr() % HUGE_PAGE  # a whole number of pages: mmap returns page-aligned memory
    # Only whole huge pages inside the tensor: advice on the partly used last one would fault in
    # a full 2 MiB where the tensor uses less.
    try:
        region.madvise(mmap.MADV_HUGEPAGE, skip, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:
        pass  # refused (a kernel without THP): the same tensor in ordinary pages
    out = raw[skip : skip + nbytes].view(dtype).view(shape)
    # Anonymous pages read as zeros already; writing them anyway makes the memory resident now,
    # as torch.zeros does, so that a host short of it fails at start-up, not mid-request.
    out.zero_()
    return out


def huge_page_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of `tensor`'s memory that the kernel backs with huge pages now (from
    /proc/self/smaps: the AnonHugePages of the mappings it overlaps, clipped to it), None where
    smaps cannot be read."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    try:
        lines = Path("/proc/self/smaps").read_text(encoding="ascii", errors="replace").splitlines()
    except OSError:
        return None
    total = 0
    lo = hi = 0
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            a, _, b = head.partition("-")
            lo, hi = int(a, 16), int(b, 16)
        elif head == "AnonHugePages:" and lo < end and start < hi:
            kib = int(line.split()[1])
            total += min(kib * 1024, min(hi, end) - max(lo, start))
    return total
