"""The filesystem reader and writer under their historical module name (kept for importers).

``FileSystemWriter`` lives in ``writer``, ``FileSystemReader`` in ``reader``, the metadata
reading in ``metadata_io``; this module re-exports them.
"""

from __future__ import annotations

from .layout import METADATA_FILE
from .metadata_io import StoredMetadata, load_checkpoint_metadata, read_stored_metadata
from .rank_metadata import merge_rank_metadata
from .reader import FileSystemReader
from .writer import FileSystemWriter

__all__ = [
    "METADATA_FILE",
    "FileSystemReader",
    "FileSystemWriter",
    "StoredMetadata",
    "load_checkpoint_metadata",
    "merge_rank_metadata",
    "read_stored_metadata",
]
