"""Physical references measured beside every figure: raw file I/O and host copies.

Each takes the rank's tensors (the bytes it writes) and returns seconds.  They are the
floors a checkpoint library is judged against: a save cannot beat write+fsync of the
same bytes, a load cannot beat reading them, staging cannot beat a memcpy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch

__all__ = ["drop_page_cache", "raw_read", "raw_write", "tensor_memoryview", "timed_clone", "timed_copy_into",
           "timed_copy_pieces"]


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (made contiguous first) as a memoryview, without a copy."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray exports the buffer protocol


def raw_write(path: Path, tensors: Sequence[torch.Tensor]) -> float:
    """Write the tensors' bytes back to back into ``path`` and fsync; returns seconds."""
    views = [tensor_memoryview(t) for t in tensors]
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for v in views:
            f.write(v)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def raw_read(path: Path, buffer: bytearray) -> float:
    """Read ``path`` into the preallocated ``buffer`` (``readinto``); returns seconds."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buffer)
        pos = 0
        while pos < len(buffer):
            n = f.readinto(view[pos:])
            if not n:
                break
            pos += n
    return time.perf_counter() - t0


def drop_page_cache(paths: Iterable[Path]) -> int:
    """``posix_fadvise(DONTNEED)`` every file (closed, already fsynced); returns the count.

    Only clean pages are dropped, hence fsync first; the caller checks it worked by
    comparing a cold read with a warm one.
    """
    count = 0
    for path in paths:
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


def timed_clone(tensors: Sequence[torch.Tensor]) -> float:
    """A fresh host copy (``clone``) of every tensor: the first-save staging floor."""
    t0 = time.perf_counter()
    copies = [t.clone() for t in tensors]
    elapsed = time.perf_counter() - t0
    del copies
    return elapsed


def timed_copy_into(buffers: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> float:
    """Copy every tensor into its preallocated buffer: the later-save staging floor."""
    t0 = time.perf_counter()
    torch._foreach_copy_(list(buffers), list(tensors))
    return time.perf_counter() - t0


def timed_copy_pieces(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Copy each ``(destination view, source view)`` pair, one ``copy_`` each: what a load
    copies, with no file, mapping or planning around it; returns seconds."""
    t0 = time.perf_counter()
    for dest, source in pieces:
        dest.copy_(source)
    return time.perf_counter() - t0
