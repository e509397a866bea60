"""Every private torch API this package touches, so that a torch upgrade changes one file."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

__all__ = ["cuda_host_register", "cuda_host_unregister", "dtensor_class", "dtensor_local",
           "dtensor_spec", "foreach_copy", "new_shared_storage"]


def dtensor_class() -> Any:
    """``DTensor``; ``None`` while ``torch.distributed.tensor`` (seconds to import) is not
    imported, when no DTensor can exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else None


def dtensor_spec(leaf: Any) -> Any:
    """A DTensor's sharding spec: the identity of its geometry (compares by value, hash cached)."""
    return leaf._spec


def dtensor_local(leaf: Any) -> torch.Tensor:
    """A DTensor's local tensor, without ``to_local()``'s autograd call (microseconds a leaf)."""
    return leaf._local_tensor


def foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for every pair, in one C++ loop."""
    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """Fresh shared memory of ``nbytes`` bytes, allocated, as a storage that pickles as its
    file descriptor: a memfd filled by ``os.posix_fallocate`` (which releases the GIL),
    else ``UntypedStorage._new_shared``."""
    import torch.multiprocessing as torch_mp

    memfd_create = getattr(os, "memfd_create", None)
    from_fd = getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None)
    if memfd_create is None or from_fd is None or torch_mp.get_sharing_strategy() != "file_descriptor":
        return torch.UntypedStorage._new_shared(nbytes)
    fd = memfd_create("hp-dcp-staging", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)  # memory running out fails here, not as SIGBUS in a copy
        return from_fd(fd, nbytes)  # maps a duplicate of fd
    finally:
        os.close(fd)


def cuda_host_register(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer`` for CUDA DMA; raises what CUDA raises, or ``RuntimeError``."""
    rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister returned {rc}")


def cuda_host_unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())

