"""``save`` / ``load`` / ``async_save`` for this package's own tests.

The package's test venv holds only this package and its siblings (core, storage-fs), not
the umbrella, so the tests call the same pipeline the umbrella wraps.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel_dcp.async_persist import async_save
from hyper_parallel_dcp.core.metadata import Metadata
from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.core.standard_planner import StandardSavePlanner
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter

__all__ = ["StandardSavePlanner", "async_save", "load", "save"]


def save(state_dict: dict[str, Any], *, checkpoint_id: Any, planner: Any = None, **kwargs: Any) -> Metadata:
    return save_state_dict(state_dict, FileSystemWriter(checkpoint_id), planner, **kwargs)


def load(state_dict: dict[str, Any], *, checkpoint_id: Any, **kwargs: Any) -> None:
    load_state_dict(state_dict, FileSystemReader(checkpoint_id), **kwargs)
