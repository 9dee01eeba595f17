"""Host KV caches in transparent huge pages (`lmstack.kernels.huge_pages`): the tensor is the
zeroed tensor `torch.zeros` would give, and where the host has THP its memory is in 2 MiB pages."""

from __future__ import annotations

import pytest
import torch
from test_engine import STACK  # 400 blocks of 16 tokens in float32: ~4.9 MB per layer's K

from lmstack.kernels.huge_pages import HUGE_PAGE, huge_page_bytes, thp_mode, zeros_in_huge_pages

needs_thp = pytest.mark.skipif(
    thp_mode() in (None, "never") or huge_page_bytes(torch.zeros(1)) is None,
    reason="this host has no transparent huge pages (or no /proc/self/smaps)",
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(3, 5), (70, 16, 3, 64), (7, 1024, 1025)])
def test_a_zeroed_contiguous_tensor_of_the_shape_and_dtype(shape, dtype):
    t = zeros_in_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert not t.float().any()
    t.view(-1)[-1] = 1  # writable to the last element, and nothing else changed
    assert t.float().sum().item() == 1


@needs_thp
def test_large_tensors_start_on_a_huge_page_and_live_in_huge_pages():
    t = zeros_in_huge_pages((8, 1024, 1024), torch.bfloat16)  # 16 MiB
    assert t.data_ptr() % HUGE_PAGE == 0
    # The kernel may fall back to small pages where it finds no free 2 MiB page; some are huge.
    assert huge_page_bytes(t) >= HUGE_PAGE


@needs_thp
def test_the_engine_keeps_its_cpu_kv_cache_in_huge_pages(shared_llm):
    runner = shared_llm(STACK).engine.executor.runner
    for k, v in runner.kv_caches:
        assert k.numel() * k.element_size() >= 2 * HUGE_PAGE
        assert huge_page_bytes(k) >= HUGE_PAGE and huge_page_bytes(v) >= HUGE_PAGE
