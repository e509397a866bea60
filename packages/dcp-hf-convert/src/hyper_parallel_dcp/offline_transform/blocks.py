"""Reading a checkpoint in pieces: :class:`CheckpointBlocks` (a checkpoint opened for many
small reads through the load path) and :class:`StagingBuffer` (one reused host buffer)."""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Union

import torch

from hyper_parallel_dcp.core.backends import storage_reader_for
from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.metadata import MetadataIndex, TensorStorageMetadata
from hyper_parallel_dcp.core.standard_planner import StandardLoadPlanner
from hyper_parallel_dcp.core.storage import read_metadata_once
from hyper_parallel_dcp.storage_fs.files import as_checkpoint_files
from hyper_parallel_dcp.storage_fs.safetensors_stream import tensor_bytes
from hyper_parallel_dcp.storage_fs.torch_dcp import TorchDCPReader

__all__ = ["CheckpointBlocks", "StagingBuffer"]


class CheckpointBlocks:
    """The checkpoint at ``path`` (a directory or URL), its :attr:`metadata` read once; raises
    :class:`CheckpointNotFoundError` for no checkpoint, :class:`CheckpointFormatError` for
    metadata that cannot be read."""

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        self.path = path
        self.reader, self.metadata = read_metadata_once(storage_reader_for(path, None))

    def tensor(self, fqn: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata), fqn
        return md

    def read(self, targets: dict[str, Any], rank: int = 0) -> dict[str, Any]:
        """Load ``targets`` (``{fqn: tensor or TensorShards to fill in place, or None for
        an object}``); returns the objects as ``rank`` loads them (its own copy of
        rank-local state).  Raises what a load raises for missing or corrupt data."""
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True, rank=rank)
        planner = StandardLoadPlanner()
        planner.set_up_planner(targets, self.metadata, is_coordinator=True, rank=rank)
        self.reader.execute_read(planner.create_local_plan(), planner)
        return planner.loaded_objects

    def read_block(self, fqn: str, box: ChunkBox, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The region ``box`` of tensor ``fqn`` in its stored dtype: into ``out`` (of the
        box's shape and the stored dtype) when given, else into a new CPU tensor."""
        md = self.tensor(fqn)
        out = torch.empty(box.sizes, dtype=md.properties.dtype) if out is None else out
        self.read({fqn: TensorShards(tuple(md.size), md.properties.dtype, [(box, out)])})
        return out

    def read_object(self, fqn: str, rank: int = 0) -> Any:
        """Object ``fqn`` restored (``weights_only`` rules), the copy ``rank`` loads."""
        return self.read({fqn: None}, rank)[fqn]

    def object_bytes(self, fqn: str, rank: int = 0) -> bytes:
        """The stored (``torch.save``) bytes of the copy of object ``fqn`` that ``rank`` loads."""
        info = self.metadata.object_storage(fqn, rank)
        assert info is not None, fqn
        if isinstance(self.reader, TorchDCPReader):  # its stream transforms (zstd) undone
            return self.reader._item_bytes(MetadataIndex(fqn), info)
        with as_checkpoint_files(os.fspath(self.path)).open(info.relative_path) as f:
            f.seek(info.offset)
            return f.read(info.length)

    def tensor_bytes(self) -> int:
        """Bytes of every tensor of the checkpoint, in its stored dtypes."""
        return sum(md.size.numel() * md.properties.dtype.itemsize for md in self.metadata.state_dict_metadata.values()
                   if isinstance(md, TensorStorageMetadata))


class StagingBuffer:
    """Tensors over the start of one shared byte buffer (fresh tensors fragmented the heap), each valid until the next call
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
