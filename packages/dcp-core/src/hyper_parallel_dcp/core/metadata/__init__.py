"""The checkpoint's global description (``Metadata``) and its forms on disk and on the wire.

- :mod:`.model`: the schema as plain data (dataclasses, :class:`ChunkTable`, chunk keys,
  dtype names);
- :mod:`.storage_table`: ``storage_data`` as columns (:class:`StorageTable`) and the
  chunk locator a load reads locations through;
- :mod:`.json_codec`: ``.metadata`` as format-2 JSON, and reading formats 1 and 2
  (:mod:`.json_v1`, checked with :mod:`.json_values`);
- :mod:`.wire`: plain columns for another process (a save's metadata to every rank).

Every public name of those modules is importable from here.
"""

from __future__ import annotations

from .json_codec import METADATA_DIGEST, metadata_from_json, metadata_to_json
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
    chunk_columns,
    chunk_key,
    chunk_keys,
    dtype_from_name,
    dtype_name,
    tensor_metadata_from_columns,
)
from .storage_table import ChunkLocation, StorageTable, TensorStorage, chunk_location, chunk_locator, storage_table
from .wire import pack_metadata, unpack_metadata

__all__ = [
    "FORMAT_VERSION",
    "METADATA_DIGEST",
    "BytesStorageMetadata",
    "ChunkLocation",
    "ChunkStorageMetadata",
    "ChunkTable",
    "Metadata",
    "MetadataIndex",
    "StorageInfo",
    "StorageMetadata",
    "StorageTable",
    "TensorProperties",
    "TensorStorage",
    "TensorStorageMetadata",
    "chunk_columns",
    "chunk_key",
    "chunk_keys",
    "chunk_location",
    "chunk_locator",
    "dtype_from_name",
    "dtype_name",
    "metadata_from_json",
    "metadata_to_json",
    "pack_metadata",
    "storage_table",
    "tensor_metadata_from_columns",
    "unpack_metadata",
]

# Pickles name these classes by this package's path, as before the module became a
# package: the async mailbox's allow-list (dcp-async ``safe_pickle``) names them so.
for _cls in (BytesStorageMetadata, ChunkStorageMetadata, ChunkTable, Metadata, MetadataIndex, StorageInfo,
             StorageTable, TensorProperties, TensorStorage, TensorStorageMetadata):
    _cls.__module__ = __name__
del _cls
