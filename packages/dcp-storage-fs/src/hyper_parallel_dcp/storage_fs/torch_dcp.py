"""Read checkpoints written by ``torch.distributed.checkpoint`` (torch 2.4 – 2.13).

Such a directory holds a pickled ``.metadata`` and ``__{rank}_{n}.distcp`` files in which
every tensor chunk is one ``torch.save`` archive (an uncompressed zip) and every object
the ``torch.save`` bytes of it.  :class:`TorchDCPReader` translates the pickle into this
library's :class:`Metadata` view, so the standard load planner, resharding and
read-once + broadcast work unchanged, and reads each chunk's bytes straight from the
zip's data record into the destination (``preadv``, as :class:`FileSystemReader` does).

No code from the checkpoint runs: ``.metadata`` is unpickled with an allow-list (torch
DCP's metadata classes, ``torch.Size``, dtypes, layouts, plain containers) whose classes
are replaced by inert records; anything else is refused with :class:`UnsafeObjectError`
naming the class.  A chunk's ``data.pkl`` goes through a second, smaller allow-list; an
archive the fast path does not recognise is read with ``torch.load(weights_only=True)``,
and so are objects.  torch's optional stream transforms: ``stream.zstd`` is decompressed
when the ``zstandard`` module is installed; any other is refused, naming it.
"""

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

from hyper_parallel_dcp.core.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeObjectError,
)
from hyper_parallel_dcp.core.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
)
from hyper_parallel_dcp.core.objects import deserialize_object
from hyper_parallel_dcp.core.planner import ReadItem

from .direct_read import _buffer, _pread_exact, copy_into, read_slice_into
from .filesystem import METADATA_FILE, FileSystemReader

__all__ = ["TorchDCPReader", "is_torch_dcp_checkpoint", "read_torch_dcp_metadata", "storage_reader_for_path"]

_DCP = "torch.distributed.checkpoint"
#: torch DCP classes a ``.metadata`` pickle may name (module, class) → inert record.
_RECORD_CLASSES = {
    (f"{_DCP}.metadata", "Metadata"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}._fsspec_filesystem", "_StorageInfo"),
}
_PATH_CLASSES = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}


class _Record:
    """Stands in for an allow-listed torch DCP class: keeps its pickled state, runs nothing."""

    kind = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        obj = object.__new__(cls)
        obj.__dict__["_args"] = args
        return obj

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


_RECORDS: dict[tuple[str, str], type] = {
    key: type(key[1], (_Record,), {"kind": key[1]}) for key in _RECORD_CLASSES
}


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
    if isinstance(props, _Record):
        state = props.__dict__.get("_state")
        dtype = state[0] if isinstance(state, tuple) and state else props.__dict__.get("dtype")
    else:
        dtype = None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"{where}: tensor properties without a dtype ({dtype!r})")
    return dtype


def read_torch_dcp_metadata(path: Union[str, os.PathLike]) -> tuple[Metadata, dict[MetadataIndex, tuple[str, ...]]]:
    """Parse the pickled ``.metadata`` of a torch DCP checkpoint into this library's view.

    Returns ``(metadata, transforms)``: ``metadata.storage_data`` gives each item's file and
    byte range (no checksums: torch records none), ``transforms`` the stream-transform
    descriptors of the items that have any.  Raises :class:`CheckpointNotFoundError` when
    the file is missing, :class:`UnsafeObjectError` naming a class outside the allow-list
    (nothing is executed), :class:`CheckpointFormatError` for anything else unexpected.
    """
    file = Path(path) / METADATA_FILE
    try:
        raw = file.read_bytes()
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
            sd[fqn] = BytesStorageMetadata()
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
                chunks.append(ChunkStorageMetadata(offsets, sizes))
            chunks.sort(key=lambda c: c.offsets)
            sd[fqn] = TensorStorageMetadata(TensorProperties(_dtype_of(e.get("properties"), where)),
                                            torch.Size(size), chunks)
        else:
            raise CheckpointFormatError(f"{where}: unknown item type {kind}")
    storage: dict[MetadataIndex, StorageInfo] = {}
    transforms: dict[MetadataIndex, tuple[str, ...]] = {}
    for index, info in (state.get("storage_data") or {}).items():
        i, s = index.__dict__, info.__dict__
        fqn = i.get("fqn")
        offset = i.get("offset")
        key = MetadataIndex(str(fqn), None if offset is None else _ints(offset, f"{source}: {fqn!r} offsets"))
        name = s.get("relative_path")
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointFormatError(f"{source}: invalid file name {name!r} for {fqn!r}")
        start, length = _ints([s.get("offset"), s.get("length")], f"{source}: byte range of {fqn!r}")
        storage[key] = StorageInfo(name, start, length)
        descriptors = s.get("transform_descriptors")
        if descriptors:
            transforms[key] = tuple(str(d) for d in descriptors)
    return Metadata(state_dict_metadata=sd, storage_data=storage), transforms


def is_torch_dcp_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """True when ``path/.metadata`` exists and starts with a pickle protocol byte."""
    try:
        with open(Path(path) / METADATA_FILE, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


def storage_reader_for_path(path: Union[str, os.PathLike], verify: Optional[bool] = None) -> FileSystemReader:
    """The reader for a local checkpoint directory: :class:`TorchDCPReader` for a torch DCP
    checkpoint (pickled ``.metadata``), else :class:`FileSystemReader`.

    ``verify`` (``None``: the reader's default) is passed on; a torch DCP checkpoint has no
    checksums, so ``verify=True`` on one fails when its metadata is read.
    """
    cls = TorchDCPReader if is_torch_dcp_checkpoint(path) else FileSystemReader
    return cls(path) if verify is None else cls(path, verify=verify)


# ----------------------------------------------------------------------- chunk archives
class _Window(io.RawIOBase):
    """A read-only, seekable view of ``[start, start + length)`` of an open file."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        data = os.pread(self.fd, n, self.start + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass(frozen=True)
class _StoredTensor:
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
    """Reads a chunk archive's ``data.pkl`` as plain description; refuses anything but a
    plain dense tensor (the caller then falls back to ``torch.load(weights_only=True)``)."""

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


def _locate_tensor(fd: int, start: int, length: int) -> Optional[_StoredTensor]:
    """Parse one ``torch.save`` archive in place; ``None`` when it is not a plain dense
    little-endian tensor in a stored (uncompressed) record."""
    try:
        zf = zipfile.ZipFile(_Window(fd, start, length))
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
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    if storage_offset + extent > storage.numel or info.file_size < storage.numel * itemsize:
        return None
    return _StoredTensor(start + record + storage_offset * itemsize, storage.dtype, size, stride)


def _row_major(size: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _is_row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    return all(s == r for n, s, r in zip(size, stride, _row_major(size)) if n > 1)


def _zstd_decompress(blob: bytes, where: str) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise CheckpointFormatError(
            f"{where} is compressed with torch DCP's stream.zstd extension; install the 'zstandard' "
            "package to read it"
        ) from None
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read()


class TorchDCPReader(FileSystemReader):
    """A :class:`FileSystemReader` for torch DCP directories (see the module docstring).

    Everything above the bytes is inherited: the load planner sees the translated
    :class:`Metadata`, and :meth:`read_into` / :meth:`read_object` / :meth:`execute_read`
    are what the pipeline and the broadcast executor call.  A dense little-endian chunk is
    read with ``preadv`` straight into its destination (only the requested slice when the
    chunk is stored row-major; the chunk's byte span otherwise); any other archive goes
    through ``torch.load(weights_only=True)``.  ``verify=True`` is refused: torch records
    no checksums (convert with ``hp-dcp-convert torch-dcp-to-dcp`` to get them).
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, verify: bool = False) -> None:
        super().__init__(path, verify=verify)
        self._transforms: dict[MetadataIndex, tuple[str, ...]] = {}
        self._located: dict[MetadataIndex, Optional[_StoredTensor]] = {}
        self._fds: dict[str, int] = {}
        self._parsed: Optional[tuple[tuple[int, int, int], Metadata, dict[MetadataIndex, tuple[str, ...]]]] = None

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        super().reset(checkpoint_id)
        self._close_fds()
        self._located = {}
        self._parsed = None

    def _parse(self) -> tuple[Metadata, dict[MetadataIndex, tuple[str, ...]]]:
        """The translated metadata, parsed again only when ``.metadata`` changed (a
        converter or a tool loads many small pieces through one reader)."""
        try:
            st = os.stat(self._root() / METADATA_FILE)
            key: Optional[tuple[int, int, int]] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        if self._parsed is None or key is None or self._parsed[0] != key:
            metadata, transforms = read_torch_dcp_metadata(self._root())
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
        if self.verify:
            raise CheckpointFormatError(
                f"{self._root()} is a torch.distributed.checkpoint checkpoint, which records no checksums; "
                "load it with verify=False, or convert it with 'hp-dcp-convert torch-dcp-to-dcp' to get them"
            )
        self.metadata, self._transforms = self._parse()
        self._is_global = True
        return self.metadata

    # torch's .metadata is a pickle, not our JSON: the coordinator shares the translated
    # Metadata (the storage interface's default), not the stored bytes.
    def read_metadata_payload(self) -> Metadata:  # type: ignore[override]
        return self.read_metadata()

    def metadata_from_payload(self, payload: Metadata) -> Metadata:  # type: ignore[override]
        self.metadata = payload
        self._is_global = True
        return payload

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        super().set_up_storage_reader(metadata, is_coordinator=is_coordinator, rank=rank)
        # the stream transforms are not part of Metadata: take them from this directory
        self._transforms = self._parse()[1]

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            file = self._root() / name
            try:
                fd = os.open(file, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"checkpoint file {file} is missing") from None
            self._fds[name] = fd
        return fd

    def _item_bytes(self, index: MetadataIndex, info: StorageInfo) -> bytes:
        """The item's stored bytes, stream transforms undone."""
        fd = self._fd(info.relative_path)
        blob = os.pread(fd, info.length, info.offset)
        where = f"{self._root() / info.relative_path}: {index.fqn!r}"
        if len(blob) != info.length:
            raise CorruptCheckpointError(f"{where} is truncated ({len(blob)} of {info.length} bytes)")
        for descriptor in reversed(self._transforms.get(index, ())):
            name, _, version = descriptor.partition("/")
            if name == "stream.zstd" and version.partition(".")[0] == "1":
                blob = _zstd_decompress(blob, where)
            else:
                raise CheckpointFormatError(
                    f"{where} uses the torch DCP extension {descriptor!r}, which hyper-parallel-dcp does not "
                    "read (supported: stream.zstd/1)"
                )
        return blob

    def _location(self, index: MetadataIndex, info: StorageInfo) -> Optional[_StoredTensor]:
        if index not in self._located:
            located = None
            if not self._transforms.get(index):
                located = _locate_tensor(self._fd(info.relative_path), info.offset, info.length)
            self._located[index] = located
        return self._located[index]

    def read_into(self, item: ReadItem, dest: torch.Tensor) -> None:
        """Fill ``dest`` (shape ``item.lengths``) with the stored slice, casting to its dtype."""
        index = item.storage_index
        info = self._storage_info(index)
        chunk_sizes = self._chunk_sizes(index)
        where = f"{self._root() / info.relative_path}: {index.fqn!r} chunk at offsets {list(index.offset or ())}"
        if any(o + n > s for o, n, s in zip(item.storage_offsets, item.lengths, chunk_sizes)):
            raise CheckpointFormatError(f"{where}: requested region offsets={list(item.storage_offsets)} "
                                        f"lengths={list(item.lengths)} exceeds the stored chunk {list(chunk_sizes)}")
        loc = self._location(index, info)
        if loc is not None and loc.size != tuple(chunk_sizes):
            raise CorruptCheckpointError(f"{where}: stored tensor has shape {list(loc.size)}, "
                                         f"the metadata records {list(chunk_sizes)}")
        path = str(self._root() / info.relative_path)
        if loc is not None and _is_row_major(loc.size, loc.stride):
            self.bytes_read += read_slice_into(self._fd(info.relative_path), path, loc.data_offset, chunk_sizes,
                                               loc.dtype, item.storage_offsets, item.lengths, dest)
            return
        if loc is not None:  # a strided chunk (e.g. a transposed view): read its span once
            extent = 1 + sum((n - 1) * s for n, s in zip(loc.size, loc.stride)) if all(loc.size) else 0
            staging = torch.empty(extent, dtype=loc.dtype)
            if extent:
                _pread_exact(self._fd(info.relative_path), _buffer(staging), loc.data_offset, path)
            self.bytes_read += extent * loc.dtype.itemsize
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

    def read_object(self, item: ReadItem) -> Any:
        index = item.storage_index
        info = self._storage_info(index)
        blob = self._item_bytes(index, info)
        self.bytes_read += len(blob)
        return deserialize_object(blob, fqn=index.fqn, file=str(self._root() / info.relative_path))
