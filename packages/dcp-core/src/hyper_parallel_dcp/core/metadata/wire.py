"""``Metadata`` as plain columns for another process: what a save's coordinator sends.

:func:`pack_metadata` gives builtins only (any plain-data unpickler reads it);
:func:`unpack_metadata` rebuilds the columns without an object per chunk.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Optional

import torch

import hyper_parallel_dcp.core.metadata.model as model  # the module, not the package: no import cycle

from .locations import StorageTable, TensorStorage, storage_table

__all__ = ["pack_metadata", "unpack_metadata"]

_LAYOUT = 2  # the version of the packed layout below
_INFO = attrgetter("relative_path", "offset", "length", "checksum", "key")


def pack_metadata(metadata: model.Metadata) -> tuple[Any, ...]:
    """``metadata`` as builtins; :func:`unpack_metadata` gives it back, equal to it.
    Raises ``ValueError`` as :func:`~.locations.storage_table` does."""
    table = None if metadata.storage_data is None else storage_table(metadata)
    tensors: list[tuple[Any, ...]] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, model.TensorStorageMetadata):
            tensors.append((fqn,))
            continue
        row = None if table is None else table.tensors.get(fqn)
        chunks = model.ChunkTable.of(md.chunks, len(md.size)) if row is None else row.chunks
        props = md.properties
        stored_as = None if props.stored_as is None else model.dtype_name(props.stored_as)
        tensors.append((fqn, model.dtype_name(props.dtype), stored_as,
                        tuple(md.size), chunks.ndim, chunks.chunk_count, chunks.offsets, chunks.sizes, chunks.ascending,
                        None if row is None else tuple(row[1:6])))
    storage = None if table is None else (
        table.files, [(fqn, *_INFO(info)) for fqn, info in table.objects.items()],
        [(index.fqn, index.offset, *_INFO(info)) for index, info in table.other.items()])
    rank_objects = {fqn: {r: _INFO(info) for r, info in copies.items()}
                    for fqn, copies in metadata.rank_objects.items()}
    return (_LAYOUT, tensors, storage, dict(metadata.files), metadata.planner_data, metadata.format_version,
            rank_objects, dict(metadata.header_digests))


def unpack_metadata(packed: tuple[Any, ...]) -> model.Metadata:
    """The :class:`~.model.Metadata` of :func:`pack_metadata`; raises ``ValueError`` for another layout."""
    if packed[0] != _LAYOUT:
        raise ValueError(f"packed metadata of an unknown layout {packed[0]!r}")
    _, tensors, storage, files, planner_data, format_version, rank_objects, header_digests = packed
    sd: dict[str, model.StorageMetadata] = {}
    rows: dict[str, TensorStorage] = {}
    # immutable, so one object per distinct value (a model's tensors share a few)
    properties: dict[tuple[str, Optional[str]], tuple[model.TensorProperties, int]] = {}
    shapes: dict[tuple[int, ...], torch.Size] = {}
    for entry in tensors:
        if len(entry) == 1:
            sd[entry[0]] = model.BytesStorageMetadata()
            continue
        fqn, dtype, stored_as, size, ndim, count, offsets, sizes, ascending, row = entry
        known = properties.get((dtype, stored_as))
        if known is None:
            view = None if stored_as is None else model.dtype_from_name(stored_as)
            props = model.TensorProperties(model.dtype_from_name(dtype), view)
            known = properties[(dtype, stored_as)] = props, (props.stored_as or props.dtype).itemsize
        shape = shapes.get(size)
        if shape is None:
            shape = shapes[size] = torch.Size(size)
        chunks = model.ChunkTable(ndim, count, offsets, sizes, ascending)
        sd[fqn] = model.TensorStorageMetadata(known[0], shape, chunks)
        if row is not None:
            file, offset, length, checksum, keys = row
            rows[fqn] = TensorStorage(chunks, file, offset, length, checksum, keys, known[1])
    table: Optional[StorageTable] = None
    if storage is not None:
        names, objects, other = storage
        table = StorageTable(names, rows, {fqn: model.StorageInfo(*info) for fqn, *info in objects},
                             {model.MetadataIndex(fqn, offset): model.StorageInfo(*info)
                              for fqn, offset, *info in other})
    return model.Metadata(state_dict_metadata=sd, planner_data=planner_data, storage_data=table, files=dict(files),
                    format_version=format_version, header_digests=dict(header_digests),
                    rank_objects={fqn: {r: model.StorageInfo(*info) for r, info in copies.items()}
                                  for fqn, copies in rank_objects.items()})
