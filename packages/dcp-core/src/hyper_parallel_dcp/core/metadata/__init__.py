"""The checkpoint's global description (``Metadata``) and its forms on disk and on the wire.

:mod:`.model` (the schema as plain data), :mod:`.locations` (``storage_data`` as
columns), :mod:`.json_codec` (``.metadata`` JSON, formats 1 and 2) and
:mod:`.wire` (plain columns for another process); their ``__all__`` names are exported here.
"""

from __future__ import annotations

from . import json_codec, locations, model, wire
from .json_codec import *  # noqa: F403
from .locations import *  # noqa: F403
from .model import *  # noqa: F403
from .wire import *  # noqa: F403

__all__ = [*model.__all__, *locations.__all__, *json_codec.__all__, *wire.__all__]

# Pickles name these classes by this package's path: dcp-async's ``safe_pickle`` allow-list does.
for _name in ("BytesStorageMetadata", "ChunkStorageMetadata", "ChunkTable", "Metadata", "MetadataIndex",
              "StorageInfo", "StorageTable", "TensorProperties", "TensorStorage", "TensorStorageMetadata"):
    globals()[_name].__module__ = __name__
del _name
