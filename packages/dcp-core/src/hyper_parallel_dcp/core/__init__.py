"""hyper_parallel_dcp.core: geometry, metadata, planners, storage interfaces, pipelines.

The names below load on first use (module ``__getattr__``), so importing one submodule
(``hyper_parallel_dcp.core.errors``) imports neither torch nor the others.
"""

from __future__ import annotations

import importlib
from typing import Any

from .__about__ import __version__ as __version__

# submodule -> the names this package exports from it
_EXPORTS = {
    "chunks": ("ChunkBox", "flat_range_to_boxes"),
    "errors": ("CheckpointError", "CheckpointException", "CheckpointFormatError", "CheckpointNotFoundError",
               "CheckpointStoreLostError", "ConcurrentSaveError", "CorruptCheckpointError", "MismatchError",
               "MissingKeyError", "MissingRegionError", "UnsafeObjectError", "UnsupportedPlacementError",
               "UnsupportedTensorError"),
    "layout": ("TensorShards", "to_tensor_shards"),
    "load_planning": ("StandardLoadPlanner",),
    "metadata": ("FORMAT_VERSION", "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex",
                 "StorageInfo", "TensorProperties", "TensorStorageMetadata"),
    "pipeline": ("load_state_dict", "save_state_dict"),
    "plan_columns": ("WriteColumns",),
    "planner": ("LoadItemType", "LoadPlan", "LoadPlanner", "ReadItem", "SavePlan", "SavePlanner", "WriteItem",
                "WriteItemType"),
    "ragged": ("RaggedShard",),
    "save_planning": ("StandardSavePlanner",),
    "storage": ("StorageReader", "StorageWriter", "WriteResult"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted([*_MODULE_OF, "__version__"])


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
