"""The checkpoint's global description as plain data: the schema ``.metadata`` stores.

``Metadata`` says, for every FQN, the global shape, dtype and stored chunks (a list, or a
:class:`ChunkTable` of two flat integer columns); ``storage_data`` where each chunk's bytes
are.  Exports the dataclasses, :class:`ChunkTable`, :func:`chunk_key`, :func:`chunk_keys`,
:func:`dtype_name`, :func:`dtype_from_name`, :func:`tensor_metadata_from_columns`,
:func:`chunk_columns` and :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from operator import le
from typing import Any, Optional, Union

import torch

from ..errors import CheckpointFormatError
from ..format_version import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "ChunkTable",
    "Metadata",
    "MetadataIndex",
    "StorageInfo",
    "StorageMetadata",
    "TensorProperties",
    "TensorStorageMetadata",
    "chunk_columns",
    "chunk_key",
    "chunk_keys",
    "dtype_from_name",
    "dtype_name",
    "tensor_metadata_from_columns",
]


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name in the metadata: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype :func:`dtype_name` names; raises :class:`CheckpointFormatError` for another name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


# Characters at or below "!" are escaped as "!" + two hex digits: every character of an
# escaped FQN sorts above the space that ends it.
_KEY_ESCAPE = re.compile(r"[\x00-\x21]")
# "%012d_%012d..." per number of dims: one %-format per key (a key is made per chunk)
_OFFSET_FORMATS = ["_".join(["%012d"] * n) for n in range(9)]


def _key_prefix(fqn: str) -> str:
    name = _KEY_ESCAPE.sub(lambda m: f"!{ord(m.group()):02x}", fqn) if _KEY_ESCAPE.search(fqn) else fqn
    return name + " "


def chunk_key(fqn: str, offsets: tuple[int, ...]) -> str:
    """The storage key of a chunk, ``<fqn> <o0>_<o1>_...`` (offsets zero-padded to 12 digits,
    characters of the FQN at or below ``"!"`` written ``"!"`` + two hex digits): the string
    order of keys is the order of ``(fqn, offsets)`` tuples, the global read/write order.
    """
    n = len(offsets)
    if n < len(_OFFSET_FORMATS) and type(offsets) is tuple:
        return _key_prefix(fqn) + _OFFSET_FORMATS[n] % offsets
    return _key_prefix(fqn) + "_".join(f"{o:012d}" for o in offsets)


def chunk_keys(fqn: str, offsets: Sequence[tuple[int, ...]], ndim: int) -> list[str]:
    """:func:`chunk_key` of each of ``offsets`` (tuples of ``ndim`` integers each)."""
    prefix = _key_prefix(fqn)
    if ndim < len(_OFFSET_FORMATS):
        # the whole key in one %-format, mapped in C; the name's own "%" stays text
        return list(map((prefix.replace("%", "%%") + _OFFSET_FORMATS[ndim]).__mod__, offsets))
    return [chunk_key(fqn, o) for o in offsets]


@dataclass(frozen=True)
class ChunkStorageMetadata:
    """One stored box of a tensor: ``offsets`` and ``sizes`` in the global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class ChunkTable(Sequence[ChunkStorageMetadata]):
    """The chunks of one tensor as two flat columns (``ndim`` integers per chunk, kept, not
    copied); an immutable sequence of :class:`ChunkStorageMetadata` built on access, equal
    to a list of the same chunks.  ``ascending``: whether the chunks ascend by offsets
    (``None``: checked on first read).  Raises ``ValueError`` when a column does not hold
    ``ndim * count`` integers.
    """

    __slots__ = ("ndim", "chunk_count", "offsets", "sizes", "_ascending", "_positions")

    def __init__(self, ndim: int, count: int, offsets: list[int], sizes: list[int],
                 ascending: Optional[bool] = None) -> None:
        if len(offsets) != ndim * count or len(sizes) != ndim * count:
            raise ValueError(f"chunk columns of {len(offsets)} offsets and {len(sizes)} sizes for {count} chunks "
                             f"of {ndim} dims")
        self.ndim = ndim
        self.chunk_count = count
        self.offsets = offsets
        self.sizes = sizes
        self._ascending = ascending
        self._positions: Optional[dict[tuple[int, ...], int]] = None

    @classmethod
    def of(cls, chunks: Sequence[ChunkStorageMetadata], ndim: int) -> ChunkTable:
        """``chunks`` as a table (the same object if it is one); ``ndim`` is taken for an
        empty list.  Raises ``ValueError`` for chunks of other numbers of dims."""
        if isinstance(chunks, ChunkTable):
            return chunks
        ndim = len(chunks[0].offsets) if chunks else ndim
        if any(len(c.offsets) != ndim or len(c.sizes) != ndim for c in chunks):
            raise ValueError(f"chunks of {ndim} and of other numbers of dims")
        offsets = list(chain.from_iterable(c.offsets for c in chunks))
        return cls(ndim, len(chunks), offsets, list(chain.from_iterable(c.sizes for c in chunks)))

    def offset_tuples(self) -> list[tuple[int, ...]]:
        """Every chunk's offsets, in order."""
        return list(zip(*[iter(self.offsets)] * self.ndim)) if self.ndim else [()] * self.chunk_count

    def size_tuples(self) -> list[tuple[int, ...]]:
        """Every chunk's sizes, in order."""
        return list(zip(*[iter(self.sizes)] * self.ndim)) if self.ndim else [()] * self.chunk_count

    @property
    def ascending(self) -> bool:
        """Whether the chunks ascend by offsets (checked on the first read when not given)."""
        if self._ascending is None:
            tuples = self.offset_tuples()
            self._ascending = all(map(le, tuples, islice(tuples, 1, None)))
        return self._ascending

    def find(self, offsets: tuple[int, ...], hint: Optional[int] = None) -> Optional[int]:
        """Position of the first chunk at ``offsets`` (``hint``, a position, is tried first)."""
        ndim = self.ndim
        if hint is not None and 0 <= hint < self.chunk_count and \
                tuple(self.offsets[hint * ndim:(hint + 1) * ndim]) == offsets:
            return hint
        if self._positions is None:
            count = self.chunk_count
            # reversed: where two chunks share offsets, the first one's position stays
            self._positions = dict(zip(reversed(self.offset_tuples()), range(count - 1, -1, -1)))
        return self._positions.get(offsets)

    def __len__(self) -> int:
        return self.chunk_count

    def __getitem__(self, pos: Any) -> Any:  # a chunk, or a list of them for a slice
        if isinstance(pos, slice):
            return list(self)[pos]
        if pos < 0:
            pos += self.chunk_count
        if not 0 <= pos < self.chunk_count:
            raise IndexError("chunk index out of range")
        ndim = self.ndim
        return ChunkStorageMetadata(tuple(self.offsets[pos * ndim:(pos + 1) * ndim]),
                                    tuple(self.sizes[pos * ndim:(pos + 1) * ndim]))

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        return map(ChunkStorageMetadata, self.offset_tuples(), self.size_tuples())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            return self.chunk_count == other.chunk_count and (not self.chunk_count or (
                self.ndim == other.ndim and self.offsets == other.offsets and self.sizes == other.sizes))
        if isinstance(other, (list, tuple)):
            return len(other) == self.chunk_count and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares equal to lists

    def __repr__(self) -> str:
        return f"ChunkTable({list(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return ChunkTable, (self.ndim, self.chunk_count, self.offsets, self.sizes, self._ascending)


@dataclass(frozen=True)
class TensorProperties:
    """``dtype`` is the tensor's true dtype; ``stored_as`` (``None``: the same) is the dtype
    its files hold it as, e.g. a same-size integer view of a dtype safetensors cannot name."""

    dtype: torch.dtype
    stored_as: torch.dtype | None = None


@dataclass
class TensorStorageMetadata:
    """Global shape, dtype and the stored (deduplicated) chunks of one tensor; ``chunks``
    is a list or a :class:`ChunkTable`."""

    properties: TensorProperties
    size: torch.Size
    chunks: Sequence[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """A non-tensor object, stored pickled in a ``.bytes`` file."""


StorageMetadata = Union[TensorStorageMetadata, BytesStorageMetadata]


@dataclass(frozen=True, init=False)
class MetadataIndex:
    """Names one stored item: an FQN plus, for a tensor chunk, its global offsets; ``index``
    is only a lookup hint (the chunk's position), outside equality and hashing."""

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(default=None, hash=False, compare=False)

    def __init__(self, fqn: str, offset: tuple[int, ...] | None = None, index: int | None = None) -> None:
        # the generated __init__'s frozen instance in half the time (one per chunk planned)
        values = self.__dict__
        values["fqn"] = fqn
        values["offset"] = offset
        values["index"] = index


@dataclass(frozen=True)
class StorageInfo:
    """Where the bytes of one stored item are: the byte range in ``relative_path``, their
    xxh3-64 hex digest, and the tensor's name in the safetensors header (``None``: objects)."""

    relative_path: str
    offset: int
    length: int
    checksum: str | None = None
    key: str | None = None


@dataclass
class Metadata:
    """The global description of a checkpoint."""

    state_dict_metadata: dict[str, StorageMetadata]
    planner_data: Any = None
    #: A dict, or (parsed, or received from the coordinator of a save) a read-only
    #: ``StorageTable``: replace it, do not mutate it, to change a loaded checkpoint's.
    storage_data: Mapping[MetadataIndex, StorageInfo] | None = None
    files: dict[str, int] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    #: file name -> xxh3 hex digest of its safetensors header as written (length field and
    #: JSON): a reader that reads the same bytes skips the header parse.  Empty for older
    #: checkpoints, objects files, and a document whose digest was not checked.
    header_digests: dict[str, str] = field(default_factory=dict)
    #: An object whose copies saved by several ranks differ: saving rank → where its copy
    #: is (``storage_data`` holds the lowest rank's; see :meth:`object_storage`).  A global
    #: save plan's metadata names these FQNs with ``{}`` until the ranks write.
    rank_objects: dict[str, dict[int, StorageInfo]] = field(default_factory=dict)

    def object_storage(self, fqn: str, rank: int) -> StorageInfo | None:
        """Where the copy of object ``fqn`` that ``rank`` loads is (SPEC §4): the copy
        ``rank`` saved, else the lowest saving rank's (the one in ``storage_data``)."""
        copies = self.rank_objects.get(fqn)
        if copies and rank in copies:
            return copies[rank]
        return (self.storage_data or {}).get(MetadataIndex(fqn))


def tensor_metadata_from_columns(fqn: str, properties: TensorProperties, size: torch.Size, count: int, ndim: int,
                                 offsets: list[int], sizes: list[int], *,
                                 ascending: Optional[bool] = None) -> TensorStorageMetadata:
    """A :class:`TensorStorageMetadata` whose ``count`` chunks are the :class:`ChunkTable`
    of the flat columns ``offsets`` and ``sizes`` (kept, not copied); ``ascending=True``
    when the caller sorted the chunks by offsets.  ``fqn`` names the tensor in errors."""
    try:
        table = ChunkTable(ndim, count, offsets, sizes, ascending)
    except ValueError as exc:
        raise ValueError(f"{fqn!r}: {exc}") from None
    return TensorStorageMetadata(properties, size, table)


def chunk_columns(md: TensorStorageMetadata) -> tuple[int, list[int], list[int], bool]:
    """``(ndim, offsets, sizes, ascending)``: every chunk's offsets and sizes as flat lists,
    ``ndim`` integers per chunk, in ``md.chunks`` order, and whether the chunks ascend by
    offsets.  For a :class:`ChunkTable` these are its own columns (do not modify them)."""
    table = ChunkTable.of(md.chunks, len(md.size))
    return table.ndim, table.offsets, table.sizes, table.ascending
