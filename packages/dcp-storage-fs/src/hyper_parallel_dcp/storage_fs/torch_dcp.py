"""The one place that speaks ``torch.distributed.checkpoint``'s format (torch 2.4 – 2.13):
loading its checkpoints (:class:`TorchDCPReader`, :class:`DirectoryReader`,
:func:`storage_reader_for_path`), the safe reading of its files (:func:`read_torch_dcp_metadata`,
:func:`locate_tensor`; both pickles go through allow-lists, :class:`UnsafeObjectError` for
anything else), and the one translation of torch's ``Metadata`` to ours and back
(:func:`metadata_from_torch`, :func:`metadata_to_torch`), which the reader, the
torch-compatible storage plugins and the ``dcp-to-torch-dcp`` conversion share."""

from __future__ import annotations

import collections
import functools
import io
import math
import os
import pathlib
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from hyper_parallel_dcp.core import metadata as schema
from hyper_parallel_dcp.core.chunks import row_major_strides
from hyper_parallel_dcp.core.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeObjectError,
)
from hyper_parallel_dcp.core.metadata import Metadata, MetadataIndex, StorageInfo
from hyper_parallel_dcp.core.planner import ReadItem

from .compression import zstd_module
from .files import RangeReader
from .layout import METADATA_FILE
from .metadata_io import StoredMetadata, check_region, storage_entry
from .metadata_io import chunk_sizes as stored_chunk_sizes
from .reader import FileSystemReader
from .sinks import PosixFile, copy_into, read_slice_into

__all__ = ["DirectoryReader", "StoredTensor", "TorchDCPReader", "is_row_major", "is_torch_dcp_checkpoint",
           "locate_tensor", "metadata_from_torch", "metadata_to_torch", "read_torch_dcp_metadata",
           "storage_reader_for_path"]


_DCP = "torch.distributed.checkpoint"
_Transforms = dict[MetadataIndex, tuple[str, ...]]


def _layout_from_name(name: str) -> Any:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise UnsafeObjectError(f"torch DCP metadata names an unknown layout {name!r}")
    return value


def _path_to_str(*parts: Any) -> str:
    return str(pathlib.PurePath(*(str(p) for p in parts)))


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    """What a ``.metadata`` pickle may name: torch DCP's metadata dataclasses (unpickling one
    sets its fields and runs nothing else), ``torch.Size``, ``OrderedDict``, layouts by name,
    and paths as strings.  torch DCP is imported here, on the first torch DCP read (~1.4 s
    of CPU, which a load of our own format does not pay)."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as tmd

    names = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
             "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    allowed = {(f"{_DCP}.metadata", name): getattr(tmd, name) for name in names}
    allowed |= {(f"{_DCP}.{module}", "_StorageInfo"): filesystem._StorageInfo
                for module in ("filesystem", "_fsspec_filesystem")}
    allowed |= {(module, name): _path_to_str for module in ("pathlib", "pathlib._local")
                for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")}
    return {**allowed, ("torch", "Size"): torch.Size, ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch.serialization", "_get_layout"): _layout_from_name}


class _MetadataUnpickler(pickle.Unpickler):
    """Allow-list unpickler for torch DCP ``.metadata`` (:func:`_allowed`, dtypes, layouts
    and memory formats); anything else raises :class:`UnsafeObjectError` naming it."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        value = _allowed().get((module, name))
        if value is None and module == "torch":
            value = getattr(torch, name, None)
            value = value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None
        if value is None:
            raise UnsafeObjectError(
                f"{self.source}: the pickled torch DCP metadata needs {module}.{name}, which is not on the "
                "allow-list of torch DCP metadata classes; refused, nothing was executed"
            )
        return value

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeObjectError(f"{self.source}: the pickled torch DCP metadata uses persistent ids; refused")


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                      for v in value):
        raise CheckpointFormatError(f"{what} must be a sequence of non-negative integers, got {value!r}")
    return tuple(int(v) for v in value)


def read_torch_dcp_metadata(path: Union[str, os.PathLike], raw: Optional[bytes] = None,
                            ) -> tuple[schema.Metadata, dict[schema.MetadataIndex, tuple[str, ...]]]:
    """``(metadata, transforms)`` of the pickled ``.metadata`` at ``path`` (or its bytes
    ``raw``), ``transforms`` the stream-transform descriptors of the items that have any.
    Raises :class:`CheckpointNotFoundError`, :class:`UnsafeObjectError` naming a class
    outside the allow-list, :class:`CheckpointFormatError` for anything else."""
    file = Path(path) / METADATA_FILE
    try:
        raw = file.read_bytes() if raw is None else raw
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{Path(path)} holds no checkpoint: {METADATA_FILE} is missing") from None
    source = str(file)
    try:
        doc = _MetadataUnpickler(io.BytesIO(raw), source).load()
    except UnsafeObjectError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises many types
        raise CheckpointFormatError(f"{source} is not a readable torch DCP metadata pickle: "
                                    f"{type(exc).__name__}: {exc}") from None
    tmd = _allowed()[f"{_DCP}.metadata", "Metadata"]
    if type(doc) is not tmd:
        raise CheckpointFormatError(f"{source}: expected torch DCP Metadata, found {type(doc).__name__}")
    if not isinstance(getattr(doc, "state_dict_metadata", None), dict):
        raise CheckpointFormatError(f"{source}: state_dict_metadata is missing")
    return _translate(doc, source)


def _checked_chunks(entry: Any, where: str) -> list[Any]:
    """The chunks of a tensor entry read from disk, sorted by offsets, once every field is
    what torch's own save writes (else :class:`CheckpointFormatError` naming ``where``)."""
    tensor_type = _allowed()[f"{_DCP}.metadata", "TensorStorageMetadata"]
    if type(entry) is not tensor_type:
        raise CheckpointFormatError(f"{where}: unknown item type {type(entry).__name__}")
    size = _ints(getattr(entry, "size", None), f"{where} size")
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"{where}: tensor properties without a dtype ({dtype!r})")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list):
        raise CheckpointFormatError(f"{where}: chunks must be a list, got {type(chunks).__name__}")
    for chunk in chunks:
        offsets = _ints(getattr(chunk, "offsets", None), f"{where} chunk offsets")
        sizes = _ints(getattr(chunk, "sizes", None), f"{where} chunk sizes")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise CheckpointFormatError(f"{where}: chunk offsets={list(offsets)} sizes={list(sizes)} "
                                        f"does not fit the global size {list(size)}")
    return sorted(chunks, key=lambda c: tuple(c.offsets))


def _translate(metadata: Any, source: Optional[str]) -> tuple[schema.Metadata, _Transforms]:
    """``(metadata, transforms)`` of torch's ``Metadata``.  With ``source`` it was read from
    that file: every field is checked first, errors naming ``source`` and the key.  Without,
    it is torch's own in-process object: its items are taken as they are, its storage entries
    left out (the plugin's ``finish``, row ``plugin save``: checking there made a 2000-tensor,
    4-chunk finish 15 ms instead of 6)."""
    sd: dict[str, schema.StorageMetadata] = {}
    bytes_type = _allowed()[f"{_DCP}.metadata", "BytesStorageMetadata"]
    for fqn, entry in metadata.state_dict_metadata.items():
        if type(entry) is bytes_type:
            sd[fqn] = schema.BytesStorageMetadata()
            continue
        chunks = entry.chunks if source is None else _checked_chunks(entry, f"{source}: {fqn!r}")
        # as columns: the storage table and the JSON then take them as they are (a list of
        # chunks was converted twice, 100 ms a pass for 2000 tensors, small case)
        table = schema.ChunkTable(len(entry.size), len(chunks), [o for c in chunks for o in c.offsets],
                                  [n for c in chunks for n in c.sizes])
        sd[fqn] = schema.TensorStorageMetadata(schema.TensorProperties(entry.properties.dtype),
                                               torch.Size(entry.size), table)
    storage: dict[schema.MetadataIndex, schema.StorageInfo] = {}
    transforms: _Transforms = {}
    for index, info in (metadata.storage_data or {}).items() if source is not None else ():
        fqn, offset, name = getattr(index, "fqn", None), getattr(index, "offset", None), getattr(info, "relative_path", None)
        key = schema.MetadataIndex(str(fqn), None if offset is None else _ints(offset, f"{source}: {fqn!r} offsets"))
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointFormatError(f"{source}: invalid file name {name!r} for {fqn!r}")
        start, length = _ints([getattr(info, "offset", None), getattr(info, "length", None)],
                              f"{source}: byte range of {fqn!r}")
        storage[key] = schema.StorageInfo(name, start, length)
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:
            transforms[key] = tuple(str(d) for d in descriptors)
    return schema.Metadata(state_dict_metadata=sd, storage_data=storage), transforms


def metadata_from_torch(metadata: Any) -> schema.Metadata:
    """torch's in-process ``Metadata`` (a save's global metadata) as ours: shapes, dtypes,
    chunks; no storage entries (the writer records its own)."""
    return _translate(metadata, None)[0]


def metadata_to_torch(metadata: schema.Metadata, *, with_storage: bool = False) -> Any:
    """Our metadata as torch's ``Metadata``: shapes, dtypes, chunks (what torch's planners
    read), and with ``with_storage`` also what torch's own save records besides: the storage
    entries (``relative_path``, byte range) and the planner data (each FQN's path)."""
    from torch.distributed.checkpoint import metadata as tmd

    entries: dict[str, Any] = {}
    size, chunk = torch.Size, tmd.ChunkStorageMetadata
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, schema.TensorStorageMetadata):
            table = schema.ChunkTable.of(entry.chunks, len(entry.size))
            chunks = [chunk(size(o), size(s)) for o, s in zip(table.offset_tuples(), table.size_tuples())]
            entries[fqn] = tmd.TensorStorageMetadata(tmd.TensorProperties(dtype=entry.properties.dtype),
                                                     size(entry.size), chunks)
        else:
            entries[fqn] = tmd.BytesStorageMetadata()
    if not with_storage:
        return tmd.Metadata(entries)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    storage = {tmd.MetadataIndex(i.fqn, None if i.offset is None else size(i.offset), i.index):
               _StorageInfo(s.relative_path, s.offset, s.length) for i, s in (metadata.storage_data or {}).items()}
    return tmd.Metadata(entries, planner_data={fqn: tuple(fqn.split(".")) for fqn in entries}, storage_data=storage)


def is_torch_dcp_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """True when ``path/.metadata`` exists and starts with a pickle protocol byte."""
    try:
        with open(Path(path) / METADATA_FILE, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


@dataclass(frozen=True)
class StoredTensor:
    """Where a row-major chunk's elements are: file offset of its first element, dtype, size."""

    data_offset: int
    dtype: torch.dtype
    size: tuple[int, ...]


def _rebuild(storage: Any, storage_offset: int, size: Any, stride: Any, *_rest: Any) -> tuple:
    return storage, storage_offset, tuple(size), tuple(stride)


class _TensorPickleUnpickler(pickle.Unpickler):
    """Reads a chunk archive's ``data.pkl`` as plain description of a dense tensor,
    ``((dtype, storage key, storage numel), storage offset, size, stride)``, or refuses."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):  # a storage type stands for its dtype
            return torch.storage._get_dtype_from_pickle_storage_type(name)
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return pid[1], str(pid[2]), int(pid[4])


def locate_tensor(fd: int, start: int, length: int) -> Optional[StoredTensor]:
    """Parse one ``torch.save`` archive in place; ``None`` when it is not a plain row-major
    little-endian tensor in a stored (uncompressed) record (those load through ``torch.load``)."""
    try:
        zf = zipfile.ZipFile(RangeReader(length, lambda pos, view: os.preadv(fd, [view], start + pos)))
    except zipfile.BadZipFile:
        return None
    names = zf.namelist()
    pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
    if pkl is None:
        return None
    prefix = pkl[: -len("data.pkl")]
    if prefix + "byteorder" in names and zf.read(prefix + "byteorder") != b"little":
        return None
    try:
        (dtype, key, numel), storage_offset, size, stride = _TensorPickleUnpickler(io.BytesIO(zf.read(pkl))).load()
    except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError):
        return None
    if not isinstance(dtype, torch.dtype) or not is_row_major(size, stride):
        return None
    try:
        info = zf.getinfo(f"{prefix}data/{key}")
    except KeyError:
        return None
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    header = os.pread(fd, 30, start + info.header_offset)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    record = info.header_offset + 30 + name_len + extra_len
    if storage_offset + math.prod(size) > numel or info.file_size < numel * dtype.itemsize:
        return None
    return StoredTensor(start + record + storage_offset * dtype.itemsize, dtype, size)


def is_row_major(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is the row-major layout of ``size`` (dims of size 1 ignored)."""
    return all(s == r for n, s, r in zip(size, stride, row_major_strides(size)) if n > 1)


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


class TorchDCPReader(FileSystemReader):
    """A :class:`FileSystemReader` for torch DCP directories, reading item by item: a dense
    chunk with ``preadv`` from its zip record, anything else through ``torch.load``
    (``weights_only``); ``verify=True`` is refused (torch records no checksums)."""

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, verify: bool = False) -> None:
        super().__init__(path, verify=verify)
        self._transforms: Optional[_Transforms] = None  # None: this directory's .metadata not read yet
        self._located: dict[MetadataIndex, Optional[StoredTensor]] = {}
        self._fds: dict[str, int] = {}

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        super().reset(checkpoint_id)
        self._close_fds()
        self._located = {}
        self._transforms = None

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
        self.metadata, self._transforms = read_torch_dcp_metadata(self._root(), None if payload is None else payload.data)
        self._located = {}
        self._is_global = True
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        super().set_up_storage_reader(metadata, is_coordinator=is_coordinator, rank=rank)
        if self._transforms is None:  # not part of Metadata (a broadcast copy): taken from this directory
            self._transforms = read_torch_dcp_metadata(self._root())[1]

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
        """The item's stored bytes (counted in ``bytes_read``), stream transforms undone."""
        blob = os.pread(self._fd(info.relative_path), info.length, info.offset)
        where = f"{self._root() / info.relative_path}: {index.fqn!r}"
        if len(blob) != info.length:
            raise CorruptCheckpointError(f"{where} is truncated ({len(blob)} of {info.length} bytes)")
        self.bytes_read += len(blob)
        for descriptor in reversed((self._transforms or {}).get(index, ())):
            name, _, version = descriptor.partition("/")
            if name != "stream.zstd" or version.partition(".")[0] != "1":
                raise CheckpointFormatError(f"{where} uses the torch DCP extension {descriptor!r}, which "
                                            "hyper-parallel-dcp does not read (supported: stream.zstd/1)")
            zstd = zstd_module(f"{where} (torch DCP's stream.zstd extension)")
            blob = zstd.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read()
        return blob

    def _location(self, index: MetadataIndex, info: StorageInfo) -> Optional[StoredTensor]:
        if index not in self._located:
            plain = not (self._transforms or {}).get(index)
            self._located[index] = locate_tensor(self._fd(info.relative_path), info.offset, info.length) \
                if plain else None
        return self._located[index]

    def read_into(self, item: ReadItem, dest: torch.Tensor) -> None:
        """Fill ``dest`` (shape ``item.lengths``) with the stored slice, casting to its dtype."""
        index = item.storage_index
        info = storage_entry(self.metadata, index, self._root())
        assert self.metadata is not None
        chunk_sizes = stored_chunk_sizes(self.metadata, index)
        path = str(self._root() / info.relative_path)
        where = f"{path}: {index.fqn!r} chunk at offsets {list(index.offset or ())}"
        check_region(where, item.storage_offsets, item.lengths, chunk_sizes)
        loc = self._location(index, info)
        if loc is not None and loc.size != tuple(chunk_sizes):
            raise CorruptCheckpointError(f"{where}: stored tensor has shape {list(loc.size)}, "
                                         f"the metadata records {list(chunk_sizes)}")
        if loc is not None:
            self.bytes_read += read_slice_into(PosixFile(self._fd(info.relative_path), path), loc.data_offset,
                                               chunk_sizes, loc.dtype, item.storage_offsets, item.lengths, dest)
            return
        blob = self._item_bytes(index, info)  # anything else (a strided chunk too): through torch.load
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
        info = storage_entry(self.metadata, index, self._root())
        return self._item_bytes(index, info), str(self._root() / info.relative_path)
