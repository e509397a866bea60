"""Loading checkpoints written by ``torch.distributed.checkpoint`` (torch 2.4 – 2.13):
:class:`TorchDCPReader`, :class:`DirectoryReader`, :func:`storage_reader_for_path`, and the
safe reading of their format (:func:`read_torch_dcp_metadata`, :func:`locate_tensor`).  Both
pickles go through allow-lists of inert records (:class:`UnsafeObjectError` for anything else)."""

from __future__ import annotations

import collections
import io
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

from .files import RangeReader
from .layout import METADATA_FILE
from .metadata_io import StoredMetadata, check_region, storage_entry
from .metadata_io import chunk_sizes as stored_chunk_sizes
from .reader import FileSystemReader
from .sinks import PosixFile, copy_into, read_slice_into

__all__ = ["DirectoryReader", "StoredTensor", "TorchDCPReader", "extent", "is_row_major", "is_torch_dcp_checkpoint",
           "locate_tensor", "read_torch_dcp_metadata", "storage_reader_for_path"]


_DCP = "torch.distributed.checkpoint"
#: torch DCP classes a ``.metadata`` pickle may name (module, class) → inert record.
_RECORD_CLASSES = {(f"{_DCP}.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta")}
_RECORD_CLASSES |= {(f"{_DCP}.{module}", "_StorageInfo") for module in ("filesystem", "_fsspec_filesystem")}
_PATH_CLASSES = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}


class _Record:
    """Stands in for an allow-listed torch DCP class: keeps its pickled state, runs nothing."""

    kind = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:  # takes the pickled arguments, runs nothing
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and (
            state[0] is None or isinstance(state[0], dict)
        ):  # (dict state, slots state)
            self.__dict__.update(state[0] or {})
            self.__dict__.update(state[1])
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:  # TensorProperties pickles a tuple
            self.__dict__["_state"] = state


_RECORDS: dict[tuple[str, str], type] = {key: type(key[1], (_Record,), {"kind": key[1]}) for key in _RECORD_CLASSES}


def _layout_from_name(name: str) -> Any:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise UnsafeObjectError(f"torch DCP metadata names an unknown layout {name!r}")
    return value


def _path_to_str(*parts: Any) -> str:
    return str(pathlib.PurePath(*(str(p) for p in parts)))


class _MetadataUnpickler(pickle.Unpickler):
    """Allow-list unpickler for torch DCP ``.metadata``: only inert values come out."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        record = _RECORDS.get((module, name))
        if record is not None:
            return record
        if module == f"{_DCP}.metadata" and name == "_MEM_FORMAT_ENCODING":
            return int  # an IntEnum member by value
        if module == "torch":
            if name == "Size":
                return torch.Size
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if module == "torch.serialization" and name == "_get_layout":
            return _layout_from_name
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:
            return _path_to_str
        raise UnsafeObjectError(
            f"{self.source}: the pickled torch DCP metadata needs {module}.{name}, which is not on the "
            "allow-list of torch DCP metadata classes; refused, nothing was executed"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeObjectError(f"{self.source}: the pickled torch DCP metadata uses persistent ids; refused")


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                      for v in value):
        raise CheckpointFormatError(f"{what} must be a sequence of non-negative integers, got {value!r}")
    return tuple(int(v) for v in value)


def _kind(obj: Any) -> str:
    return obj.kind if isinstance(obj, _Record) else type(obj).__name__


def _dtype_of(props: Any, where: str) -> torch.dtype:
    fields = props.__dict__ if isinstance(props, _Record) else {}
    state = fields.get("_state")
    dtype = state[0] if isinstance(state, tuple) and state else fields.get("dtype")
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"{where}: tensor properties without a dtype ({dtype!r})")
    return dtype


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
    if _kind(doc) != "Metadata":
        raise CheckpointFormatError(f"{source}: expected torch DCP Metadata, found {_kind(doc)}")
    state = doc.__dict__
    sd_in = state.get("state_dict_metadata")
    if not isinstance(sd_in, dict):
        raise CheckpointFormatError(f"{source}: state_dict_metadata is missing")
    sd: dict[str, Any] = {}
    for fqn, entry in sd_in.items():
        where = f"{source}: {fqn!r}"
        kind = _kind(entry)
        if kind == "BytesStorageMetadata":
            sd[fqn] = schema.BytesStorageMetadata()
        elif kind == "TensorStorageMetadata":
            e = entry.__dict__
            size = _ints(e.get("size"), f"{where} size")
            chunks = []
            for chunk in e.get("chunks") or []:
                offsets = _ints(chunk.__dict__.get("offsets"), f"{where} chunk offsets")
                sizes = _ints(chunk.__dict__.get("sizes"), f"{where} chunk sizes")
                if len(offsets) != len(size) or len(sizes) != len(size) or any(
                        o + s > d for o, s, d in zip(offsets, sizes, size)):
                    raise CheckpointFormatError(f"{where}: chunk offsets={list(offsets)} sizes={list(sizes)} "
                                                f"does not fit the global size {list(size)}")
                chunks.append(schema.ChunkStorageMetadata(offsets, sizes))
            chunks.sort(key=lambda c: c.offsets)
            sd[fqn] = schema.TensorStorageMetadata(schema.TensorProperties(_dtype_of(e.get("properties"), where)),
                                                   torch.Size(size), chunks)
        else:
            raise CheckpointFormatError(f"{where}: unknown item type {kind}")
    storage: dict[schema.MetadataIndex, schema.StorageInfo] = {}
    transforms: dict[schema.MetadataIndex, tuple[str, ...]] = {}
    for index, info in (state.get("storage_data") or {}).items():
        i, s = index.__dict__, info.__dict__
        fqn = i.get("fqn")
        offset = i.get("offset")
        key = schema.MetadataIndex(str(fqn), None if offset is None else _ints(offset, f"{source}: {fqn!r} offsets"))
        name = s.get("relative_path")
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointFormatError(f"{source}: invalid file name {name!r} for {fqn!r}")
        start, length = _ints([s.get("offset"), s.get("length")], f"{source}: byte range of {fqn!r}")
        storage[key] = schema.StorageInfo(name, start, length)
        descriptors = s.get("transform_descriptors")
        if descriptors:
            transforms[key] = tuple(str(d) for d in descriptors)
    return schema.Metadata(state_dict_metadata=sd, storage_data=storage), transforms


def is_torch_dcp_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """True when ``path/.metadata`` exists and starts with a pickle protocol byte."""
    try:
        with open(Path(path) / METADATA_FILE, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


@dataclass(frozen=True)
class StoredTensor:
    """Where a chunk's elements are: file offset of storage element 0, dtype, size, stride."""

    data_offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageRef:
    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _StorageType:
    def __init__(self, name: str) -> None:
        self.dtype = torch.storage._get_dtype_from_pickle_storage_type(name)


def _rebuild(storage: Any, storage_offset: int, size: Any, stride: Any, *_rest: Any) -> tuple:
    return storage, storage_offset, tuple(size), tuple(stride)


class _TensorPickleUnpickler(pickle.Unpickler):
    """Reads a chunk archive's ``data.pkl`` as plain description of a dense tensor, or refuses."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(name)
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return _StorageRef(pid[1].dtype, str(pid[2]), int(pid[4]))


def locate_tensor(fd: int, start: int, length: int) -> Optional[StoredTensor]:
    """Parse one ``torch.save`` archive in place; ``None`` when it is not a plain dense
    little-endian tensor in a stored (uncompressed) record."""
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
        storage, storage_offset, size, stride = _TensorPickleUnpickler(io.BytesIO(zf.read(pkl))).load()
    except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError):
        return None
    if not isinstance(storage, _StorageRef):
        return None
    try:
        info = zf.getinfo(f"{prefix}data/{storage.key}")
    except KeyError:
        return None
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    header = os.pread(fd, 30, start + info.header_offset)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    record = info.header_offset + 30 + name_len + extra_len
    itemsize = storage.dtype.itemsize
    if storage_offset + extent(size, stride) > storage.numel or info.file_size < storage.numel * itemsize:
        return None
    return StoredTensor(start + record + storage_offset * itemsize, storage.dtype, size, stride)


def extent(size: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a strided tensor's first element to its last (0 when empty)."""
    return 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0


def is_row_major(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is the row-major layout of ``size`` (dims of size 1 ignored)."""
    return all(s == r for n, s, r in zip(size, stride, row_major_strides(size)) if n > 1)


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
            try:
                import zstandard
            except ImportError:
                raise CheckpointFormatError(f"{where} is compressed with torch DCP's stream.zstd extension; install "
                                            "the 'zstandard' package to read it") from None
            blob = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read()
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
        if loc is not None and is_row_major(loc.size, loc.stride):
            self.bytes_read += read_slice_into(PosixFile(self._fd(info.relative_path), path), loc.data_offset,
                                               chunk_sizes, loc.dtype, item.storage_offsets, item.lengths, dest)
            return
        blob = self._item_bytes(index, info)  # anything else (a strided chunk too): through torch.load
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
        info = storage_entry(self.metadata, index, self._root())
        blob = self._item_bytes(index, info)
        self.bytes_read += len(blob)
        return blob, str(self._root() / info.relative_path)
