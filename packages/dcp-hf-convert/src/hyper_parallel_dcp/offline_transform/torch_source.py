"""Reading a ``torch.save`` file mapped (``weights_only=True, mmap=True``), each tensor's
pages handed back once written (:class:`PageReleaser`); old non-zip files load whole."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from hyper_parallel_dcp.core.errors import CheckpointFormatError, CheckpointNotFoundError

__all__ = ["PageReleaser", "load_torch_checkpoint"]

logger = logging.getLogger(__name__)

_MADV_DONTNEED = 4


def load_torch_checkpoint(path: Union[str, os.PathLike]) -> tuple[Any, bool]:
    """``(loaded object, mapped)`` for a ``torch.save`` file, ``mapped`` when its tensors view
    a file mapping (zip format).  Never runs code from the file (``weights_only=True``).
    Raises :class:`CheckpointNotFoundError` for a missing file, :class:`CheckpointFormatError`
    for one torch cannot read (or naming a class that is not allow-listed)."""
    file = Path(path)
    if not file.is_file():
        raise CheckpointNotFoundError(f"PyTorch checkpoint file {file} does not exist "
                                      "(src_platform='torch' wants a file)")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True), True
    except RuntimeError as exc:
        if "mmap" not in str(exc) and "zip" not in str(exc):
            raise CheckpointFormatError(f"cannot load PyTorch checkpoint {file}: {exc}") from None
    except Exception as exc:  # pickle errors, UnpicklingError for disallowed globals, ...
        raise CheckpointFormatError(f"cannot load PyTorch checkpoint {file}: {exc}") from None
    logger.info("%s is in the legacy (non-zip) format; loading it whole", file)
    try:
        return torch.load(file, map_location="cpu", weights_only=True), False
    except Exception as exc:
        raise CheckpointFormatError(f"cannot load PyTorch checkpoint {file}: {exc}") from None


def _madvise() -> Optional[Any]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class PageReleaser:
    """Drops the resident pages of tensors viewing a *file mapping* (``MADV_DONTNEED``: a
    later access reads the file again).  Only for :func:`load_torch_checkpoint`'s tensors
    with ``mapped=True``: on ordinary memory it would zero data."""

    def __init__(self) -> None:
        self._madvise = _madvise()
        self._page = mmap.PAGESIZE

    def release(self, tensor: torch.Tensor) -> None:
        if self._madvise is None:
            return
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        # Outward to whole pages: the mapping spans the whole file, so the neighbouring
        # bytes are file pages too (clean, re-readable), never someone else's memory.
        first = start - start % self._page
        end = -(-(start + nbytes) // self._page) * self._page
        if self._madvise(first, end - first, _MADV_DONTNEED) != 0:
            logger.debug("madvise(DONTNEED) failed with errno %d; pages stay resident", ctypes.get_errno())
