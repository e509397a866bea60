"""Loading checkpoints written by ``torch.distributed.checkpoint``: :class:`TorchDCPReader`,
:class:`DirectoryReader` and :func:`storage_reader_for_path`."""

from __future__ import annotations

import io
import os
from typing import Any, Optional, Union

import torch

from hyper_parallel_dcp.core.errors import CheckpointFormatError, CheckpointNotFoundError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import Metadata, MetadataIndex, StorageInfo
from hyper_parallel_dcp.core.planner import ReadItem

from .layout import METADATA_FILE
from .metadata_io import StoredMetadata
from .metadata_io import chunk_sizes as stored_chunk_sizes
from .posix import pread_exact, tensor_bytes
from .reader import FileSystemReader
from .sinks import copy_into, read_slice_into
from .torch_dcp_format import (
    StoredTensor,
    extent,
    is_row_major,
    is_torch_dcp_checkpoint,
    locate_tensor,
    read_torch_dcp_metadata,
)

__all__ = ["DirectoryReader", "TorchDCPReader", "is_torch_dcp_checkpoint", "read_torch_dcp_metadata",
           "storage_reader_for_path"]

_Transforms = dict[MetadataIndex, tuple[str, ...]]


def storage_reader_for_path(path: Union[str, os.PathLike], verify: Optional[bool] = None) -> FileSystemReader:
    """:class:`TorchDCPReader` for a torch DCP checkpoint (pickled ``.metadata``), else
    :class:`FileSystemReader`; ``verify`` (``None``: the reader's default) is passed on."""
    cls = TorchDCPReader if is_torch_dcp_checkpoint(path) else FileSystemReader
    return cls(path) if verify is None else cls(path, verify=verify)


class DirectoryReader(FileSystemReader):
    """A :class:`FileSystemReader` that hands a torch DCP checkpoint to a
    :class:`TorchDCPReader` once the ``.metadata`` the load read shows a pickle (no extra open)."""

    def reader_for(self, payload: Any) -> FileSystemReader:
        if isinstance(payload, StoredMetadata) and payload.data[:1] == b"\x80":
            return TorchDCPReader(self.path, verify=self.verify)
        return self


def _zstd_decompress(blob: bytes, where: str) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise CheckpointFormatError(f"{where} is compressed with torch DCP's stream.zstd extension; install the "
                                    "'zstandard' package to read it") from None
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read()


class TorchDCPReader(FileSystemReader):
    """A :class:`FileSystemReader` for torch DCP directories, reading item by item: a dense
    chunk with ``preadv`` from its zip record, anything else through ``torch.load``
    (``weights_only``); ``verify=True`` is refused (torch records no checksums)."""

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, verify: bool = False) -> None:
        super().__init__(path, verify=verify)
        self._transforms: _Transforms = {}
        self._located: dict[MetadataIndex, Optional[StoredTensor]] = {}
        self._fds: dict[str, int] = {}
        # (stat of .metadata, its translation, its transforms)
        self._parsed: Optional[tuple[tuple[int, int, int], Metadata, _Transforms]] = None

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        super().reset(checkpoint_id)
        self._close_fds()
        self._located = {}
        self._parsed = None

    def _parse(self, raw: Optional[bytes] = None) -> tuple[Metadata, _Transforms]:
        """The translated metadata (of ``raw`` when given), parsed again only when it changed."""
        try:
            st = os.stat(self._root() / METADATA_FILE)
            key: Optional[tuple[int, int, int]] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        if self._parsed is None or key is None or self._parsed[0] != key:
            metadata, transforms = read_torch_dcp_metadata(self._root(), raw)
            if key is None:
                return metadata, transforms
            self._parsed = (key, metadata, transforms)
            self._located = {}
        return self._parsed[1], self._parsed[2]

    def _close_fds(self) -> None:
        fds = getattr(self, "_fds", {})
        while fds:
            os.close(fds.popitem()[1])

    def __del__(self) -> None:
        try:
            self._close_fds()
        except Exception:  # noqa: BLE001
            pass

    def load_metadata(self) -> Metadata:
        return self.metadata_from_payload(None)

    def metadata_from_payload(self, payload: Optional[StoredMetadata]) -> Metadata:  # type: ignore[override]
        """The translation of the coordinator's bytes of the pickle (``None``: read it)."""
        if self.verify:
            raise CheckpointFormatError(
                f"{self._root()} is a torch.distributed.checkpoint checkpoint, which records no checksums; "
                "load it with verify=False, or convert it with 'hp-dcp-convert torch-dcp-to-dcp' to get them")
        self.metadata, self._transforms = self._parse(None if payload is None else payload.data)
        self._is_global = True
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        super().set_up_storage_reader(metadata, is_coordinator=is_coordinator, rank=rank)
        self._transforms = self._parse()[1]  # not part of Metadata: taken from this directory

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            file = self._root() / name
            try:
                fd = self._fds[name] = os.open(file, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"checkpoint file {file} is missing") from None
        return fd

    def _item_bytes(self, index: MetadataIndex, info: StorageInfo) -> bytes:
        """The item's stored bytes, stream transforms undone."""
        blob = os.pread(self._fd(info.relative_path), info.length, info.offset)
        where = f"{self._root() / info.relative_path}: {index.fqn!r}"
        if len(blob) != info.length:
            raise CorruptCheckpointError(f"{where} is truncated ({len(blob)} of {info.length} bytes)")
        for descriptor in reversed(self._transforms.get(index, ())):
            name, _, version = descriptor.partition("/")
            if name != "stream.zstd" or version.partition(".")[0] != "1":
                raise CheckpointFormatError(f"{where} uses the torch DCP extension {descriptor!r}, which "
                                            "hyper-parallel-dcp does not read (supported: stream.zstd/1)")
            blob = _zstd_decompress(blob, where)
        return blob

    def _location(self, index: MetadataIndex, info: StorageInfo) -> Optional[StoredTensor]:
        if index not in self._located:
            plain = not self._transforms.get(index)
            self._located[index] = locate_tensor(self._fd(info.relative_path), info.offset, info.length) \
                if plain else None
        return self._located[index]

    def read_into(self, item: ReadItem, dest: torch.Tensor) -> None:
        """Fill ``dest`` (shape ``item.lengths``) with the stored slice, casting to its dtype."""
        index = item.storage_index
        info = self.chunks().storage_info(index)
        assert self.metadata is not None
        chunk_sizes = stored_chunk_sizes(self.metadata, index)
        path = str(self._root() / info.relative_path)
        where = f"{path}: {index.fqn!r} chunk at offsets {list(index.offset or ())}"
        if any(o + n > s for o, n, s in zip(item.storage_offsets, item.lengths, chunk_sizes)):
            raise CheckpointFormatError(f"{where}: requested region offsets={list(item.storage_offsets)} "
                                        f"lengths={list(item.lengths)} exceeds the stored chunk {list(chunk_sizes)}")
        loc = self._location(index, info)
        if loc is not None and loc.size != tuple(chunk_sizes):
            raise CorruptCheckpointError(f"{where}: stored tensor has shape {list(loc.size)}, "
                                         f"the metadata records {list(chunk_sizes)}")
        if loc is not None and is_row_major(loc.size, loc.stride):
            self.bytes_read += read_slice_into(self._fd(info.relative_path), path, loc.data_offset, chunk_sizes,
                                               loc.dtype, item.storage_offsets, item.lengths, dest)
            return
        if loc is not None:  # a strided chunk (e.g. a transposed view): its span, read once
            staging = torch.empty(extent(loc.size, loc.stride), dtype=loc.dtype)
            pread_exact(self._fd(info.relative_path), tensor_bytes(staging), loc.data_offset, path)
            self.bytes_read += staging.nbytes
            stored = staging.as_strided(loc.size, loc.stride)
        else:
            blob = self._item_bytes(index, info)
            self.bytes_read += len(blob)
            try:
                stored = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - torch raises many types on bad input
                raise CorruptCheckpointError(f"{where}: not a readable torch.save tensor: {exc}") from None
            if not isinstance(stored, torch.Tensor) or tuple(stored.shape) != tuple(chunk_sizes):
                raise CorruptCheckpointError(f"{where}: stored item is not a tensor of shape {list(chunk_sizes)}")
        for d, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
            stored = stored.narrow(d, o, n)
        copy_into(dest, stored)

    def read_object_bytes(self, item: ReadItem) -> tuple[bytes, str]:
        index = item.storage_index
        info = self.chunks().storage_info(index)
        blob = self._item_bytes(index, info)
        self.bytes_read += len(blob)
        return blob, str(self._root() / info.relative_path)
