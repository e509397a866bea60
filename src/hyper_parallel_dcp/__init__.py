"""hyper-parallel-dcp: distributed checkpoints for PyTorch.

``import hyper_parallel_dcp as dcp`` gives ``dcp.save``, ``dcp.load``, ``dcp.async_save`` and
the public classes, resolved lazily; the namespace is shared by all the distributions.
"""

from __future__ import annotations

import importlib
from pkgutil import extend_path
from typing import Any

__path__ = extend_path(__path__, __name__)
__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {name: f"hyper_parallel_dcp.{module}" for module, names in {
    "api": ("save", "load"),
    "async_persist": ("async_save", "AsyncSaveResponse", "DataCopier"),
    "core.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                      "MetadataIndex"),
    "core.planner": ("SavePlanner", "LoadPlanner", "SavePlan", "LoadPlan", "WriteItem", "ReadItem"),
    "core.standard_planner": ("StandardSavePlanner", "StandardLoadPlanner"),
    "core.storage": ("StorageWriter", "StorageReader"),
    "core.ragged": ("RaggedShard",),
    "core.errors": ("CheckpointError", "CheckpointException"),
    "storage_fs": ("FileSystemWriter", "FileSystemReader"),
    "manager": ("CheckpointManager",),
    "local_tier": ("LocalTier", "LocalTierFullError"),
}.items() for name in names}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyper_parallel_dcp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The API only (what tab completion shows), not this module's own imports."""
    return list(__all__)
