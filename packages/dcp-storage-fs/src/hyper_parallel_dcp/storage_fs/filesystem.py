"""The reader, the writer and the metadata reading under their historical module name."""

from __future__ import annotations

from .metadata_io import load_checkpoint_metadata
from .reader import FileSystemReader
from .writer import FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter", "load_checkpoint_metadata"]
