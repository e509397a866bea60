"""Hugging Face Accelerate: ``save_state`` / ``load_state`` of FSDP sharded state in our format.

Accelerate's FSDP checkpointing (``accelerate.utils.fsdp_utils``, which
``Accelerator.save_state`` / ``load_state`` call) builds torch's ``FileSystemWriter`` /
``FileSystemReader`` inside its functions; within :func:`through_us` those names are
:class:`~hyper_parallel_dcp.torch_compat.StorageWriter` / ``StorageReader``::

    with through_us():
        accelerator.save_state(output_dir)

The swap is process-wide while the block runs (torch's module attributes): run no other
torch ``FileSystemWriter`` save on another thread meanwhile.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed.checkpoint as tdcp

from ..core.gc_pause import gc_paused
from ..torch_compat import StorageReader, StorageWriter

__all__ = ["through_us"]


@contextlib.contextmanager
def through_us() -> Iterator[None]:
    """torch's ``FileSystemWriter`` / ``FileSystemReader`` are the plugin's while inside,
    and the cyclic GC is paused (as a native save: see :func:`torch_compat.save`)."""
    saved = tdcp.FileSystemWriter, tdcp.FileSystemReader
    tdcp.FileSystemWriter, tdcp.FileSystemReader = StorageWriter, StorageReader  # type: ignore[assignment,misc]
    try:
        with gc_paused():
            yield
    finally:
        tdcp.FileSystemWriter, tdcp.FileSystemReader = saved  # type: ignore[misc]
