"""The checkpoint's global description and its on-disk form (versioned JSON, no pickle).

``Metadata`` says, for every FQN, the global shape and dtype and which chunks are stored;
``storage_data`` says where each chunk's bytes are (file, byte range, checksum).  It is
written last by the coordinator; its presence means the checkpoint is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from .errors import CheckpointFormatError

__all__ = [
    "FORMAT_VERSION",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageInfo",
    "TensorProperties",
    "TensorStorageMetadata",
    "chunk_key",
    "dtype_from_name",
    "dtype_name",
    "metadata_from_json",
    "metadata_to_json",
]

#: Version of the ``.metadata`` JSON schema this code writes and the newest it reads.
FORMAT_VERSION = 1


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def chunk_key(fqn: str, offsets: tuple[int, ...]) -> str:
    """The storage key of a chunk; the sort order of keys is the global read/write order.

    Offsets are zero-padded so that string order equals numeric order within an FQN, and
    the separator is a space, which sorts before every character an FQN uses in practice
    (letters, digits, ``.``, ``_``): ``"blocks.1 …" < "blocks.10 …" < "blocks.1a …"``
    exactly as the tuples ``("blocks.1", …) < ("blocks.10", …)`` do.
    """
    return fqn + " " + "_".join(f"{o:012d}" for o in offsets)


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


@dataclass(frozen=True)
class MetadataIndex:
    """Names one stored item: an FQN plus, for a tensor chunk, its global offsets.

    ``index`` is only a lookup hint (the chunk's position in ``chunks``); it takes no part
    in equality or hashing.
    """

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(default=None, hash=False, compare=False)


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
    storage_data: dict[MetadataIndex, StorageInfo] | None = None
    files: dict[str, int] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION


def metadata_to_json(metadata: Metadata) -> str:
    sd: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            sd[fqn] = {
                "type": "tensor",
                "dtype": dtype_name(md.properties.dtype),
                **({"stored_as": dtype_name(md.properties.stored_as)} if md.properties.stored_as else {}),
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        else:
            sd[fqn] = {"type": "bytes"}
    storage = []
    for index, info in (metadata.storage_data or {}).items():
        entry: dict[str, Any] = {
            "fqn": index.fqn,
            "file": info.relative_path,
            "offset": info.offset,
            "length": info.length,
        }
        if index.offset is not None:
            entry["offsets"] = list(index.offset)
        if info.key is not None:
            entry["key"] = info.key
        if info.checksum is not None:
            entry["checksum"] = info.checksum
        storage.append(entry)
    doc = {
        "format_version": metadata.format_version,
        "state_dict_metadata": sd,
        "storage_data": storage,
        "files": metadata.files,
        "planner_data": metadata.planner_data,
    }
    return json.dumps(doc, separators=(",", ":"))


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


def metadata_from_json(text: str | bytes, *, source: str = "<metadata>") -> Metadata:
    """Parse ``.metadata`` JSON; raises :class:`CheckpointFormatError` naming ``source``."""
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
    try:
        return _parse_v1(doc, source)
    except CheckpointFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RuntimeError) as exc:
        raise CheckpointFormatError(f"{source} is malformed: {type(exc).__name__}: {exc}") from None


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
