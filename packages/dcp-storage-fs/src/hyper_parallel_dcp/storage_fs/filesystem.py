"""The reader, the writer and the metadata reading under their historical module name."""

from __future__ import annotations

from .layout import METADATA_FILE
from .metadata_io import StoredMetadata, load_checkpoint_metadata, read_stored_metadata
from .rank_metadata import merge_rank_metadata
from .reader import FileSystemReader
from .writer import FileSystemWriter

__all__ = ["METADATA_FILE", "FileSystemReader", "FileSystemWriter", "StoredMetadata", "load_checkpoint_metadata",
           "merge_rank_metadata", "read_stored_metadata"]
