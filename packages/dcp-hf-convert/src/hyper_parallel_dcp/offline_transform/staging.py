"""One reusable host buffer for streaming conversions (fresh tensors fragmented the heap)."""

from __future__ import annotations

import math

import torch

from hyper_parallel_dcp.storage_fs.safetensors_stream import tensor_bytes

__all__ = ["StagingBuffer"]


class StagingBuffer:
    """Tensors over the start of one shared byte buffer, each valid until the next call
    (the caller must be done with it by then); the buffer grows when a larger one is asked for."""

    def __init__(self, nbytes: int = 0) -> None:
        self._buffer = torch.empty(max(nbytes, 0), dtype=torch.uint8)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` viewing the buffer."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._buffer.numel():
            self._buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).view(shape)

    def exact(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Like :meth:`view`, but the tensor's storage is exactly its own bytes, so
        ``torch.save`` of it writes those and not the whole buffer."""
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        view = self.view(shape, dtype)
        return torch.frombuffer(tensor_bytes(self._buffer)[:view.nbytes], dtype=dtype).view(shape)
