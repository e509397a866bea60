"""torch.distributed.checkpoint directory ⇄ hyper-parallel-dcp checkpoint, streaming.

Both directions walk the source's stored chunks in order and cut each into row blocks of
at most ``batch_bytes`` (at least one row along dim 0); a block is read through the
ordinary load path (the source's reader fills one fresh tensor of that block), written,
and dropped before the next is read.  So memory holds one block — bounded by the batch
setting, not by the model or its largest tensor.  Each block becomes one stored chunk of
the output, which both libraries load into any layout.

- :func:`convert_torch_dcp_to_dcp`: source read by ``TorchDCPReader``, written by the
  ordinary single-process save (``FileSystemWriter``: safetensors files, checksums,
  atomic ``.metadata``).
- :func:`convert_dcp_to_torch_dcp`: the output is what ``torch.distributed.checkpoint``
  writes itself: one ``__0_0.distcp`` file holding a ``torch.save`` archive per chunk and
  the ``torch.save`` bytes of each object (copied as stored), then the pickled
  ``.metadata`` built from torch's own metadata classes, written last (temp name, fsync,
  rename).
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
from pathlib import Path
from typing import Any, Iterator, Union

import torch

from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.flatten import torch_style_leaves
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from hyper_parallel_dcp.core.pipeline import save_state_dict
from hyper_parallel_dcp.core.planner import WriteItem, WriteItemType
from hyper_parallel_dcp.core.standard_planner import StandardLoadPlanner, StandardSavePlanner
from hyper_parallel_dcp.storage_fs.filesystem import FileSystemReader, FileSystemWriter
from hyper_parallel_dcp.storage_fs.torch_dcp import TorchDCPReader, is_torch_dcp_checkpoint, storage_reader_for_path

from .progress import ConversionReport, Progress
from .staging import StagingBuffer

__all__ = ["DEFAULT_BATCH_BYTES", "convert_dcp_to_torch_dcp", "convert_torch_dcp_to_dcp"]

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
#: Default largest block read and written at once.
DEFAULT_BATCH_BYTES = 256 * 1024 * 1024


def _blocks(md: TensorStorageMetadata, batch_bytes: int) -> Iterator[ChunkBox]:
    """The stored chunks of one tensor, each cut into row blocks of at most ``batch_bytes``."""
    itemsize = md.properties.dtype.itemsize
    for chunk in md.chunks:
        box = ChunkBox(tuple(chunk.offsets), tuple(chunk.sizes))
        if not chunk.sizes or math.prod(chunk.sizes) * itemsize <= batch_bytes or chunk.sizes[0] <= 1:
            yield box
            continue
        row_bytes = math.prod(chunk.sizes[1:]) * itemsize
        rows = max(1, batch_bytes // max(row_bytes, 1))
        for start in range(0, chunk.sizes[0], rows):
            n = min(rows, chunk.sizes[0] - start)
            yield ChunkBox((chunk.offsets[0] + start,) + tuple(chunk.offsets[1:]), (n,) + tuple(chunk.sizes[1:]))


class _Source:
    """One opened checkpoint of either format; reads blocks and objects through its reader."""

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self.reader: FileSystemReader = storage_reader_for_path(self.path)
        self.metadata: Metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True, rank=0)
        self.buffer = StagingBuffer()

    def read_block(self, fqn: str, box: ChunkBox) -> torch.Tensor:
        """The block ``box`` of ``fqn``, in the one reused buffer: valid until the next call
        (fresh tensors per block left freed blocks in the heap: peak RSS grew to ~5 batches)."""
        md = self.metadata.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        out = self.buffer.exact(box.sizes, md.properties.dtype)
        planner = StandardLoadPlanner()
        planner.set_up_planner({fqn: TensorShards(tuple(md.size), md.properties.dtype, [(box, out)])},
                               self.metadata, is_coordinator=True)
        self.reader.execute_read(planner.create_local_plan(), planner)
        return out

    def read_object(self, fqn: str) -> Any:
        planner = StandardLoadPlanner()
        planner.set_up_planner({fqn: None}, self.metadata, is_coordinator=True)
        self.reader.execute_read(planner.create_local_plan(), planner)
        return planner.loaded_objects[fqn]

    def object_bytes(self, fqn: str) -> bytes:
        """The stored ``torch.save`` bytes of an object (both formats store exactly that)."""
        if isinstance(self.reader, TorchDCPReader):
            index = MetadataIndex(fqn)
            return self.reader._item_bytes(index, self.reader._storage_info(index))
        info = (self.metadata.storage_data or {})[MetadataIndex(fqn)]
        with open(self.path / info.relative_path, "rb") as f:
            return os.pread(f.fileno(), info.length, info.offset)

    def total_bytes(self) -> int:
        return sum(md.size.numel() * md.properties.dtype.itemsize for md in self.metadata.state_dict_metadata.values()
                   if isinstance(md, TensorStorageMetadata))


class _BlockSavePlanner(StandardSavePlanner):
    """Plans from meta-only :class:`TensorShards`; each block's data is read at write time."""

    def __init__(self, source: _Source, bar: Progress) -> None:
        super().__init__(enable_plan_caching=False, remove_redundancy=False)
        self.source = source
        self.bar = bar

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type is not WriteItemType.TENSOR:
            return super().resolve_data(write_item)
        assert write_item.index.offset is not None and write_item.sizes is not None
        block = self.source.read_block(write_item.index.fqn, ChunkBox(write_item.index.offset, write_item.sizes))
        self.bar.advance(write_item.nbytes)
        return block


def convert_torch_dcp_to_dcp(src: PathLike, dst: PathLike, *, batch_bytes: int = DEFAULT_BATCH_BYTES,
                             progress: bool = False) -> ConversionReport:
    """Convert the torch DCP checkpoint at ``src`` into a hyper-parallel-dcp checkpoint at ``dst``.

    Same keys, dtypes and values; chunks are the source's, cut into row blocks of at most
    ``batch_bytes`` (memory holds one block).  Objects are restored with ``weights_only``
    rules (an object of a class not allow-listed raises :class:`UnsafeObjectError` naming
    it).  ``dst`` is created, or the checkpoint in it replaced atomically.  Raises
    :class:`CheckpointNotFoundError` / :class:`CheckpointFormatError` for a missing or
    unreadable source.
    """
    if batch_bytes <= 0:
        raise ValueError(f"batch_bytes must be positive, got {batch_bytes}")
    if not is_torch_dcp_checkpoint(src):
        raise ValueError(f"{src} is not a torch.distributed.checkpoint checkpoint (no pickled .metadata)")
    source = _Source(src)
    plan_sd: dict[str, Any] = {}
    report = ConversionReport(str(src), str(dst))
    for fqn, md in source.metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            pieces = [(box, torch.empty(box.sizes, dtype=md.properties.dtype, device="meta"))
                      for box in _blocks(md, batch_bytes)]
            plan_sd[fqn] = TensorShards(tuple(md.size), md.properties.dtype, pieces)
        else:
            plan_sd[fqn] = source.read_object(fqn)
            report.objects += 1
    with Progress(report, source.total_bytes(), "torch DCP -> DCP", progress) as bar:
        metadata = save_state_dict(plan_sd, FileSystemWriter(dst), _BlockSavePlanner(source, bar), no_dist=True)
    report.files = sorted(metadata.files) + [".metadata"]
    logger.info("converted %s -> %s: %s", src, dst, report.summary())
    return report


def _torch_metadata(sd: dict[str, Any], storage: dict[Any, Any], fqns: list[str]) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata as TorchMetadata

    return TorchMetadata(state_dict_metadata=sd, planner_data={fqn: tuple(fqn.split(".")) for fqn in fqns},
                         storage_data=storage)


def convert_dcp_to_torch_dcp(src: PathLike, dst: PathLike, *, batch_bytes: int = DEFAULT_BATCH_BYTES,
                             progress: bool = False, sync_files: bool = True) -> ConversionReport:
    """Write the checkpoint at ``src`` (either format) as a torch DCP checkpoint at ``dst``.

    The result is what ``torch.distributed.checkpoint.load`` with its ``FileSystemReader``
    reads, into any layout.  Chunks are the source's, cut into row blocks of at most
    ``batch_bytes`` (memory holds one block); objects are copied as stored.  ``.metadata``
    is written last, so an interrupted conversion leaves no loadable checkpoint (and a
    complete one in ``dst`` is replaced only at that moment).  Raises
    :class:`CheckpointNotFoundError` / :class:`CheckpointFormatError` for a missing or
    unreadable source.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata as TorchBytes
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as TorchChunk
    from torch.distributed.checkpoint.metadata import MetadataIndex as TorchIndex
    from torch.distributed.checkpoint.metadata import TensorProperties as TorchProperties
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as TorchTensor

    if batch_bytes <= 0:
        raise ValueError(f"batch_bytes must be positive, got {batch_bytes}")
    source = _Source(src)
    out_dir = Path(dst)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_file = out_dir / ".metadata"
    for old in out_dir.iterdir():  # what a checkpoint of either format left there
        if old.is_file() and (old.name.endswith((".metadata", ".distcp", ".safetensors", ".bytes"))):
            old.unlink()
    data_name = "__0_0.distcp"
    sd: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    report = ConversionReport(str(src), str(dst))
    with Progress(report, source.total_bytes(), "DCP -> torch DCP", progress) as bar, \
            open(out_dir / data_name, "wb") as f:
        for fqn, md in source.metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                blob = source.object_bytes(fqn)
                leaves = {fqn: None}
                if blob[:2] == b"PK" and isinstance(obj := source.read_object(fqn), list):
                    # torch stores a list holding dicts (param_groups) element-wise
                    leaves = torch_style_leaves(obj, fqn)
                for key, value in leaves.items():
                    if key != fqn or value is not None:
                        buf = io.BytesIO()
                        torch.save(value, buf)
                        blob = buf.getvalue()
                    storage[TorchIndex(key)] = _StorageInfo(data_name, f.tell(), len(blob))
                    f.write(blob)
                    sd[key] = TorchBytes()
                report.objects += 1
                continue
            assert isinstance(md, TensorStorageMetadata)
            chunks = []
            for i, box in enumerate(_blocks(md, batch_bytes)):
                block = source.read_block(fqn, box)
                start = f.tell()
                torch.save(block, f)
                storage[TorchIndex(fqn, torch.Size(box.offsets), i)] = _StorageInfo(data_name, start, f.tell() - start)
                chunks.append(TorchChunk(torch.Size(box.offsets), torch.Size(box.sizes)))
                bar.advance(block.numel() * block.element_size())
                del block
            sd[fqn] = TorchTensor(TorchProperties(dtype=md.properties.dtype), torch.Size(md.size), chunks)
        f.flush()
        if sync_files:
            os.fsync(f.fileno())
        size = f.tell()
    metadata = _torch_metadata(sd, storage, list(sd))
    tmp = meta_file.with_name(".metadata.hp-dcp-tmp")
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        if sync_files:
            os.fsync(f.fileno())
    os.replace(tmp, meta_file)
    report.files = [data_name, ".metadata"]
    logger.info("converted %s -> %s (torch DCP, %d bytes of data): %s", src, dst, size, report.summary())
    return report
