"""torch.distributed.checkpoint directory ⇄ hyper-parallel-dcp checkpoint, streaming in row blocks of
at most ``batch_bytes`` through one reused buffer.  Exports :func:`convert_torch_dcp_to_dcp` and
:func:`convert_dcp_to_torch_dcp` (one ``__0_0.distcp``, then the pickled ``.metadata``, last)."""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any, Iterator, Union

import torch

from hyper_parallel_dcp.core import metadata as schema
from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.errors import UnsafeObjectError
from hyper_parallel_dcp.core.flatten import torch_style_leaves
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.metadata import BytesStorageMetadata, TensorStorageMetadata
from hyper_parallel_dcp.core.objects import StoredObject
from hyper_parallel_dcp.core.planner import WriteItem
from hyper_parallel_dcp.storage_fs.atomic import write_file_atomic
from hyper_parallel_dcp.storage_fs.torch_dcp import is_torch_dcp_checkpoint, metadata_to_torch

from .blocks import CheckpointBlocks, StagingBuffer
from .progress import ConversionReport, progress_bar
from .to_dcp import save_streaming

__all__ = ["DEFAULT_BATCH_BYTES", "convert_dcp_to_torch_dcp", "convert_torch_dcp_to_dcp"]

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
#: Default largest block read and written at once.
DEFAULT_BATCH_BYTES = 256 * 1024 * 1024


def _blocks(md: TensorStorageMetadata, batch_bytes: int) -> Iterator[ChunkBox]:
    """The stored chunks of one tensor, each cut into row blocks of at most ``batch_bytes``."""
    itemsize = md.properties.dtype.itemsize
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if not sizes or math.prod(sizes) * itemsize <= batch_bytes or sizes[0] <= 1:
            yield ChunkBox(offsets, sizes)
            continue
        rows = max(1, batch_bytes // max(math.prod(sizes[1:]) * itemsize, 1))
        for start in range(0, sizes[0], rows):
            yield ChunkBox((offsets[0] + start, *offsets[1:]), (min(rows, sizes[0] - start), *sizes[1:]))


def _read_block(source: CheckpointBlocks, buffer: StagingBuffer, fqn: str, box: ChunkBox) -> torch.Tensor:
    """Block ``box`` of ``fqn`` in ``buffer``, valid until the next read."""
    return source.read_block(fqn, box, buffer.exact(box.sizes, source.tensor(fqn).properties.dtype))


def _pickles_a_list(blob: bytes) -> bool:
    """Whether the ``torch.save`` archive ``blob`` holds a list, from its pickle's first opcode."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            first = next(op for op, _, _ in pickletools.genops(archive.read(name)) if op.name not in ("PROTO", "FRAME"))
    except Exception:  # noqa: BLE001 - not a readable archive: carried as it is
        return False
    return first.name == "EMPTY_LIST"


def _plain_object(source: CheckpointBlocks, fqn: str) -> Any:
    """Object ``fqn`` restored, or ``None`` when it holds a class not allow-listed."""
    try:
        return source.read_object(fqn)
    except UnsafeObjectError:
        return None


def _check_batch(batch_bytes: int) -> None:
    if batch_bytes <= 0:
        raise ValueError(f"batch_bytes must be positive, got {batch_bytes}")


def convert_torch_dcp_to_dcp(src: PathLike, dst: PathLike, *, batch_bytes: int = DEFAULT_BATCH_BYTES,
                             progress: bool = False) -> ConversionReport:
    """Convert the torch DCP checkpoint at ``src`` into a hyper-parallel-dcp checkpoint at ``dst``.

    Same keys, dtypes and values; objects carried as stored bytes, never unpickled.  ``dst``
    is created, or its checkpoint replaced atomically.  Raises ``ValueError`` for a source
    that is not torch DCP or a batch size below 1, :class:`CheckpointNotFoundError` /
    :class:`CheckpointFormatError` for a missing or unreadable source.
    """
    _check_batch(batch_bytes)
    if not is_torch_dcp_checkpoint(src):
        raise ValueError(f"{src} is not a torch.distributed.checkpoint checkpoint (no pickled .metadata)")
    source, buffer = CheckpointBlocks(src), StagingBuffer()
    plan_sd: dict[str, Any] = {}
    for fqn, md in source.metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            pieces = [(box, torch.empty(box.sizes, dtype=md.properties.dtype, device="meta"))
                      for box in _blocks(md, batch_bytes)]
            plan_sd[fqn] = TensorShards(tuple(md.size), md.properties.dtype, pieces)
        else:
            plan_sd[fqn] = StoredObject(source.object_bytes(fqn))  # as stored: a load applies the allow-list

    def fetch(item: WriteItem) -> torch.Tensor:
        assert item.index.offset is not None and item.sizes is not None
        return _read_block(source, buffer, item.index.fqn, ChunkBox(item.index.offset, item.sizes))

    return save_streaming(plan_sd, src, dst, fetch, progress, "torch DCP -> DCP", source.tensor_bytes())


def convert_dcp_to_torch_dcp(src: PathLike, dst: PathLike, *, batch_bytes: int = DEFAULT_BATCH_BYTES,
                             progress: bool = False, sync_files: bool = True) -> ConversionReport:
    """Write the checkpoint at ``src`` (either format) as a torch DCP checkpoint at ``dst``,
    ``.metadata`` last (an interrupted conversion is not loadable); raises as
    :func:`convert_torch_dcp_to_dcp`."""
    _check_batch(batch_bytes)
    source, buffer = CheckpointBlocks(src), StagingBuffer()
    out_dir = Path(dst)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():  # what a checkpoint of either format left there
        if old.is_file() and old.name.endswith((".metadata", ".distcp", ".safetensors", ".bytes")):
            old.unlink()
    data_name = "__0_0.distcp"
    sd: dict[str, schema.StorageMetadata] = {}
    storage: dict[schema.MetadataIndex, schema.StorageInfo] = {}
    report = ConversionReport(str(src), str(dst))
    with progress_bar(report, source.tensor_bytes(), "DCP -> torch DCP", progress) as advance, \
            open(out_dir / data_name, "wb") as f:
        for fqn, md in source.metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                blob = source.object_bytes(fqn)
                leaves: dict[str, Any] = {fqn: None}
                if _pickles_a_list(blob) and isinstance(obj := _plain_object(source, fqn), list):
                    leaves = torch_style_leaves(obj, fqn)  # torch stores a list holding dicts element-wise
                for key, value in leaves.items():
                    if key != fqn or value is not None:
                        buf = io.BytesIO()
                        torch.save(value, buf)
                        blob = buf.getvalue()
                    storage[schema.MetadataIndex(key)] = schema.StorageInfo(data_name, f.tell(), len(blob))
                    f.write(blob)
                    sd[key] = BytesStorageMetadata()
                report.objects += 1
                continue
            assert isinstance(md, TensorStorageMetadata)
            chunks = []
            for i, box in enumerate(_blocks(md, batch_bytes)):
                block = _read_block(source, buffer, fqn, box)
                start = f.tell()
                torch.save(block, f)
                storage[schema.MetadataIndex(fqn, box.offsets, i)] = schema.StorageInfo(data_name, start, f.tell() - start)
                chunks.append(schema.ChunkStorageMetadata(box.offsets, box.sizes))
                advance(block.numel() * block.element_size())
            sd[fqn] = TensorStorageMetadata(md.properties, md.size, chunks)
            report.tensors += 1
        f.flush()
        if sync_files:
            os.fsync(f.fileno())
        size = f.tell()
    metadata = metadata_to_torch(schema.Metadata(sd, storage_data=storage), with_storage=True)
    write_file_atomic(out_dir / ".metadata", lambda f: pickle.dump(metadata, f), sync_files)
    report.files = [data_name, ".metadata"]
    logger.info("converted %s -> %s (torch DCP, %d bytes of data): %s", src, dst, size, report.summary())
    return report
