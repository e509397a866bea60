"""hyper_parallel_dcp.core: geometry, metadata, planners, storage interfaces, pipelines."""

from .__about__ import __version__
from .chunks import ChunkBox, flat_range_to_boxes
from .errors import (
    CheckpointError,
    CheckpointException,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    MismatchError,
    MissingKeyError,
    MissingRegionError,
    UnsafeObjectError,
    UnsupportedPlacementError,
    UnsupportedTensorError,
)
from .layout import TensorShards, to_tensor_shards
from .metadata import (
    FORMAT_VERSION,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
)
from .pipeline import load_state_dict, save_state_dict
from .plan_columns import WriteColumns
from .planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from .ragged import RaggedShard
from .standard_planner import StandardLoadPlanner, StandardSavePlanner
from .storage import StorageReader, StorageWriter, WriteResult

__all__ = [
    "FORMAT_VERSION",
    "BytesStorageMetadata",
    "CheckpointError",
    "CheckpointException",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ChunkBox",
    "ChunkStorageMetadata",
    "ConcurrentSaveError",
    "CorruptCheckpointError",
    "LoadItemType",
    "LoadPlan",
    "LoadPlanner",
    "Metadata",
    "MetadataIndex",
    "MismatchError",
    "MissingKeyError",
    "MissingRegionError",
    "RaggedShard",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "StandardLoadPlanner",
    "StandardSavePlanner",
    "StorageInfo",
    "StorageReader",
    "StorageWriter",
    "TensorProperties",
    "TensorShards",
    "TensorStorageMetadata",
    "UnsafeObjectError",
    "UnsupportedPlacementError",
    "UnsupportedTensorError",
    "WriteColumns",
    "WriteItem",
    "WriteItemType",
    "WriteResult",
    "__version__",
    "flat_range_to_boxes",
    "load_state_dict",
    "save_state_dict",
    "to_tensor_shards",
]
