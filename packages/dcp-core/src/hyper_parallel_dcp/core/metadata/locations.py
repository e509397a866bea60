"""``storage_data`` as columns: where every chunk of every tensor is, without an object per chunk.

A :class:`StorageTable` (what parsing format 2 and unpacking give) is a read-only
``Mapping[MetadataIndex, StorageInfo]`` with one :class:`TensorStorage` row of columns per
tensor; :func:`storage_table` builds one from any ``Metadata``; :func:`chunk_locator` /
:func:`chunk_location` answer a load's "where is this chunk" from it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from itertools import chain, repeat
from operator import attrgetter
from typing import Any, Callable, NamedTuple, Optional, Union

from .model import (
    ChunkTable,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    chunk_key,
    chunk_keys,
)

__all__ = [
    "ChunkLocation",
    "FileNames",
    "StorageTable",
    "TensorStorage",
    "checked_chunks",
    "chunk_location",
    "chunk_locator",
    "storage_table",
]

_HEX = re.compile(r"[0-9a-f]*")
_PATH = attrgetter("relative_path")
_OFFSET = attrgetter("offset")
_LENGTH = attrgetter("length")
_CHECKSUM = attrgetter("checksum")
_KEY = attrgetter("key")

#: ``(file, byte offset, chunk sizes)`` of a stored tensor chunk, or ``None``: see :func:`chunk_location`
ChunkLocation = Optional[tuple[str, int, tuple[int, ...]]]


class TensorStorage(NamedTuple):
    """Where each chunk of ``chunks`` is stored: ``file`` indexes the table's ``files`` (``-1``:
    not stored); ``length`` is ``None`` where every length is elements x ``itemsize``;
    ``checksum``: 16 hex digits per chunk back to back, or a list of strings and ``None``;
    ``keys``: by position, the keys that are not :func:`~.model.chunk_key` of the chunk.
    """

    chunks: ChunkTable
    file: list[int]
    offset: list[int]
    length: Optional[list[int]]
    checksum: Union[str, list[Optional[str]]]
    keys: dict[int, Optional[str]]
    itemsize: int


class StorageTable(Mapping[MetadataIndex, StorageInfo]):
    """A read-only ``storage_data``: tensor chunks as :class:`TensorStorage` columns (each
    entry built on lookup), objects by FQN, and every ``other`` entry as given."""

    def __init__(self, files: list[str], tensors: dict[str, TensorStorage], objects: dict[str, StorageInfo],
                 other: dict[MetadataIndex, StorageInfo]) -> None:
        self.files = files
        self.tensors = tensors
        self.objects = objects
        self.other = other
        self._len = sum(t.chunks.chunk_count - t.file.count(-1) for t in tensors.values()) + len(objects) + len(other)

    def _info(self, fqn: str, stored: TensorStorage, pos: int) -> StorageInfo:
        chunks = stored.chunks
        ndim = chunks.ndim
        offsets = tuple(chunks.offsets[pos * ndim:(pos + 1) * ndim])
        key = stored.keys[pos] if pos in stored.keys else chunk_key(fqn, offsets)
        if stored.length is not None:
            length = stored.length[pos]
        else:
            length = math.prod(chunks.sizes[pos * ndim:(pos + 1) * ndim]) * stored.itemsize
        checksum = stored.checksum
        digest = checksum[16 * pos:16 * pos + 16] if type(checksum) is str else checksum[pos]
        return StorageInfo(self.files[stored.file[pos]], stored.offset[pos], length, digest, key)

    def __getitem__(self, index: MetadataIndex) -> StorageInfo:
        if index.offset is None:
            info = self.objects.get(index.fqn)
            if info is not None:
                return info
        else:
            stored = self.tensors.get(index.fqn)
            pos = None if stored is None else stored.chunks.find(index.offset, index.index)
            if pos is not None and stored is not None and stored.file[pos] >= 0:
                return self._info(index.fqn, stored, pos)
        return self.other[index]

    def locate(self, index: MetadataIndex) -> ChunkLocation:
        """``(file, byte offset, chunk sizes)`` of tensor chunk ``index`` (no
        :class:`StorageInfo` built); ``None`` where it is not a stored tensor chunk."""
        stored = self.tensors.get(index.fqn)
        offsets = index.offset
        if stored is None or offsets is None:
            return None
        chunks = stored.chunks
        pos = chunks.find(offsets, index.index)
        if pos is None or stored.file[pos] < 0:
            return None
        ndim = chunks.ndim
        return self.files[stored.file[pos]], stored.offset[pos], tuple(chunks.sizes[pos * ndim:(pos + 1) * ndim])

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, stored in self.tensors.items():
            for pos, (file, offsets) in enumerate(zip(stored.file, stored.chunks.offset_tuples())):
                if file >= 0:
                    yield MetadataIndex(fqn, offsets, pos)
        for fqn in self.objects:
            yield MetadataIndex(fqn)
        yield from self.other

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} entries)"

    def describes(self, metadata: Metadata) -> bool:
        """Whether :func:`storage_table` of ``metadata`` is this table: each tensor row
        belongs to the same :class:`ChunkTable` object, objects are objects there, and no
        ``other`` entry names one of its chunks or objects."""
        sd = metadata.state_dict_metadata
        for fqn, stored in self.tensors.items():
            md = sd.get(fqn)
            if not isinstance(md, TensorStorageMetadata) or md.chunks is not stored.chunks or \
                    (md.properties.stored_as or md.properties.dtype).itemsize != stored.itemsize:
                return False
        if any(fqn not in sd or isinstance(sd[fqn], TensorStorageMetadata) for fqn in self.objects):
            return False
        for index in self.other:
            md = sd.get(index.fqn)
            if isinstance(md, TensorStorageMetadata):
                if index.offset is not None and ChunkTable.of(md.chunks, 0).find(index.offset) is not None:
                    return False
            elif md is not None and index.offset is None:
                return False
        return True


class FileNames:
    """File name → index, in the order the format lists them: ``first`` (a parsed file
    table's names), ``metadata.files``, then ``header_digests``, then each other file where
    it is first named."""

    def __init__(self, metadata: Metadata, first: Sequence[str] = ()) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []
        for name in chain(first, metadata.files, metadata.header_digests):
            self.add(name)

    def add(self, name: str) -> int:
        pos = self.index.get(name)
        if pos is None:
            pos = self.index[name] = len(self.names)
            self.names.append(name)
        return pos


def checked_chunks(fqn: str, md: TensorStorageMetadata) -> ChunkTable:
    """``md.chunks`` as a :class:`ChunkTable`; raises ``ValueError`` naming ``fqn`` when a
    chunk's offsets or sizes do not have one entry per dimension of the tensor."""
    ndim, chunks = len(md.size), md.chunks
    if isinstance(chunks, ChunkTable):
        bad = chunks.chunk_count and chunks.ndim != ndim
    else:
        bad = any(len(c.offsets) != ndim or len(c.sizes) != ndim for c in chunks)
    if bad:
        raise ValueError(f"{fqn!r}: a chunk's offsets or sizes do not have {ndim} entries (tensor size "
                         f"{list(md.size)})")
    return ChunkTable.of(chunks, ndim)


def storage_table(metadata: Metadata) -> StorageTable:
    """``metadata.storage_data`` (``None``: empty) as a :class:`StorageTable` aligned with
    ``metadata``'s tensors (the table itself when it :meth:`~StorageTable.describes` them);
    entries of no chunk or object go to ``other``.  Raises as :func:`checked_chunks` does.
    """
    storage = metadata.storage_data
    if isinstance(storage, StorageTable) and storage.describes(metadata):
        return storage
    names = FileNames(metadata)
    by_fqn: dict[str, dict[Optional[tuple[int, ...]], Optional[StorageInfo]]] = {}
    for index, info in (storage or {}).items():
        by_fqn.setdefault(index.fqn, {})[index.offset] = info
    tensors: dict[str, TensorStorage] = {}
    objects: dict[str, StorageInfo] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        stored = by_fqn.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            found = stored.pop(None, None) if stored else None
            if found is not None:
                names.add(found.relative_path)
                objects[fqn] = found
            continue
        chunks = checked_chunks(fqn, md)
        row = _tensor_storage(fqn, md, chunks, stored, names) if stored else None
        if row is not None:
            tensors[fqn] = row
    other = {MetadataIndex(fqn, offset): info for fqn, rest in by_fqn.items() for offset, info in rest.items()
             if info is not None}
    for info in other.values():
        names.add(info.relative_path)
    return StorageTable(names.names, tensors, objects, other)


def _tensor_storage(fqn: str, md: TensorStorageMetadata, chunks: ChunkTable,
                    stored: dict[Optional[tuple[int, ...]], Optional[StorageInfo]],
                    names: FileNames) -> Optional[TensorStorage]:
    """The row of ``fqn``'s chunks, their entries taken out of ``stored``; ``None`` when
    none of them is stored."""
    offsets = chunks.offset_tuples()
    infos: list[Any] = list(map(stored.get, offsets))
    count = chunks.chunk_count
    if len(stored) == count and all(infos) and (count == 1 or len(set(offsets)) == count):
        stored.clear()  # every entry is one chunk's: no pop per chunk
    else:
        infos = list(map(stored.pop, offsets, repeat(None)))
        if not any(infos):  # a StorageInfo is never false
            return None
    props = md.properties
    itemsize = (props.stored_as or props.dtype).itemsize
    ndim, sizes = chunks.ndim, chunks.sizes
    if count and sizes[:ndim] * count == sizes:
        derived = [math.prod(sizes[:ndim]) * itemsize] * count
    else:
        derived = [math.prod(size) * itemsize for size in chunks.size_tuples()]
    if all(infos):
        files: list[int] = list(map(names.index.get, map(_PATH, infos)))  # type: ignore[arg-type]
        if None in files:
            files = [names.add(i.relative_path) for i in infos]
        positions, lengths = list(map(_OFFSET, infos)), list(map(_LENGTH, infos))
        checksums, keys = list(map(_CHECKSUM, infos)), list(map(_KEY, infos))
    else:
        files = [-1 if i is None else names.add(i.relative_path) for i in infos]
        positions = [0 if i is None else i.offset for i in infos]
        lengths = [0 if i is None else i.length for i in infos]
        checksums = [None if i is None else i.checksum for i in infos]
        keys = [None if i is None else i.key for i in infos]
        derived = [0 if i is None else n for i, n in zip(infos, derived)]
    own_keys = chunk_keys(fqn, offsets, ndim)
    odd_keys = {} if keys == own_keys else {pos: key for pos, (key, own, info) in enumerate(zip(keys, own_keys, infos))
                                             if info is not None and key != own}
    checksum: Union[str, list[Optional[str]]] = checksums
    if None not in checksums and set(map(len, checksums)) == {16}:  # type: ignore[arg-type]
        joined = "".join(checksums)  # type: ignore[arg-type]
        if _HEX.fullmatch(joined):
            checksum = joined
    return TensorStorage(chunks, files, positions, None if lengths == derived else lengths, checksum, odd_keys,
                         itemsize)


def chunk_locator(metadata: Metadata) -> Optional[Callable[[MetadataIndex], ChunkLocation]]:
    """:func:`chunk_location` bound to ``metadata``; ``None`` where its ``storage_data`` is
    no :class:`StorageTable` (use ``storage_data`` then)."""
    storage = metadata.storage_data
    return storage.locate if isinstance(storage, StorageTable) else None


def chunk_location(metadata: Metadata, index: MetadataIndex) -> ChunkLocation:
    """``(file, byte offset, chunk sizes)`` of tensor chunk ``index`` from a :class:`StorageTable`'s
    columns; ``None`` otherwise (look it up in ``storage_data`` then)."""
    locate = chunk_locator(metadata)
    return None if locate is None else locate(index)
