"""checkpoint_engine.transport.prefault: whole pages only, contents untouched, best effort elsewhere."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from checkpoint_engine.transport.prefault import page_span, prefault


@pytest.mark.parametrize(
    "address, nbytes, want",
    [
        (0, 8192, (0, 8192)),
        (1, 8192, (4096, 4096)),  # partial first page left out
        (4096, 4095, (4096, 0)),  # less than a page
        (100, 100, (4096, 0)),
        (4096, 3 * 4096 + 5, (4096, 3 * 4096)),
    ],
)
def test_page_span_covers_only_whole_pages(address, nbytes, want):
    assert page_span(address, nbytes, page_bytes=4096) == want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux-only")
def test_prefault_populates_fresh_memory_and_keeps_contents():
    fresh = torch.empty(8 << 20, dtype=torch.uint8)  # 8 MiB: its own mapping, no pages yet
    assert prefault([fresh]) >= (8 << 20) - 2 * mmap.PAGESIZE
    filled = torch.arange(1 << 20, dtype=torch.float32)
    before = filled.clone()
    prefault([filled, torch.empty(0), filled[:3]])  # tiny and empty tensors are skipped
    assert torch.equal(filled, before)


def test_prefault_leaves_read_only_memory_alone(tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about non-writable buffers
        view = torch.frombuffer(mm, dtype=torch.uint8)
    prefault([view])  # EFAULT/EPERM from the kernel: skipped, no exception
    assert view[:256].tolist() == list(range(256))
    del view
    mm.close()
