"""hyper-parallel-dcp: distributed checkpoints for PyTorch.

``import hyper_parallel_dcp as dcp`` gives ``dcp.save``, ``dcp.load``, ``dcp.async_save``
and the public classes.  Names are resolved lazily: importing the package imports
nothing heavy.  The ``hyper_parallel_dcp`` namespace is shared by all six distributions,
hence ``extend_path``.
"""

from __future__ import annotations

import importlib
from pkgutil import extend_path
from typing import Any

__path__ = extend_path(__path__, __name__)
__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "save": "hyper_parallel_dcp.api",
    "load": "hyper_parallel_dcp.api",
    "async_save": "hyper_parallel_dcp.async_persist",
    "Metadata": "hyper_parallel_dcp.core.metadata",
    "TensorStorageMetadata": "hyper_parallel_dcp.core.metadata",
    "BytesStorageMetadata": "hyper_parallel_dcp.core.metadata",
    "ChunkStorageMetadata": "hyper_parallel_dcp.core.metadata",
    "MetadataIndex": "hyper_parallel_dcp.core.metadata",
    "SavePlanner": "hyper_parallel_dcp.core.planner",
    "LoadPlanner": "hyper_parallel_dcp.core.planner",
    "SavePlan": "hyper_parallel_dcp.core.planner",
    "LoadPlan": "hyper_parallel_dcp.core.planner",
    "WriteItem": "hyper_parallel_dcp.core.planner",
    "ReadItem": "hyper_parallel_dcp.core.planner",
    "StandardSavePlanner": "hyper_parallel_dcp.core.standard_planner",
    "StandardLoadPlanner": "hyper_parallel_dcp.core.standard_planner",
    "StorageWriter": "hyper_parallel_dcp.core.storage",
    "StorageReader": "hyper_parallel_dcp.core.storage",
    "RaggedShard": "hyper_parallel_dcp.core.ragged",
    "CheckpointError": "hyper_parallel_dcp.core.errors",
    "CheckpointException": "hyper_parallel_dcp.core.errors",
    "FileSystemWriter": "hyper_parallel_dcp.storage_fs",
    "FileSystemReader": "hyper_parallel_dcp.storage_fs",
    "AsyncSaveResponse": "hyper_parallel_dcp.async_persist",
    "DataCopier": "hyper_parallel_dcp.async_persist",
    "CheckpointManager": "hyper_parallel_dcp.manager",
}

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
