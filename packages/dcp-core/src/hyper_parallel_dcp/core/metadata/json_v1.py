"""The reader of format 1 (one JSON object per chunk), the format before version 2.

Checkpoints written in it still load; nothing writes it.  Exports :func:`parse_v1`.
"""

from __future__ import annotations

from typing import Any

import torch

import hyper_parallel_dcp.core.metadata.model as model  # the module, not the package: no import cycle

from ..errors import CheckpointFormatError
from .json_values import int_tuple, is_file_name

__all__ = ["parse_v1"]


def parse_v1(doc: dict[str, Any], source: str) -> model.Metadata:
    """The :class:`~.model.Metadata` of a parsed format-1 document; raises
    :class:`CheckpointFormatError` naming ``source`` and the entry at fault."""
    sd_doc = doc["state_dict_metadata"]
    if not isinstance(sd_doc, dict):
        raise CheckpointFormatError(f"{source}: state_dict_metadata must be an object")
    state_dict_metadata: dict[str, model.StorageMetadata] = {}
    for fqn, entry in sd_doc.items():
        kind = entry["type"]
        if kind == "bytes":
            state_dict_metadata[fqn] = model.BytesStorageMetadata()
            continue
        if kind != "tensor":
            raise CheckpointFormatError(f"{source}: unknown item type {kind!r} for {fqn!r}")
        size = int_tuple(entry["size"], f"{source}: size of {fqn!r}")
        chunks = []
        for chunk in entry["chunks"]:
            offsets = int_tuple(chunk["offsets"], f"{source}: chunk offsets of {fqn!r}")
            sizes = int_tuple(chunk["sizes"], f"{source}: chunk sizes of {fqn!r}")
            if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise CheckpointFormatError(f"{source}: chunk offsets={list(offsets)} sizes={list(sizes)} of {fqn!r} "
                                            f"does not fit its global size {list(size)}")
            chunks.append(model.ChunkStorageMetadata(offsets, sizes))
        try:
            dtype = model.dtype_from_name(entry["dtype"])
            stored_as = model.dtype_from_name(entry["stored_as"]) if "stored_as" in entry else None
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(f"{source}: {exc} (tensor {fqn!r})") from None
        props = model.TensorProperties(dtype, stored_as)
        state_dict_metadata[fqn] = model.TensorStorageMetadata(props, torch.Size(size), chunks)
    storage_data: dict[model.MetadataIndex, model.StorageInfo] = {}
    for entry in doc.get("storage_data") or []:
        offsets = entry.get("offsets")
        if not isinstance(entry["fqn"], str):  # str() would turn null into the key 'None'
            raise CheckpointFormatError(f"{source}: storage_data entry with a non-string fqn {entry['fqn']!r}")
        index = model.MetadataIndex(entry["fqn"], None if offsets is None else int_tuple(offsets, f"{source}: offsets"))
        file = entry["file"]
        if not is_file_name(file):
            raise CheckpointFormatError(f"{source}: invalid file name {file!r} for {index.fqn!r}")
        byte_offset, length = int_tuple([entry["offset"], entry["length"]], f"{source}: byte range")
        storage_data[index] = model.StorageInfo(file, byte_offset, length, entry.get("checksum"), entry.get("key"))
    files = doc.get("files") or {}
    if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in files.items()):
        raise CheckpointFormatError(f"{source}: 'files' must map file names to sizes")
    return model.Metadata(state_dict_metadata=state_dict_metadata, planner_data=doc.get("planner_data"),
                    storage_data=storage_data, files=dict(files), format_version=doc["format_version"])
