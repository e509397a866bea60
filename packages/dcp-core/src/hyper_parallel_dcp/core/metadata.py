"""The checkpoint's global description and its on-disk form (versioned JSON, no pickle).

``Metadata`` says, for every FQN, the global shape and dtype and which chunks are stored;
``storage_data`` says where each chunk's bytes are (file, byte range, checksum).  It is
written last by the coordinator; its presence means the checkpoint is complete.

On disk (``docs/format.md``), format 2 is column-shaped: per tensor, flat integer arrays
of chunk offsets, sizes, file index, byte offset and length, and a list of checksums;
file names live once in a file table and chunk keys are derived (:func:`chunk_key`).  No
string repeats per chunk, so the MoE layout at 8192 ranks (602,441 chunks) takes about a
third of torch's pickled metadata instead of twice it.  Parsing checks the columns with
C-level builtins and builds the per-chunk objects lazily: a tensor's ``chunks`` list when
it is first touched, a ``storage_data`` entry when it is looked up, so a rank pays only
for the tensors it loads.  Format 1 (one JSON object per chunk) still loads.

The writer ends the document with ``metadata_digest``, the xxh3-64 of everything before
it; the parser refuses a document that no longer matches it (edited or damaged after the
save), and keeps ``header_digests`` only from a document whose digest it checked: the
reader takes every chunk's location from the metadata alone once a file's header digest
matches, so the metadata those locations come from must be the one the save wrote.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import chain, islice
from operator import add, attrgetter, le
from typing import Any, Optional, Union

import torch
import xxhash

from .errors import CheckpointFormatError, CorruptCheckpointError

__all__ = [
    "FORMAT_VERSION",
    "METADATA_DIGEST",
    "BytesStorageMetadata",
    "ChunkLocation",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageInfo",
    "TensorProperties",
    "TensorStorageMetadata",
    "chunk_columns",
    "chunk_key",
    "chunk_location",
    "chunk_locator",
    "dtype_from_name",
    "dtype_name",
    "lazily_unpacked",
    "metadata_from_json",
    "metadata_to_json",
    "pack_metadata",
    "tensor_metadata_from_columns",
    "unpack_metadata",
]

#: Version of the ``.metadata`` JSON schema this code writes and the newest it reads.
FORMAT_VERSION = 2

#: The last member of a written ``.metadata``: the xxh3-64 of the document without it
#: (``docs/format.md``, "metadata digest").  An optional key of format 2.
METADATA_DIGEST = "metadata_digest"


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


# Characters at or below "!" are escaped as "!" + two hex digits, so every character of an
# escaped FQN sorts above the space that ends it: the space then sorts before whatever
# continues a longer FQN, whichever characters the FQNs use.  "!" is below every character
# left unescaped, and two hex digits keep the escapes in code point order.
_KEY_ESCAPE = re.compile(r"[\x00-\x21]")


def _escape_fqn(fqn: str) -> str:
    return _KEY_ESCAPE.sub(lambda m: f"!{ord(m.group()):02x}", fqn)


def chunk_key(fqn: str, offsets: tuple[int, ...]) -> str:
    """The storage key of a chunk; the sort order of keys is the global read/write order.

    ``<fqn> <o0>_<o1>_...``: offsets zero-padded to 12 digits so that string order equals
    numeric order within an FQN; in the FQN every character at or below ``"!"`` (space,
    control characters, ``"!"`` itself) is written ``"!"`` + two hex digits, so the space
    separator sorts before every character of an FQN and the string order of keys is
    exactly the order of ``(fqn, offsets)`` tuples for any FQNs:
    ``"blocks.1 …" < "blocks.10 …" < "blocks.1a …"``, ``"a …" < "a!20!21 …"`` (FQN ``"a !"``).
    FQNs without such characters keep their name unchanged in the key.
    """
    name = _escape_fqn(fqn) if _KEY_ESCAPE.search(fqn) else fqn
    return name + " " + _offsets_text(offsets)


# "%012d_%012d..." per number of dims: one %-format per key instead of a join over a
# generator (a key is made per chunk when a save writes and when its metadata is built)
_OFFSET_FORMATS = ["_".join(["%012d"] * n) for n in range(9)]


def _offsets_text(offsets: tuple[int, ...]) -> str:
    n = len(offsets)
    if n < len(_OFFSET_FORMATS) and type(offsets) is tuple:
        return _OFFSET_FORMATS[n] % offsets
    return "_".join(f"{o:012d}" for o in offsets)


@dataclass(frozen=True)
class ChunkStorageMetadata:
    """One stored box of a tensor: ``offsets`` and ``sizes`` in the global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorProperties:
    """``dtype`` is the tensor's true dtype; ``stored_as`` (``None``: the same) is the dtype
    its files hold it as, e.g. a same-size integer view of a dtype safetensors cannot name."""

    dtype: torch.dtype
    stored_as: torch.dtype | None = None


@dataclass
class TensorStorageMetadata:
    """Global shape, dtype and the stored (deduplicated) chunks of one tensor."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """A non-tensor object, stored pickled in a ``.bytes`` file."""


StorageMetadata = Union[TensorStorageMetadata, BytesStorageMetadata]


@dataclass(frozen=True, init=False)
class MetadataIndex:
    """Names one stored item: an FQN plus, for a tensor chunk, its global offsets.

    ``index`` is only a lookup hint (the chunk's position in ``chunks``); it takes no part
    in equality or hashing.
    """

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(default=None, hash=False, compare=False)

    def __init__(self, fqn: str, offset: tuple[int, ...] | None = None, index: int | None = None) -> None:
        # A frozen dataclass's generated __init__ sets each field through
        # object.__setattr__; filling __dict__ makes the same frozen instance in half the
        # time (1.0 -> 0.5 us on the 2-core dev machine), and a load plan makes one per
        # stored chunk it reads, a save plan one per chunk it writes.
        values = self.__dict__
        values["fqn"] = fqn
        values["offset"] = offset
        values["index"] = index


@dataclass(frozen=True)
class StorageInfo:
    """Where the bytes of one stored item are.

    ``offset``/``length`` are the byte range of the item's data in ``relative_path``;
    ``checksum`` is the xxh3-64 hex digest of those bytes; ``key`` is the tensor's name
    in the safetensors header (``None`` for pickled objects).
    """

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
    #: A dict, or for a parsed format-2 checkpoint a read-only mapping that builds each
    #: entry on lookup; replace it (do not mutate it) to change a loaded checkpoint's.
    storage_data: Mapping[MetadataIndex, StorageInfo] | None = None
    files: dict[str, int] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    #: file name -> xxh3 hex digest of its safetensors header bytes as written (length
    #: field and JSON); a reader that reads the same bytes needs no header parse and no
    #: per-chunk header check.  Absent for older checkpoints and for objects files, and
    #: left empty by :func:`metadata_from_json` unless the document's ``metadata_digest``
    #: was checked.
    header_digests: dict[str, str] = field(default_factory=dict)
    #: Only in a view merged from ``{rank}.metadata`` files (never written): for an object
    #: saved by several ranks under one FQN, saving rank → where that rank's copy is.
    #: ``storage_data`` holds the lowest saving rank's copy; see :meth:`object_storage`.
    rank_objects: dict[str, dict[int, StorageInfo]] = field(default_factory=dict)

    def object_storage(self, fqn: str, rank: int) -> StorageInfo | None:
        """Where the copy of object ``fqn`` that ``rank`` loads is (SPEC §4).

        Rank-local state (RNG, data-loader position) saved by several ranks: rank ``r``
        gets the copy rank ``r`` saved; a rank that saved none gets the lowest saving
        rank's copy (the one in ``storage_data``).
        """
        copies = self.rank_objects.get(fqn)
        if copies and rank in copies:
            return copies[rank]
        return (self.storage_data or {}).get(MetadataIndex(fqn))


def _ints(value: Any, what: str) -> tuple[int, ...]:
    # Called for every chunk of every tensor: the common valid case is checked with C-level
    # builtins (json gives exact ints; bool is a different type), the slow path explains.
    if type(value) is list and (not value or (set(map(type, value)) == {int} and min(value) >= 0)):
        return tuple(value)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise CheckpointFormatError(f"{what} must be a list of integers, got {value!r}")
    if any(v < 0 for v in value):
        raise CheckpointFormatError(f"{what} must not be negative, got {value!r}")
    return tuple(value)


def metadata_from_json(text: str | bytes, *, source: str = "<metadata>", check_digest: bool = True) -> Metadata:
    """Parse ``.metadata`` JSON; raises :class:`CheckpointFormatError` naming ``source``.

    A document that carries ``metadata_digest`` (every one this library writes) must still
    match it: otherwise :class:`CorruptCheckpointError` naming ``source``, raised after the
    checks of its content, so a malformed entry is still reported by name.
    ``header_digests`` are kept only from a document whose digest was checked; an older
    document (no digest) parses as before, without them, so its files take the full
    per-chunk header check.  ``check_digest=False`` parses an altered document anyway
    (for tools that report what else is wrong in it), also without ``header_digests``.
    """
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurd nesting
        raise CheckpointFormatError(f"{source} is not valid checkpoint metadata JSON: {exc}") from None
    if not isinstance(doc, dict) or "format_version" not in doc:
        raise CheckpointFormatError(f"{source} is not checkpoint metadata (no 'format_version')")
    version = doc["format_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointFormatError(f"{source} has an invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{source} has format_version {version}, newer than the {FORMAT_VERSION} this "
            "version of hyper-parallel-dcp reads; upgrade hyper-parallel-dcp to load it"
        )
    digest = doc.get(METADATA_DIGEST)
    if digest is not None and not (type(digest) is str and _HEX16.fullmatch(digest)):
        raise CheckpointFormatError(f"{source}: '{METADATA_DIGEST}' must be an xxh3 digest of 16 hex digits, "
                                    f"got {digest!r}")
    try:
        metadata = _parse_v1(doc, source) if version == 1 else _parse_v2(doc, source)
        checked = digest is not None and check_digest
        if digest is not None and checked and not _digest_matches(text, doc, digest):
            raise CorruptCheckpointError(
                f"{source} was changed after the save: it no longer matches the '{METADATA_DIGEST}' recorded "
                "in it (hand-edited or damaged), so its chunk locations cannot be trusted; restore it as saved "
                "or save again (`hp-dcp verify` lists what disagrees with the data files)"
            )
    except (CheckpointFormatError, CorruptCheckpointError):
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RuntimeError) as exc:
        raise CheckpointFormatError(f"{source} is malformed: {type(exc).__name__}: {exc}") from None
    if not checked:
        metadata.header_digests = {}  # locations of unchecked metadata never skip the header check
    return metadata


def _digest_matches(text: str | bytes, doc: dict[str, Any], digest: str) -> bool:
    """Whether ``doc`` (parsed from ``text``) is the document ``digest`` was computed over.

    As written, the digest is the last member: its bytes are cut off and the rest hashed
    in place (a 2000-tensor ``.metadata``, 389 KB: 0.008 ms; parsing it takes 17.7 ms).
    A document re-serialised by a JSON tool (indented, reordered members) is compared in
    the compact form the writer hashed, rebuilt from ``doc`` (4.7 ms there): equal
    content passes, whatever the whitespace.
    """
    data = text.encode() if isinstance(text, str) else text
    tail = f',"{METADATA_DIGEST}":"{digest}"}}'.encode()
    if data.endswith(tail):
        hasher = xxhash.xxh3_64()
        with memoryview(data) as view:
            hasher.update(view[:len(data) - len(tail)])
        hasher.update(b"}")
        if hasher.hexdigest() == digest:
            return True
    content = {key: value for key, value in doc.items() if key != METADATA_DIGEST}
    return xxhash.xxh3_64_hexdigest(json.dumps(content, separators=(",", ":")).encode()) == digest


def _with_digest(text: str) -> str:
    """``text`` (a compact JSON object, ASCII) with ``metadata_digest`` appended as its
    last member: the xxh3-64 of ``text`` itself."""
    return f'{text[:-1]},"{METADATA_DIGEST}":"{xxhash.xxh3_64_hexdigest(text.encode())}"}}'


def _parse_v1(doc: dict[str, Any], source: str) -> Metadata:
    sd_doc = doc["state_dict_metadata"]
    if not isinstance(sd_doc, dict):
        raise CheckpointFormatError(f"{source}: state_dict_metadata must be an object")
    state_dict_metadata: dict[str, StorageMetadata] = {}
    for fqn, entry in sd_doc.items():
        kind = entry["type"]
        if kind == "tensor":
            size = _ints(entry["size"], f"{source}: size of {fqn!r}")
            chunks = []
            for chunk in entry["chunks"]:
                offsets = _ints(chunk["offsets"], f"{source}: chunk offsets of {fqn!r}")
                sizes = _ints(chunk["sizes"], f"{source}: chunk sizes of {fqn!r}")
                if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o + s > d for o, s, d in zip(offsets, sizes, size)
                ):
                    raise CheckpointFormatError(
                        f"{source}: chunk offsets={list(offsets)} sizes={list(sizes)} of {fqn!r} "
                        f"does not fit its global size {list(size)}"
                    )
                chunks.append(ChunkStorageMetadata(offsets, sizes))
            try:
                dtype = dtype_from_name(entry["dtype"])
                stored_as = dtype_from_name(entry["stored_as"]) if "stored_as" in entry else None
            except CheckpointFormatError as exc:
                raise CheckpointFormatError(f"{source}: {exc} (tensor {fqn!r})") from None
            state_dict_metadata[fqn] = TensorStorageMetadata(TensorProperties(dtype, stored_as), torch.Size(size),
                                                             chunks)
        elif kind == "bytes":
            state_dict_metadata[fqn] = BytesStorageMetadata()
        else:
            raise CheckpointFormatError(f"{source}: unknown item type {kind!r} for {fqn!r}")
    storage_data: dict[MetadataIndex, StorageInfo] = {}
    for entry in doc.get("storage_data") or []:
        offsets = entry.get("offsets")
        if not isinstance(entry["fqn"], str):  # str() would turn null into the key 'None'
            raise CheckpointFormatError(f"{source}: storage_data entry with a non-string fqn {entry['fqn']!r}")
        index = MetadataIndex(entry["fqn"], None if offsets is None else _ints(offsets, f"{source}: offsets"))
        file = entry["file"]
        if not isinstance(file, str) or "/" in file or "\\" in file or file in ("", ".", ".."):
            raise CheckpointFormatError(f"{source}: invalid file name {file!r} for {index.fqn!r}")
        byte_offset, length = _ints([entry["offset"], entry["length"]], f"{source}: byte range")
        storage_data[index] = StorageInfo(file, byte_offset, length, entry.get("checksum"), entry.get("key"))
    files = doc.get("files") or {}
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in files.items()
    ):
        raise CheckpointFormatError(f"{source}: 'files' must map file names to sizes")
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=doc.get("planner_data"),
        storage_data=storage_data,
        files=dict(files),
        format_version=doc["format_version"],
    )



# ------------------------------------------------------------------- between processes
_INDEX_FIELDS = attrgetter("fqn", "offset", "index")
_INFO_FIELDS = attrgetter("relative_path", "offset", "length", "checksum", "key")


def pack_metadata(metadata: Metadata) -> tuple[Any, ...]:
    """``metadata`` as plain columns (lists, tuples, strings, ints) for another process:
    :func:`unpack_metadata` gives it back, equal to ``metadata``.

    A save's coordinator sends the global metadata to every rank.  Pickled as objects,
    2000 tensors were ~8000 objects to pickle and build again (20-50 ms on the save's
    critical path); as columns it is a few lists per field, and no chunk object is built
    on either side (columnar tensors stay columnar).  Only builtin types, so any
    unpickler that allows plain data reads it.
    """
    tensors: list[tuple[Any, ...]] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            props = md.properties
            ndim, offsets, sizes, ascending = chunk_columns(md)
            count = len(offsets) // ndim if ndim else len(md.chunks)
            tensors.append((fqn, dtype_name(props.dtype), None if props.stored_as is None else
                            dtype_name(props.stored_as), tuple(md.size), ndim, count, offsets, sizes, ascending))
        else:
            tensors.append((fqn,))
    storage = metadata.storage_data
    columns: Optional[tuple[Any, ...]] = None
    if storage is not None:
        keys = list(storage.keys())
        infos = list(storage.values())
        columns = tuple(list(zip(*map(_INDEX_FIELDS, keys))) or [(), (), ()]) + \
            tuple(list(zip(*map(_INFO_FIELDS, infos))) or [(), (), (), (), ()])
    return (1, tensors, columns, dict(metadata.files), metadata.planner_data, metadata.format_version,
            {fqn: {r: _INFO_FIELDS(info) for r, info in copies.items()}
             for fqn, copies in metadata.rank_objects.items()}, dict(metadata.header_digests))


def unpack_metadata(packed: tuple[Any, ...]) -> Metadata:
    """The :class:`Metadata` of :func:`pack_metadata` (tensors columnar, chunks built on demand)."""
    version, tensors, columns, files, planner_data, format_version, rank_objects, *rest = packed
    header_digests = rest[0] if rest else {}
    if version != 1:
        raise ValueError(f"packed metadata of an unknown layout {version!r}")
    sd: dict[str, StorageMetadata] = {}
    for entry in tensors:
        if len(entry) == 1:
            sd[entry[0]] = BytesStorageMetadata()
            continue
        fqn, dtype, stored_as, size, ndim, count, offsets, sizes, ascending = entry
        props = TensorProperties(dtype_from_name(dtype), None if stored_as is None else dtype_from_name(stored_as))
        sd[fqn] = tensor_metadata_from_columns(fqn, props, torch.Size(size), count, ndim, list(offsets),
                                               list(sizes), ascending=ascending)
    storage: Optional[dict[MetadataIndex, StorageInfo]] = None
    if columns is not None:
        fqns, offsets_, hints, paths, starts, lengths, checksums, keys = columns
        storage = dict(zip(map(MetadataIndex, fqns, offsets_, hints),
                           map(StorageInfo, paths, starts, lengths, checksums, keys)))
    return Metadata(state_dict_metadata=sd, planner_data=planner_data, storage_data=storage, files=dict(files),
                    format_version=format_version, header_digests=dict(header_digests),
                    rank_objects={fqn: {r: StorageInfo(*info) for r, info in copies.items()}
                                  for fqn, copies in rank_objects.items()})


def lazily_unpacked(packed: tuple[Any, ...]) -> Metadata:
    """The :class:`Metadata` of :func:`pack_metadata`, unpacked when first looked at.

    A save returns the global metadata on every rank, and most callers never look at it
    (a trainer's checkpoint call).  Unpacked as it arrives, every rank but the coordinator
    spent the work of building the whole checkpoint's metadata on each save while the
    coordinator waited for its confirmation to commit: 2000 chunks, ~7 ms of a ~110 ms save
    on the 2-core dev machine; it grows with the job's chunks, on every rank.
    """
    lazy = _PackedMetadata.__new__(_PackedMetadata)
    lazy.__dict__["_packed"] = packed
    return lazy


class _PackedMetadata(Metadata):
    """A :class:`Metadata` held as :func:`pack_metadata` columns until an attribute is
    read; it then becomes a plain :class:`Metadata` (its class included).  Made by
    :func:`lazily_unpacked`; copies and pickles stay packed."""

    def _unpack(self) -> None:
        values = self.__dict__
        packed = values.get("_packed")
        if packed is not None:
            # an attribute set on the packed object (a copy's) wins over the unpacked one
            for name, value in unpack_metadata(packed).__dict__.items():
                values.setdefault(name, value)
            values.pop("_packed", None)
        self.__class__ = Metadata  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:  # only for attributes not set yet
        if name.startswith("__") or "_packed" not in self.__dict__:
            raise AttributeError(name)
        self._unpack()
        return getattr(self, name)

    def __eq__(self, other: object) -> bool:
        self._unpack()
        return self == other

    __hash__ = None  # type: ignore[assignment]  # as Metadata's (a mutable dataclass)

    def __repr__(self) -> str:
        self._unpack()
        return repr(self)


# ------------------------------------------------------------------------ format 2
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX = re.compile(r"[0-9a-f]*")


def _is_checksum(value: Any) -> bool:
    return value is None or isinstance(value, str)


def metadata_to_json(metadata: Metadata) -> str:
    """``metadata`` as format-2 JSON (``docs/format.md``); always writes :data:`FORMAT_VERSION`.

    Per tensor, the chunk geometry and where each chunk is stored go into flat columns;
    file names into one file table; a chunk's key only when it is not :func:`chunk_key`.
    Storage entries that name no chunk or object of ``state_dict_metadata`` are kept in
    ``other_storage``, so any ``Metadata`` round-trips (``storage_data=None`` is written as
    empty).  The last member is ``metadata_digest``, the xxh3-64 of the document before
    it, so every tool that writes metadata through here keeps it valid.  Raises
    ``ValueError`` naming the FQN for a chunk whose offsets or sizes do not have one entry
    per dimension of its tensor.
    """
    return _metadata_to_json(metadata, columnar=True)


def _metadata_to_json(metadata: Metadata, *, columnar: bool) -> str:
    """``metadata_to_json``; ``columnar=False`` writes every tensor through the per-chunk path."""
    file_index: dict[str, int] = {}
    file_table: list[list[Any]] = []

    def file_of(name: str) -> int:
        pos = file_index.get(name)
        if pos is None:
            pos = file_index[name] = len(file_table)
            file_table.append([name, None])
        return pos

    for name, size in metadata.files.items():
        file_table[file_of(name)][1] = size
    for name in metadata.header_digests:
        file_of(name)
    # The columnar path writes each tensor's text at once, with its chunks' files where the
    # written table puts them: the grouping of the files known now (the other entries may
    # name more files, checked at the end).
    known = len(file_table)
    known_index = dict(file_index)  # a tensor's text names only these (the others: per chunk)
    _, placed = _group_files(file_table)
    token = _file_token(tuple(name for name, _ in file_table), tuple(placed))
    texts = False  # whether some tensor's entry is a text already
    # One pass over the storage entries, grouped by FQN: no MetadataIndex built per chunk.
    by_fqn: dict[str, dict[Optional[tuple[int, ...]], Optional[StorageInfo]]] = {}
    for index, entry_info in (metadata.storage_data or {}).items():
        by_fqn.setdefault(index.fqn, {})[index.offset] = entry_info
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        stored = by_fqn.get(fqn, {})
        if not isinstance(md, TensorStorageMetadata):
            found = stored.pop(None, None)
            objects[fqn] = {} if found is None else _v2_entry(found, file_of, with_key=True)
            continue
        if columnar:
            fast = _columnar_text(fqn, md, stored, known_index, placed, token)
            if fast is not None:
                tensors[fqn] = fast
                texts = texts or isinstance(fast, str)
                continue
        ndim = len(md.size)
        offsets, sizes = _chunk_tuples(md)
        if any(len(o) != ndim for o in offsets) or any(len(z) != ndim for z in sizes):
            raise ValueError(f"{fqn!r}: a chunk's offsets or sizes do not have {ndim} entries (tensor size "
                             f"{list(md.size)})")
        entry: dict[str, Any] = {
            "dtype": dtype_name(md.properties.dtype),
            **({"stored_as": dtype_name(md.properties.stored_as)} if md.properties.stored_as else {}),
            "size": list(md.size),
            "count": len(offsets),
            "offsets": list(chain.from_iterable(offsets)),
            # Chunks of one tensor are mostly the same size (TP/EP/FSDP shards): then the
            # size is written once for all of them.
            "sizes": list(sizes[0]) if len(sizes) > 1 and sizes.count(sizes[0]) == len(sizes)
            else list(chain.from_iterable(sizes)),
        }
        infos = [stored.pop(o, None) for o in offsets]
        if any(i is not None for i in infos):
            entry["file"] = [-1 if i is None else file_of(i.relative_path) for i in infos]
            entry["offset"] = [0 if i is None else i.offset for i in infos]
            itemsize = (md.properties.stored_as or md.properties.dtype).itemsize
            lengths = [0 if i is None else i.length for i in infos]
            # A chunk's length is its elements times the dtype's size (safetensors); the
            # column is written only when some chunk is stored otherwise (6 bytes a chunk).
            if lengths != [0 if i is None else math.prod(z) * itemsize for i, z in zip(infos, sizes)]:
                entry["length"] = lengths
            checksums = [None if i is None else i.checksum for i in infos]
            # Written back to back in one string when all are xxh3 hex digests (as the
            # filesystem writer records them): no quotes and commas per chunk.
            if all(c is not None and len(c) == 16 and _HEX16.fullmatch(c) for c in checksums):
                entry["checksum"] = "".join(checksums)  # type: ignore[arg-type]
            else:
                entry["checksum"] = checksums
            prefix = chunk_key(fqn, ())  # the escaped name and the space, once per tensor
            keys = {str(pos): i.key for pos, (i, o) in enumerate(zip(infos, offsets))
                    if i is not None and i.key != prefix + _offsets_text(o)}
            if keys:
                entry["keys"] = keys
        tensors[fqn] = entry
    other = []
    for fqn, rest in by_fqn.items():
        for offset, stray in rest.items():
            assert stray is not None  # entries come from storage_data, which maps to StorageInfo
            item = {"fqn": fqn, **_v2_entry(stray, file_of, with_key=True)}
            if offset is not None:
                item["offsets"] = list(offset)
            other.append(item)
    groups, new_index = _group_files(file_table)
    if columnar and len(file_table) > known and new_index[:known] != placed:
        # files named only by other entries moved the known ones: the texts hold stale positions
        return _metadata_to_json(metadata, columnar=False)
    if new_index != list(range(len(new_index))):
        for entry in tensors.values():
            if isinstance(entry, dict) and "file" in entry:
                entry["file"] = [new_index[f] if f >= 0 else -1 for f in entry["file"]]
        for entry in chain(objects.values(), other):
            if "file" in entry:
                entry["file"] = new_index[entry["file"]]
    head = json.dumps({"format_version": FORMAT_VERSION, "files": groups}, separators=_SEPARATORS)
    tail: dict[str, Any] = {"objects": objects, "planner_data": metadata.planner_data}
    if other:
        tail["other_storage"] = other
    if metadata.header_digests:
        # aligned with the expanded file table; a reader that does not know the key ignores it
        digests: list[Optional[str]] = [None] * len(file_table)
        for name, digest in metadata.header_digests.items():
            digests[new_index[file_index[name]]] = digest
        tail["header_digests"] = digests
    # what json.dumps of the whole document writes, the columnar tensors' texts spliced in
    dumps = json.dumps
    if texts:
        body = "{" + ",".join(entry if isinstance(entry, str) else f"{dumps(fqn)}:{dumps(entry, separators=_SEPARATORS)}"
                              for fqn, entry in tensors.items()) + "}"
    else:
        body = dumps(tensors, separators=_SEPARATORS)
    return _with_digest(f'{head[:-1]},"tensors":{body},{dumps(tail, separators=_SEPARATORS)[1:]}')


_SEPARATORS = (",", ":")
_last_token: tuple[Any, ...] = ()


def _file_token(names: tuple[str, ...], placed: tuple[int, ...]) -> tuple[Any, ...]:
    """The file table's names and written positions, as the same object as the previous
    call's when equal (a tensor's cached text is checked against it by identity)."""
    global _last_token
    token = (names, placed)
    if token == _last_token:
        return _last_token
    _last_token = token
    return token


_PATH = attrgetter("relative_path")
_OFFSET = attrgetter("offset")
_LENGTH = attrgetter("length")
_CHECKSUM = attrgetter("checksum")
_KEY = attrgetter("key")


def _columnar_entry(fqn: str, md: TensorStorageMetadata, stored: dict[Any, Any],
                    file_index: dict[str, int]) -> Optional[dict[str, Any]]:
    """:func:`metadata_to_json`'s entry for a tensor whose chunks are still columns (made
    by the save planner or parsed) and stored the common way: every chunk stored, in a
    file of ``metadata.files``, its length its elements' bytes, an xxh3 hex checksum and
    the derived key.  The same entry as the general path, with whole-column operations
    instead of several per chunk (2000 one-chunk tensors: most of the metadata's
    serialisation on the coordinator).  ``None`` (nothing consumed from ``stored``) when
    any of that does not hold: the general path then writes the entry.
    """
    if not isinstance(md, _ColumnarTensorStorageMetadata) or "chunks" in md.__dict__:
        return None
    columns = md._columns
    ndim, count = columns.ndim, columns.count
    flat_offsets, flat_sizes = columns.offsets, columns.sizes
    if not ndim or ndim != len(md.size) or not count or len(flat_offsets) != count * ndim \
            or len(flat_sizes) != count * ndim:
        return None
    if count == 1:
        return _one_chunk_entry(fqn, md, stored, file_index, flat_offsets, flat_sizes)
    if count <= _FEW_CHUNKS:
        return _few_chunks_entry(fqn, md, stored, file_index, flat_offsets, flat_sizes, ndim, count)
    offsets = list(zip(*[iter(flat_offsets)] * ndim))
    get = stored.get
    infos = list(map(get, offsets))
    # a StorageInfo is never false: all() finds a missing entry in C (``None in infos``
    # called the dataclass's __eq__ for every entry: 0.1 s at 600k chunks)
    if not all(infos) or len(set(offsets)) != count:
        return None
    try:
        files = list(map(file_index.__getitem__, map(_PATH, infos)))
    except KeyError:
        return None
    uniform = flat_sizes[:ndim] * count == flat_sizes
    props = md.properties
    itemsize = (props.stored_as or props.dtype).itemsize
    lengths = list(map(_LENGTH, infos))
    if uniform:
        if lengths != [math.prod(flat_sizes[:ndim]) * itemsize] * count:
            return None
    elif lengths != [math.prod(flat_sizes[i:i + ndim]) * itemsize for i in range(0, count * ndim, ndim)]:
        return None
    checksums = list(map(_CHECKSUM, infos))
    if None in checksums or set(map(len, checksums)) != {16}:
        return None
    joined = "".join(checksums)
    if not _HEX.fullmatch(joined):
        return None
    prefix = chunk_key(fqn, ())
    if ndim < len(_OFFSET_FORMATS):
        # each derived key in one %-format of the whole key, in C
        derived = list(map((prefix.replace("%", "%%") + _OFFSET_FORMATS[ndim]).__mod__, offsets))
    else:
        derived = [prefix + text for text in map(_offsets_text, offsets)]
    if list(map(_KEY, infos)) != derived:
        return None
    if len(stored) == count:
        stored.clear()  # every entry of the tensor is one of its chunks
    else:
        for o in offsets:
            del stored[o]
    return _entry_of(md, count, flat_offsets, list(flat_sizes[:ndim]) if uniform else list(flat_sizes), files,
                     list(map(_OFFSET, infos)), joined)


def _one_chunk_entry(fqn: str, md: TensorStorageMetadata, stored: dict[Any, Any], file_index: dict[str, int],
                     flat_offsets: Sequence[int], flat_sizes: Sequence[int]) -> Optional[dict[str, Any]]:
    """:func:`_columnar_entry` of a tensor stored as one chunk (most tensors of a model
    saved with FSDP or TP on one mesh dimension), the same checks without the
    whole-column operations, which cost more than the one chunk's work: 1000 one-chunk
    tensors' first write: 12.2 -> 7.9 ms of the coordinator's save (2-core AMD EPYC VM)."""
    offset = tuple(flat_offsets)
    info = stored.get(offset)
    if info is None:
        return None
    file = file_index.get(info.relative_path)
    props = md.properties
    checksum = info.checksum
    if file is None or info.length != math.prod(flat_sizes) * (props.stored_as or props.dtype).itemsize \
            or checksum is None or not _HEX16.fullmatch(checksum) \
            or info.key != chunk_key(fqn, offset):
        return None
    if len(stored) == 1:
        stored.clear()
    else:
        del stored[offset]
    return _entry_of(md, 1, flat_offsets, list(flat_sizes), [file], [info.offset], checksum)


#: Up to this many chunks :func:`_columnar_entry` checks them one by one (1000 tensors of
#: two chunks each, first write: 16.2 -> 11.5 ms; four chunks: the same either way).
_FEW_CHUNKS = 3


def _few_chunks_entry(fqn: str, md: TensorStorageMetadata, stored: dict[Any, Any], file_index: dict[str, int],
                      flat_offsets: list[int], flat_sizes: list[int], ndim: int, count: int) -> Optional[dict[str, Any]]:
    """:func:`_columnar_entry` of a tensor stored as 2 to :data:`_FEW_CHUNKS` chunks (a
    tensor sharded over a mesh dimension of that size), the same checks chunk by chunk."""
    props = md.properties
    itemsize = (props.stored_as or props.dtype).itemsize
    prefix = chunk_key(fqn, ())  # the escaped name and the space
    get = stored.get
    offsets: list[tuple[int, ...]] = []
    files: list[int] = []
    positions: list[int] = []
    checksums: list[str] = []
    for begin in range(0, count * ndim, ndim):
        offset = tuple(flat_offsets[begin:begin + ndim])
        info = get(offset)
        if info is None:
            return None
        file = file_index.get(info.relative_path)
        checksum = info.checksum
        if file is None or info.length != math.prod(flat_sizes[begin:begin + ndim]) * itemsize \
                or checksum is None or not _HEX16.fullmatch(checksum) or info.key != prefix + _offsets_text(offset):
            return None
        offsets.append(offset)
        files.append(file)
        positions.append(info.offset)
        checksums.append(checksum)
    if len(set(offsets)) != count:
        return None
    if len(stored) == count:
        stored.clear()
    else:
        for offset in offsets:
            del stored[offset]
    sizes = list(flat_sizes[:ndim]) if flat_sizes[:ndim] * count == flat_sizes else list(flat_sizes)
    return _entry_of(md, count, flat_offsets, sizes, files, positions, "".join(checksums))


def _entry_of(md: TensorStorageMetadata, count: int, flat_offsets: Sequence[int], sizes: list[int],
              files: list[int], positions: list[int], checksum: str) -> dict[str, Any]:
    """A tensor's entry as :func:`metadata_to_json` writes it, from its checked columns."""
    props = md.properties
    entry: dict[str, Any] = {"dtype": dtype_name(props.dtype)}
    if props.stored_as:
        entry["stored_as"] = dtype_name(props.stored_as)
    entry["size"] = list(md.size)
    entry["count"] = count
    entry["offsets"] = list(flat_offsets)
    entry["sizes"] = sizes
    entry["file"] = files
    entry["offset"] = positions
    entry["checksum"] = checksum
    return entry


_SIGNATURE = attrgetter("relative_path", "offset", "length", "key")
_WRITTEN = ("written once",)  # a json_cache: the entry was written, no text kept yet


def _columnar_text(fqn: str, md: TensorStorageMetadata, stored: dict[Any, Any], file_index: dict[str, int],
                   placed: list[int], token: tuple[Any, ...]) -> Union[str, dict[str, Any], None]:
    """:func:`_columnar_entry`'s entry; from the second time these tensor metadata are
    written, as the text ``"fqn":entry`` that ``json.dumps`` writes, its files at their
    ``placed`` positions.  ``None`` (nothing consumed) where that entry is ``None``.

    A save with a cached plan writes the same tensor metadata objects again, with chunks
    stored where they were, only with new checksums.  So the text up to the checksums is
    kept in the tensor's columns with what it was made of (the file table, the tensor's
    properties and size, each chunk's file, offset, length and key) and reused while all
    of it is the same: 2000 one-chunk tensors took 41 ms of the coordinator's save, 13 ms
    with the texts (2-core dev VM).  Made only the second time, for a first save (a new
    plan) pays for the texts (11 ms more for those 2000) and may be the only one.
    """
    if not isinstance(md, _ColumnarTensorStorageMetadata) or "chunks" in md.__dict__:
        return None
    columns = md._columns
    cache = columns.json_cache
    if cache is None:
        entry = _columnar_entry(fqn, md, stored, file_index)
        if entry is not None:
            columns.json_cache = _WRITTEN
        return entry
    if cache is not _WRITTEN and cache[0] is token and cache[1] is md.properties and cache[2] is md.size:
        offsets, signature, head = cache[3], cache[4], cache[5]
        infos = list(map(stored.get, offsets))
        if all(infos) and list(map(_SIGNATURE, infos)) == signature:
            checksums = list(map(_CHECKSUM, infos))
            if None not in checksums and set(map(len, checksums)) == {16}:
                joined = "".join(checksums)
                if _HEX.fullmatch(joined):
                    if len(stored) == len(offsets):
                        stored.clear()
                    else:
                        for o in offsets:
                            del stored[o]
                    return f'{head}{joined}"}}'
    signature = list(map(_SIGNATURE, filter(None, map(stored.get, columns._tuples(columns.offsets)))))
    entry = _columnar_entry(fqn, md, stored, file_index)
    if entry is None:
        return None
    if placed != list(range(len(placed))):
        entry["file"] = [placed[f] for f in entry["file"]]
    joined = entry.pop("checksum")
    dumped = json.dumps(entry, separators=_SEPARATORS)
    head = f'{json.dumps(fqn)}:{dumped[:-1]},"checksum":"'
    columns.json_cache = (token, md.properties, md.size, columns._tuples(columns.offsets), signature, head)
    return f'{head}{joined}"}}'


# A name ending in a number without leading zeros (then no digits): "_rank12_.safetensors".
_NUMBERED = re.compile(r"^(.*?)(0|[1-9][0-9]*)(\D*)$")


def _group_files(table: list[list[Any]]) -> tuple[list[Any], list[int]]:
    """The file table as written: names ``prefix + number + suffix`` sharing prefix and
    suffix become one group (at 8192 ranks, 8192 ``_rank{r}_.safetensors`` cost a number
    each, not a name each); other names stay ``[name, size]`` pairs.  Returns the entries
    and, for each old file index, its index in the expanded table."""
    by_pattern: dict[tuple[str, str], list[int]] = {}
    for pos, (name, _) in enumerate(table):
        match = _NUMBERED.match(name)
        if match:
            by_pattern.setdefault((match.group(1), match.group(3)), []).append(pos)
    grouped = {key: members for key, members in by_pattern.items() if len(members) > 1}
    group_of = {pos: key for key, members in grouped.items() for pos in members}
    entries: list[Any] = []
    order: list[int] = []
    emitted: set[tuple[str, str]] = set()
    for pos, (name, size) in enumerate(table):
        key = group_of.get(pos)
        if key is None:
            entries.append([name, size])
            order.append(pos)
        elif key not in emitted:
            emitted.add(key)
            members = grouped[key]
            prefix, suffix = key
            entries.append({"prefix": prefix, "suffix": suffix,
                            "numbers": [int(table[m][0][len(prefix):len(table[m][0]) - len(suffix)]) for m in members],
                            "sizes": [table[m][1] for m in members]})
            order.extend(members)
    new_index = [0] * len(table)
    for new, old in enumerate(order):
        new_index[old] = new
    return entries, new_index


def _expand_files(table: Any, source: str) -> list[tuple[Any, Any]]:
    if not isinstance(table, list):
        raise CheckpointFormatError(f"{source}: 'files' must be a list of [name, size] pairs and groups")
    out: list[tuple[Any, Any]] = []
    for entry in table:
        if isinstance(entry, list) and len(entry) == 2:
            out.append((entry[0], entry[1]))
        elif isinstance(entry, dict) and isinstance(entry.get("prefix"), str) and isinstance(entry.get("suffix"), str):
            numbers, sizes = entry["numbers"], entry["sizes"]
            if type(numbers) is not list or type(sizes) is not list or len(numbers) != len(sizes) or not all(
                    type(n) is int and n >= 0 for n in numbers):
                raise CheckpointFormatError(f"{source}: file group {entry['prefix']!r}…{entry['suffix']!r} needs "
                                            "'numbers' (integers >= 0) and 'sizes' of one length")
            out.extend((f"{entry['prefix']}{n}{entry['suffix']}", size) for n, size in zip(numbers, sizes))
        else:
            raise CheckpointFormatError(f"{source}: 'files' must be a list of [name, size] pairs and groups, "
                                        f"found {entry!r}")
    return out


def _v2_entry(info: StorageInfo, file_of: Any, *, with_key: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"file": file_of(info.relative_path), "offset": info.offset, "length": info.length,
                             "checksum": info.checksum}
    if with_key and info.key is not None:
        entry["key"] = info.key
    return entry


class _TensorColumns:
    """One tensor's chunk columns, as parsed or as planned; per-chunk objects are built on demand."""

    def __init__(self, fqn: str, ndim: int, count: int, offsets: list[int], sizes: list[int],
                 file: Optional[list[int]], offset: Optional[list[int]], length: Optional[list[int]],
                 checksum: Optional[list[Optional[str]] | str], keys: dict[int, Optional[str]], itemsize: int) -> None:
        self.fqn = fqn
        self.ndim = ndim
        self.count = count
        self.offsets = offsets
        self.sizes = sizes
        self.file = file
        self.offset = offset
        self.length = length
        # per chunk: a list of digests (or None), or every digest back to back as parsed
        # (16 hex digits each), sliced out by info()
        self.checksum = checksum
        self.keys = keys
        self.itemsize = itemsize
        self._positions: Optional[dict[tuple[int, ...], int]] = None
        #: whether chunks ascend by offsets: known for planned columns, checked once if parsed
        self.ascending: Optional[bool] = None
        #: metadata_to_json's text of this tensor up to its checksums, and what it holds
        #: (see _columnar_text)
        self.json_cache: Optional[tuple[Any, ...]] = None

    def _tuples(self, flat: list[int]) -> list[tuple[int, ...]]:
        if self.ndim == 0:
            return [()] * self.count
        return list(zip(*[iter(flat)] * self.ndim))

    def chunks(self) -> list[ChunkStorageMetadata]:
        return list(map(ChunkStorageMetadata, *self.tuples()))

    def tuples(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Every chunk's offsets and sizes, as two lists of tuples."""
        return self._tuples(self.offsets), self._tuples(self.sizes)

    def stored(self) -> int:
        return 0 if self.file is None else self.count - self.file.count(-1)

    def offsets_at(self, pos: int) -> tuple[int, ...]:
        return tuple(self.offsets[pos * self.ndim:(pos + 1) * self.ndim])

    def find(self, offsets: tuple[int, ...], hint: Optional[int]) -> Optional[int]:
        """Position of the stored chunk at ``offsets`` (``hint`` is tried first)."""
        if self.file is None:
            return None
        if hint is not None and 0 <= hint < self.count and self.offsets_at(hint) == offsets:
            pos: Optional[int] = hint
        else:
            if self._positions is None:
                self._positions = {o: p for p, o in reversed(list(enumerate(self._tuples(self.offsets))))}
            pos = self._positions.get(offsets)
        return None if pos is None or self.file[pos] < 0 else pos

    def info(self, pos: int, names: list[str]) -> StorageInfo:
        assert self.file is not None and self.offset is not None and self.checksum is not None
        key = self.keys[pos] if pos in self.keys else chunk_key(self.fqn, self.offsets_at(pos))
        if self.length is not None:
            length = self.length[pos]
        else:
            length = math.prod(self.sizes[pos * self.ndim:(pos + 1) * self.ndim]) * self.itemsize
        checksum = self.checksum
        digest = checksum[16 * pos:16 * pos + 16] if type(checksum) is str else checksum[pos]
        return StorageInfo(names[self.file[pos]], self.offset[pos], length, digest, key)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_positions": None}  # the lookup index is rebuilt on demand


class _ColumnarTensorStorageMetadata(TensorStorageMetadata):
    """A tensor whose ``chunks`` list is built on first access (then a plain list).

    Made by parsing format 2 and by the save planner (:func:`tensor_metadata_from_columns`):
    a coordinator that only writes the metadata out, and a rank that loads a few tensors,
    never build the other per-chunk objects.

    Compares equal to a :class:`TensorStorageMetadata` with the same fields;
    ``dataclasses.replace`` on it gives a plain-list instance.
    """

    _columns: _TensorColumns

    @classmethod
    def _from_columns(cls, properties: TensorProperties, size: torch.Size,
                      columns: _TensorColumns) -> _ColumnarTensorStorageMetadata:
        self = cls.__new__(cls)
        self.properties = properties
        self.size = size
        self._columns = columns
        return self

    def __getattr__(self, name: str) -> Any:
        if name == "chunks" and "_columns" in self.__dict__:
            self.chunks = self._columns.chunks()
            return self.chunks
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorStorageMetadata):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(TensorStorageMetadata))

    __hash__ = None  # type: ignore[assignment]  # mutable, like its base

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as the plain dataclass: what crosses a process boundary (the save's
        # broadcast of the metadata, the async mailbox's allow-listed unpickler) is the
        # same record as before chunks became columns.
        return TensorStorageMetadata, (self.properties, self.size, self.chunks)


def tensor_metadata_from_columns(fqn: str, properties: TensorProperties, size: torch.Size, count: int, ndim: int,
                                 offsets: list[int], sizes: list[int], *,
                                 ascending: Optional[bool] = None) -> TensorStorageMetadata:
    """A :class:`TensorStorageMetadata` with ``count`` chunks given as flat columns:
    ``offsets`` and ``sizes`` hold ``ndim`` integers per chunk, chunk after chunk;
    ``ascending=True`` when the caller sorted the chunks by offsets (``None``: unknown).

    The chunk objects are built only when ``chunks`` is first read (:func:`metadata_to_json`
    reads the columns).  Keeps (does not copy) both lists; equal to the plain instance with
    the same chunks.
    """
    columns = _TensorColumns(fqn, ndim, count, offsets, sizes, None, None, None, None, {},
                             (properties.stored_as or properties.dtype).itemsize)
    columns.ascending = None if ascending is None else bool(ascending)
    return _ColumnarTensorStorageMetadata._from_columns(properties, size, columns)


#: ``(file, byte offset, chunk sizes)`` of a stored tensor chunk, or ``None``: see :func:`chunk_location`
ChunkLocation = Optional[tuple[str, int, tuple[int, ...]]]


def chunk_location(metadata: Metadata, index: MetadataIndex) -> ChunkLocation:
    """``(file, byte offset, chunk sizes)`` of the stored tensor chunk ``index`` names, read
    from the columns of metadata parsed from format 2 without building its
    :class:`StorageInfo` (a load looks up every chunk it reads: a few microseconds each
    at 4000 chunks).  ``None`` where the metadata holds the chunk otherwise or not at all:
    look it up in ``storage_data`` then.  The entry's length and checksum are not
    returned: a caller that needs them uses ``storage_data``.
    """
    locate = chunk_locator(metadata)
    return None if locate is None else locate(index)


def chunk_locator(metadata: Metadata) -> Optional[Callable[[MetadataIndex], ChunkLocation]]:
    """:func:`chunk_location` bound to ``metadata``, for a caller that locates every chunk
    it reads: ``None`` where ``metadata`` holds no columns to read locations from (every
    lookup would answer ``None``)."""
    storage = metadata.storage_data
    return storage.locate if type(storage) is _StorageView else None


def chunk_columns(md: TensorStorageMetadata) -> tuple[int, list[int], list[int], bool]:
    """``(ndim, offsets, sizes, ascending)``: every chunk's offsets and sizes as flat lists,
    ``ndim`` integers per chunk, in ``md.chunks`` order (chunk ``pos`` at
    ``[pos * ndim:(pos + 1) * ndim]``), and whether the chunks ascend by offsets.

    For metadata parsed from format 2 or built by the save planner these are its own
    columns (do not modify them), no chunk object is built, and ``ascending`` is known
    (the planner sorts) or checked once per parsed tensor.
    """
    if isinstance(md, _ColumnarTensorStorageMetadata) and "chunks" not in md.__dict__:
        columns = md._columns
        if columns.ascending is None:
            columns.ascending = _ascending(columns.offsets, columns.ndim)
        return columns.ndim, columns.offsets, columns.sizes, columns.ascending
    chunks = md.chunks
    ndim = len(chunks[0].offsets) if chunks else len(md.size)
    offsets = list(chain.from_iterable(c.offsets for c in chunks))
    return ndim, offsets, list(chain.from_iterable(c.sizes for c in chunks)), _ascending(offsets, ndim)


def _ascending(flat: list[int], ndim: int) -> bool:
    """Whether the ``ndim``-tuples laid end to end in ``flat`` ascend (compared in C)."""
    tuples = list(zip(*[iter(flat)] * ndim)) if ndim else []
    return all(map(le, tuples, islice(tuples, 1, None)))


def _chunk_tuples(md: TensorStorageMetadata) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The offsets and sizes of ``md``'s chunks, from its columns while ``chunks`` is unbuilt."""
    if isinstance(md, _ColumnarTensorStorageMetadata) and "chunks" not in md.__dict__:
        return md._columns.tuples()
    chunks = md.chunks
    return [c.offsets for c in chunks], [c.sizes for c in chunks]


class _StorageView(Mapping[MetadataIndex, StorageInfo]):
    """``storage_data`` of a format-2 checkpoint: entries built from the columns on lookup."""

    def __init__(self, names: list[str], tensors: dict[str, _TensorColumns], objects: dict[str, StorageInfo],
                 other: dict[MetadataIndex, StorageInfo]) -> None:
        self._names = names
        self._tensors = tensors
        self._objects = objects
        self._other = other
        self._len = sum(c.stored() for c in tensors.values()) + len(objects) + len(other)

    def __getitem__(self, index: MetadataIndex) -> StorageInfo:
        if index.offset is None:
            info = self._objects.get(index.fqn)
            if info is not None:
                return info
        else:
            columns = self._tensors.get(index.fqn)
            pos = None if columns is None else columns.find(index.offset, index.index)
            if pos is not None:
                assert columns is not None
                return columns.info(pos, self._names)
        return self._other[index]

    def locate(self, index: MetadataIndex) -> ChunkLocation:
        """``(file, byte offset, chunk sizes)`` of tensor chunk ``index`` straight from the
        columns (no :class:`StorageInfo`, no key built); ``None`` where it is not a stored
        chunk of a columnar tensor."""
        columns = self._tensors.get(index.fqn)
        offsets = index.offset
        if columns is None or offsets is None or columns.file is None:
            return None
        # find() with its hint check inlined: a load locates every chunk it reads, and a
        # resharded load of small tensors reads 4000 a rank, each once
        ndim, pos = columns.ndim, index.index
        if pos is None or not 0 <= pos < columns.count or tuple(columns.offsets[pos * ndim:(pos + 1) * ndim]) != offsets:
            pos = columns.find(offsets, None)
            if pos is None:
                return None
        file = columns.file[pos]
        if file < 0:
            return None
        assert columns.offset is not None
        return self._names[file], columns.offset[pos], tuple(columns.sizes[pos * ndim:(pos + 1) * ndim])

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, columns in self._tensors.items():
            if columns.file is None:
                continue
            for pos, (file, offsets) in enumerate(zip(columns.file, columns._tuples(columns.offsets))):
                if file >= 0:
                    yield MetadataIndex(fqn, offsets, pos)
        for fqn in self._objects:
            yield MetadataIndex(fqn)
        yield from self._other

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} entries)"


def _flat_ints(value: Any, what: str, length: int, *, low: int = 0) -> list[int]:
    """A JSON list of ``length`` integers, each ``>= low``, checked with C-level builtins."""
    if type(value) is not list or len(value) != length:
        raise CheckpointFormatError(f"{what} must be a list of {length} integers, got "
                                    f"{type(value).__name__} of length {len(value) if isinstance(value, list) else '-'}")
    if value and (set(map(type, value)) != {int} or min(value) < low):
        bad = next((v for v in value if type(v) is not int or v < low), None)
        raise CheckpointFormatError(f"{what} must hold integers >= {low}, found {bad!r}")
    return value


def _file_name(name: Any, source: str) -> str:
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise CheckpointFormatError(f"{source}: invalid file name {name!r} in the file table")
    return name


def _parse_v2(doc: dict[str, Any], source: str) -> Metadata:
    table = _expand_files(doc["files"], source)
    names = [_file_name(name, source) for name, _ in table]
    if len(set(names)) != len(names):
        raise CheckpointFormatError(f"{source}: the file table names a file twice")
    files: dict[str, int] = {}
    for name, size in table:
        if size is not None:
            if type(size) is not int or size < 0:
                raise CheckpointFormatError(f"{source}: 'files' size of {name!r} must be an integer >= 0, got {size!r}")
            files[name] = size
    nfiles = len(names)

    def storage_info(entry: dict[str, Any], what: str) -> StorageInfo:
        file = entry["file"]
        if type(file) is not int or not 0 <= file < nfiles:
            raise CheckpointFormatError(f"{source}: {what} names file {file!r}, not in the file table of {nfiles}")
        byte_offset, length = _ints([entry["offset"], entry["length"]], f"{source}: byte range of {what}")
        checksum, key = entry.get("checksum"), entry.get("key")
        if not _is_checksum(checksum) or not (key is None or isinstance(key, str)):
            raise CheckpointFormatError(f"{source}: checksum and key of {what} must be strings or null")
        return StorageInfo(names[file], byte_offset, length, checksum, key)

    tensors_doc, objects_doc = doc["tensors"], doc["objects"]
    if not isinstance(tensors_doc, dict) or not isinstance(objects_doc, dict):
        raise CheckpointFormatError(f"{source}: 'tensors' and 'objects' must be objects")
    state_dict_metadata: dict[str, StorageMetadata] = {}
    columns: dict[str, _TensorColumns] = {}
    for fqn, entry in tensors_doc.items():
        where = f"{source}: tensor {fqn!r}"
        size = _ints(entry["size"], f"{where}: size")
        ndim = len(size)
        count = entry["count"]
        if type(count) is not int or count < 0:
            raise CheckpointFormatError(f"{where}: count must be an integer >= 0, got {count!r}")
        offsets = _flat_ints(entry["offsets"], f"{where}: offsets", count * ndim)
        sizes = entry["sizes"]
        one: Optional[list[int]] = None  # one size for every chunk: checked once, then repeated
        if count > 1 and ndim and isinstance(sizes, list) and len(sizes) == ndim:
            one = _flat_ints(sizes, f"{where}: sizes", ndim)
            sizes = one * count
        else:
            sizes = _flat_ints(sizes, f"{where}: sizes", count * ndim)
        for d in range(ndim):
            if count and (max(map(add, offsets[d::ndim], sizes[d::ndim])) if one is None
                          else max(offsets[d::ndim]) + one[d]) > size[d]:
                pos = next(i for i in range(count) if offsets[i * ndim + d] + sizes[i * ndim + d] > size[d])
                raise CheckpointFormatError(
                    f"{where}: chunk offsets={offsets[pos * ndim:(pos + 1) * ndim]} "
                    f"sizes={sizes[pos * ndim:(pos + 1) * ndim]} does not fit its global size {list(size)}"
                )
        try:
            dtype = dtype_from_name(entry["dtype"])
            stored_as = dtype_from_name(entry["stored_as"]) if "stored_as" in entry else None
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(f"{source}: {exc} (tensor {fqn!r})") from None
        file = byte_offset = length = checksum = None
        keys: dict[int, Optional[str]] = {}
        if "file" in entry:
            file = _flat_ints(entry["file"], f"{where}: file", count, low=-1)
            if file and max(file) >= nfiles:
                raise CheckpointFormatError(f"{where}: file index {max(file)} is not in the file table of {nfiles}")
            byte_offset = _flat_ints(entry["offset"], f"{where}: offset", count)
            if "length" in entry:
                length = _flat_ints(entry["length"], f"{where}: length", count)
            checksum = entry["checksum"]
            if type(checksum) is str:
                if len(checksum) != 16 * count or not _HEX.fullmatch(checksum):
                    raise CheckpointFormatError(f"{where}: checksum must be {count} xxh3 digests of 16 hex digits")
                # kept joined: a lookup slices its chunk's digest out (split up front, the
                # 602k digests of an 8192-rank MoE checkpoint were 12 % of parsing it)
            elif type(checksum) is not list or len(checksum) != count or not set(map(type, checksum)) <= {
                    str, type(None)}:
                raise CheckpointFormatError(f"{where}: checksum must be a list of {count} strings or nulls")
            raw_keys = entry.get("keys", {})
            if not isinstance(raw_keys, dict):
                raise CheckpointFormatError(f"{where}: keys must be an object")
            for pos_text, key in raw_keys.items():
                pos = int(pos_text)
                if not 0 <= pos < count or not (key is None or isinstance(key, str)):
                    raise CheckpointFormatError(f"{where}: invalid key entry {pos_text!r}: {key!r}")
                keys[pos] = key
        cols = columns[fqn] = _TensorColumns(fqn, ndim, count, offsets, sizes, file, byte_offset, length,
                                             checksum, keys, (stored_as or dtype).itemsize)
        state_dict_metadata[fqn] = _ColumnarTensorStorageMetadata._from_columns(
            TensorProperties(dtype, stored_as), torch.Size(size), cols)
    objects: dict[str, StorageInfo] = {}
    for fqn, entry in objects_doc.items():
        if fqn in state_dict_metadata:
            raise CheckpointFormatError(f"{source}: {fqn!r} is both a tensor and an object")
        state_dict_metadata[fqn] = BytesStorageMetadata()
        if entry:
            objects[fqn] = storage_info(entry, f"object {fqn!r}")
    other: dict[MetadataIndex, StorageInfo] = {}
    for entry in doc.get("other_storage") or []:
        offsets_doc = entry.get("offsets")
        if not isinstance(entry["fqn"], str):  # str() would turn null into the key 'None'
            raise CheckpointFormatError(f"{source}: other_storage entry with a non-string fqn {entry['fqn']!r}")
        index = MetadataIndex(entry["fqn"],
                              None if offsets_doc is None else _ints(offsets_doc, f"{source}: offsets"))
        other[index] = storage_info(entry, f"storage entry of {index.fqn!r}")
    header_digests: dict[str, str] = {}
    digests_doc = doc.get("header_digests")
    if digests_doc is not None:
        if type(digests_doc) is not list or len(digests_doc) != nfiles or not all(
                d is None or (type(d) is str and _HEX16.fullmatch(d)) for d in digests_doc):
            raise CheckpointFormatError(f"{source}: 'header_digests' must list, per file of the file table, "
                                        "an xxh3 digest of 16 hex digits or null")
        header_digests = {name: d for name, d in zip(names, digests_doc) if d is not None}
        unsized = next((name for name in header_digests if name not in files), None)
        if unsized is not None:
            # the digest covers the file's size: a digest without a size is contradictory
            raise CheckpointFormatError(f"{source}: file {unsized!r} has a header digest but no size")
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=doc.get("planner_data"),
        storage_data=_StorageView(names, columns, objects, other),
        files=files,
        format_version=doc["format_version"],
        header_digests=header_digests,
    )
