"""One Triton kernel that copies a list of pages, each given by (source address, destination
address, length), in a single launch.

Imported only by ``CudaCopier`` (``cuda_copy.py``) on a CUDA machine, when a job takes one
of its kernel paths; nothing else imports this module, so the core never needs Triton (it comes
with every GPU install of PyTorch and vLLM).

Why a kernel: a per-layer KV layout splits a 1 GiB job into 16k pages of 64 KiB. As separate
DMA descriptors they reach ~90% of one large copy in one direction and overlap badly when both
directions run at once. The copier uses this kernel two ways:

* *staged*: gather the pages into a device buffer laid out like the staging rows (store), or
  scatter them out of it (load), so that PCIe sees a few large row copies;
* *direct*: read or write the pinned, CUDA-registered host rows straight from the kernel (the
  device may use a registered host pointer as is), so small pages never become descriptors.

Addresses and lengths must be multiples of ``ALIGN`` bytes (the copier checks; other jobs take
the descriptor path): the kernel moves 4-byte words and tells the compiler that every page
starts on a 16-byte boundary, so loads and stores are 16 bytes wide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

ALIGN = 16
CHUNK_WORDS = 4096  # 16 KiB per program: 32 words per thread with 4 warps


# Triton reads a kernel's annotations (tl.constexpr), so its arguments carry no Python types
@triton.jit  # type: ignore[untyped-decorator]
def _copy_pages(table, n, first, CHUNK: tl.constexpr, HINTS: tl.constexpr):  # type: ignore[no-untyped-def]
    """Program (i, c) copies words [c*CHUNK, (c+1)*CHUNK) of page ``first + i``.

    ``table`` holds three int64 columns of ``n`` entries each: source address, destination
    address, length in 4-byte words.
    """
    d = first + tl.program_id(0)
    start = tl.program_id(1) * CHUNK
    src = tl.load(table + d)
    dst = tl.load(table + n + d)
    words = tl.load(table + 2 * n + d)
    if HINTS:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        words = tl.multiple_of(words, 4)
    if start < words:
        offs = start + tl.arange(0, CHUNK)
        mask = offs < words
        sp = src.to(tl.pointer_type(tl.int32))
        dp = dst.to(tl.pointer_type(tl.int32))
        tl.store(dp + offs, tl.load(sp + offs, mask=mask), mask=mask)


def launch(table: torch.Tensor, n: int, first: int, count: int, max_bytes: int, hints: bool = True) -> None:
    """Copy pages ``first .. first+count-1`` of ``table`` (a device int64 tensor of 3×n) on
    the current stream. ``max_bytes``: the longest of those pages."""
    if count <= 0:
        return
    chunks = -(-max_bytes // (4 * CHUNK_WORDS))
    _copy_pages[(count, chunks)](table, n, first, CHUNK=CHUNK_WORDS, HINTS=hints, num_warps=4)
