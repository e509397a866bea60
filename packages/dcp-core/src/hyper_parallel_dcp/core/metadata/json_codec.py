"""``.metadata`` as versioned JSON (``docs/format.md``): the format-2 writer, the format-2 and format-1 readers.

Format 2 is column-shaped (per tensor, flat integer arrays; file names once in a file
table) and ends with ``metadata_digest``, the xxh3-64 of everything before it.  Format 1
(one JSON object per chunk) still loads; nothing writes it.  Exports :func:`metadata_to_json`,
:func:`metadata_from_json`, :data:`METADATA_DIGEST` and the file-name rules
:func:`is_file_name` and :func:`referenced_checkpoint`.
"""

from __future__ import annotations

import json
import re
from itertools import chain
from operator import add
from typing import Any, Optional

import torch
import xxhash

from ..errors import CheckpointFormatError, CorruptCheckpointError
from .locations import FileNames, StorageTable, TensorStorage, checked_chunks, storage_table
from .model import (
    FORMAT_VERSION,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    ChunkTable,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
    dtype_from_name,
    dtype_name,
)

__all__ = ["METADATA_DIGEST", "is_file_name", "metadata_from_json", "metadata_to_json", "referenced_checkpoint"]

#: The last member of a written ``.metadata``: the xxh3-64 of the document without it
#: (``docs/format.md``, "metadata digest").  An optional key of format 2.
METADATA_DIGEST = "metadata_digest"

_SEPARATORS = (",", ":")
#: An xxh3-64 digest as the format writes it.
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX = re.compile(r"[0-9a-f]*")
# A name ending in a number without leading zeros (then no digits): "_rank12_.safetensors".
_NUMBERED = re.compile(r"^(.*?)(0|[1-9][0-9]*)(\D*)$")


# ------------------------------------------------------------------------------ values
def _flat_ints(value: Any, what: str, length: Optional[int] = None, *, low: int = 0) -> list[int]:
    """A JSON list of ``length`` (``None``: any number of) integers, each ``>= low`` (the list
    itself, not a copy); ``what`` names it in the error."""
    if type(value) is not list or (length is not None and len(value) != length):
        found = len(value) if isinstance(value, list) else "-"
        raise CheckpointFormatError(f"{what} must be a list of {'' if length is None else f'{length} '}integers, "
                                    f"got {type(value).__name__} of length {found}")
    # checked with C-level builtins (json gives exact ints; bool is another type), the slow path only explains
    if value and (set(map(type, value)) != {int} or min(value) < low):
        bad = next((v for v in value if type(v) is not int or v < low), None)
        raise CheckpointFormatError(f"{what} must hold integers >= {low}, found {bad!r}")
    return value


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and "/" not in name and "\\" not in name and name not in ("", ".", "..")


def referenced_checkpoint(name: Any) -> Optional[str]:
    """The checkpoint beside this one that file ``name`` is in, for a name ``../<checkpoint>/<file>``
    (an incremental save's reference to an earlier checkpoint's bytes, SPEC §14); else ``None``."""
    if isinstance(name, str) and name.startswith("../"):
        parts = name[3:].split("/")
        if len(parts) == 2 and _plain_name(parts[0]) and _plain_name(parts[1]):
            return parts[0]
    return None


def is_file_name(name: Any) -> bool:
    """Whether ``name`` may name a data file: a plain name inside the checkpoint directory, or
    ``../<checkpoint>/<file>``, a file of a checkpoint beside it (:func:`referenced_checkpoint`)."""
    return _plain_name(name) or referenced_checkpoint(name) is not None


# ------------------------------------------------------------------------------ writer
def metadata_to_json(metadata: Metadata) -> str:
    """``metadata`` as format-2 JSON (any ``Metadata`` round-trips; ``storage_data=None``
    is written as empty), ending with ``metadata_digest``.  Raises ``ValueError`` naming
    the FQN for a chunk whose offsets or sizes do not have one entry per dimension.
    """
    table = storage_table(metadata)
    # a parsed file table keeps its order, and the names nothing refers to, while its sized
    # names are still ``metadata.files`` in order: a round trip writes the table it read
    sized = [name for name in table.files if name in metadata.files]
    names = FileNames(metadata, table.files if sized == list(metadata.files) else ())
    written = [-1] * len(table.files)  # table's file index -> index in the written file table
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            info = table.objects.get(fqn)
            objects[fqn] = {} if info is None else _stored_entry(info, names)
            continue
        chunks = checked_chunks(fqn, md)
        tensors[fqn] = _tensor_entry(md, chunks, table.tensors.get(fqn), table.files, written, names)
    other = []
    for index, info in table.other.items():
        item = {"fqn": index.fqn, **_stored_entry(info, names)}
        if index.offset is not None:
            item["offsets"] = list(index.offset)
        other.append(item)
    # each saving rank's copy of an object whose copies differ
    copies = {fqn: {str(rank): _stored_entry(info, names) for rank, info in sorted(by_rank.items())}
              for fqn, by_rank in sorted(metadata.rank_objects.items()) if by_rank}
    file_table = [[name, metadata.files.get(name)] for name in names.names]
    groups, order = _group_files(file_table)
    if order != list(range(len(order))):
        for entry in tensors.values():
            if "file" in entry:
                entry["file"] = [order[f] if f >= 0 else -1 for f in entry["file"]]
        for entry in chain(objects.values(), other, *(by_rank.values() for by_rank in copies.values())):
            if "file" in entry:
                entry["file"] = order[entry["file"]]
    doc: dict[str, Any] = {"format_version": FORMAT_VERSION, "files": groups, "tensors": tensors,
                           "objects": objects, "planner_data": metadata.planner_data}
    if other:
        doc["other_storage"] = other
    if copies:
        doc["rank_objects"] = copies
    if metadata.header_digests:
        # aligned with the expanded file table
        digests: list[Optional[str]] = [None] * len(file_table)
        for name, digest in metadata.header_digests.items():
            digests[order[names.index[name]]] = digest
        doc["header_digests"] = digests
    text = json.dumps(doc, separators=_SEPARATORS)
    return f'{text[:-1]},"{METADATA_DIGEST}":"{xxhash.xxh3_64_hexdigest(text.encode())}"}}'


def _tensor_entry(md: TensorStorageMetadata, chunks: ChunkTable, stored: Optional[TensorStorage],
                  table_files: list[str], written: list[int], names: FileNames) -> dict[str, Any]:
    """One tensor's entry; its files get their written index in the order its chunks name them."""
    props = md.properties
    ndim, count, sizes = chunks.ndim, chunks.chunk_count, chunks.sizes
    entry: dict[str, Any] = {"dtype": dtype_name(props.dtype)}
    if props.stored_as:
        entry["stored_as"] = dtype_name(props.stored_as)
    entry["size"] = list(md.size)
    entry["count"] = count
    entry["offsets"] = chunks.offsets
    # chunks of one tensor are mostly the same size (TP/EP/FSDP shards): then written once
    entry["sizes"] = sizes[:ndim] if count > 1 and sizes[:ndim] * count == sizes else sizes
    if stored is None:
        return entry
    files = stored.file
    same = True
    for f in dict.fromkeys(files):
        if f >= 0:
            if written[f] < 0:
                written[f] = names.add(table_files[f])
            same = same and written[f] == f
    entry["file"] = files if same else [written[f] if f >= 0 else -1 for f in files]
    entry["offset"] = stored.offset
    if stored.length is not None:
        entry["length"] = stored.length
    entry["checksum"] = stored.checksum
    if stored.keys:
        entry["keys"] = {str(pos): key for pos, key in stored.keys.items()}
    return entry


def _stored_entry(info: StorageInfo, names: FileNames) -> dict[str, Any]:
    entry: dict[str, Any] = {"file": names.add(info.relative_path), "offset": info.offset, "length": info.length,
                             "checksum": info.checksum}
    if info.key is not None:
        entry["key"] = info.key
    return entry


def _group_files(table: list[list[Any]]) -> tuple[list[Any], list[int]]:
    """The file table as written (names ``prefix + number + suffix`` sharing prefix and suffix
    as one group) and, for each index of ``table``, its index in the expanded written table."""
    by_pattern: dict[tuple[str, str], list[int]] = {}
    for pos, (name, _) in enumerate(table):
        match = _NUMBERED.match(name)
        if match:
            by_pattern.setdefault((match.group(1), match.group(3)), []).append(pos)
    grouped = {key: members for key, members in by_pattern.items() if len(members) > 1}
    group_of = {pos: key for key, members in grouped.items() for pos in members}
    entries: list[Any] = []
    order: list[int] = []
    for pos, (name, size) in enumerate(table):
        key = group_of.get(pos)
        if key is None:
            entries.append([name, size])
            order.append(pos)
        elif grouped[key][0] == pos:  # the group is written where its first member is
            members = grouped[key]
            prefix, suffix = key
            entries.append({"prefix": prefix, "suffix": suffix,
                            "numbers": [int(table[m][0][len(prefix):len(table[m][0]) - len(suffix)]) for m in members],
                            "sizes": [table[m][1] for m in members]})
            order.extend(members)
    return entries, sorted(range(len(order)), key=order.__getitem__)  # the inverse permutation


# ------------------------------------------------------------------------------ reader
def metadata_from_json(text: str | bytes, *, source: str = "<metadata>", check_digest: bool = True) -> Metadata:
    """Parse ``.metadata`` JSON; raises :class:`CheckpointFormatError` naming ``source``.

    A document with ``metadata_digest`` must still match it, else :class:`CorruptCheckpointError`
    (after the content checks).  ``header_digests`` are kept only from a document whose
    digest was checked; ``check_digest=False`` parses an altered document anyway.
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
    checked = digest is not None and check_digest
    try:
        metadata = _parse_v1(doc, source) if version == 1 else _parse_v2(doc, source)
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
    """Whether ``doc`` (parsed from ``text``) is the document ``digest`` was computed over:
    ``text`` without its last member, or ``doc`` re-serialised compactly (reformatted JSON)."""
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
    return xxhash.xxh3_64_hexdigest(json.dumps(content, separators=_SEPARATORS).encode()) == digest


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


def _parse_v2(doc: dict[str, Any], source: str) -> Metadata:
    table = _expand_files(doc["files"], source)
    names = [name for name, _ in table]
    for name in names:
        if not is_file_name(name):
            raise CheckpointFormatError(f"{source}: invalid file name {name!r} in the file table")
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
        byte_offset, length = _flat_ints([entry["offset"], entry["length"]], f"{source}: byte range of {what}")
        checksum, key = entry.get("checksum"), entry.get("key")
        if not (checksum is None or isinstance(checksum, str)) or not (key is None or isinstance(key, str)):
            raise CheckpointFormatError(f"{source}: checksum and key of {what} must be strings or null")
        return StorageInfo(names[file], byte_offset, length, checksum, key)

    tensors_doc, objects_doc = doc["tensors"], doc["objects"]
    if not isinstance(tensors_doc, dict) or not isinstance(objects_doc, dict):
        raise CheckpointFormatError(f"{source}: 'tensors' and 'objects' must be objects")
    state_dict_metadata: dict[str, StorageMetadata] = {}
    stored: dict[str, TensorStorage] = {}
    for fqn, entry in tensors_doc.items():
        md, row = _parse_tensor(fqn, entry, source, nfiles)
        state_dict_metadata[fqn] = md
        if row is not None:
            stored[fqn] = row
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
        offsets = None if offsets_doc is None else tuple(_flat_ints(offsets_doc, f"{source}: offsets"))
        index = MetadataIndex(entry["fqn"], offsets)
        other[index] = storage_info(entry, f"storage entry of {index.fqn!r}")
    rank_objects: dict[str, dict[int, StorageInfo]] = {}
    for fqn, by_rank in (doc.get("rank_objects") or {}).items():
        if not isinstance(by_rank, dict) or not all(rank.isascii() and rank.isdigit() for rank in by_rank):
            raise CheckpointFormatError(f"{source}: 'rank_objects' entry {fqn!r} must map ranks (integers >= 0) "
                                        "of an object to where their copies are")
        rank_objects[fqn] = {int(rank): storage_info(entry, f"rank {rank}'s copy of object {fqn!r}")
                             for rank, entry in by_rank.items()}
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
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=doc.get("planner_data"),
                    storage_data=StorageTable(names, stored, objects, other), files=files,
                    format_version=doc["format_version"], header_digests=header_digests, rank_objects=rank_objects)


def _properties(entry: dict[str, Any], source: str, fqn: str) -> TensorProperties:
    try:
        dtype = dtype_from_name(entry["dtype"])
        return TensorProperties(dtype, dtype_from_name(entry["stored_as"]) if "stored_as" in entry else None)
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{source}: {exc} (tensor {fqn!r})") from None


def _parse_tensor(fqn: str, entry: dict[str, Any], source: str,
                  nfiles: int) -> tuple[TensorStorageMetadata, Optional[TensorStorage]]:
    """One tensor entry: its metadata and, when it has stored chunks, their row (every column checked here)."""
    where = f"{source}: tensor {fqn!r}"
    size = tuple(_flat_ints(entry["size"], f"{where}: size"))
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
    props = _properties(entry, source, fqn)
    chunks = ChunkTable(ndim, count, offsets, sizes)
    md = TensorStorageMetadata(props, torch.Size(size), chunks)
    if "file" not in entry:
        return md, None
    file = _flat_ints(entry["file"], f"{where}: file", count, low=-1)
    if file and max(file) >= nfiles:
        raise CheckpointFormatError(f"{where}: file index {max(file)} is not in the file table of {nfiles}")
    byte_offset = _flat_ints(entry["offset"], f"{where}: offset", count)
    length = _flat_ints(entry["length"], f"{where}: length", count) if "length" in entry else None
    checksum = entry["checksum"]
    if type(checksum) is str:
        # kept joined: each lookup slices its digest out
        if len(checksum) != 16 * count or not _HEX.fullmatch(checksum):
            raise CheckpointFormatError(f"{where}: checksum must be {count} xxh3 digests of 16 hex digits")
    elif type(checksum) is not list or len(checksum) != count or not set(map(type, checksum)) <= {str, type(None)}:
        raise CheckpointFormatError(f"{where}: checksum must be a list of {count} strings or nulls")
    raw_keys = entry.get("keys", {})
    if not isinstance(raw_keys, dict):
        raise CheckpointFormatError(f"{where}: keys must be an object")
    keys: dict[int, Optional[str]] = {}
    for pos_text, key in raw_keys.items():
        pos = int(pos_text)
        if not 0 <= pos < count or not (key is None or isinstance(key, str)):
            raise CheckpointFormatError(f"{where}: invalid key entry {pos_text!r}: {key!r}")
        keys[pos] = key
    return md, TensorStorage(chunks, file, byte_offset, length, checksum, keys, (props.stored_as or props.dtype).itemsize)


# ------------------------------------------------------------------------------ format 1
def _parse_v1(doc: dict[str, Any], source: str) -> Metadata:
    """The ``Metadata`` of a parsed format-1 document."""
    sd_doc = doc["state_dict_metadata"]
    if not isinstance(sd_doc, dict):
        raise CheckpointFormatError(f"{source}: state_dict_metadata must be an object")
    state_dict_metadata: dict[str, StorageMetadata] = {}
    for fqn, entry in sd_doc.items():
        kind = entry["type"]
        if kind == "bytes":
            state_dict_metadata[fqn] = BytesStorageMetadata()
            continue
        if kind != "tensor":
            raise CheckpointFormatError(f"{source}: unknown item type {kind!r} for {fqn!r}")
        size = tuple(_flat_ints(entry["size"], f"{source}: size of {fqn!r}"))
        chunks = []
        for chunk in entry["chunks"]:
            offsets = tuple(_flat_ints(chunk["offsets"], f"{source}: chunk offsets of {fqn!r}"))
            sizes = tuple(_flat_ints(chunk["sizes"], f"{source}: chunk sizes of {fqn!r}"))
            if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise CheckpointFormatError(f"{source}: chunk offsets={list(offsets)} sizes={list(sizes)} of {fqn!r} "
                                            f"does not fit its global size {list(size)}")
            chunks.append(ChunkStorageMetadata(offsets, sizes))
        state_dict_metadata[fqn] = TensorStorageMetadata(_properties(entry, source, fqn), torch.Size(size), chunks)
    storage_data: dict[MetadataIndex, StorageInfo] = {}
    for entry in doc.get("storage_data") or []:
        offsets = entry.get("offsets")
        if not isinstance(entry["fqn"], str):  # str() would turn null into the key 'None'
            raise CheckpointFormatError(f"{source}: storage_data entry with a non-string fqn {entry['fqn']!r}")
        index = MetadataIndex(entry["fqn"],
                              None if offsets is None else tuple(_flat_ints(offsets, f"{source}: offsets")))
        file = entry["file"]
        if not is_file_name(file):
            raise CheckpointFormatError(f"{source}: invalid file name {file!r} for {index.fqn!r}")
        byte_offset, length = _flat_ints([entry["offset"], entry["length"]], f"{source}: byte range")
        storage_data[index] = StorageInfo(file, byte_offset, length, entry.get("checksum"), entry.get("key"))
    files = doc.get("files") or {}
    if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in files.items()):
        raise CheckpointFormatError(f"{source}: 'files' must map file names to sizes")
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=doc.get("planner_data"),
                    storage_data=storage_data, files=dict(files), format_version=doc["format_version"])
