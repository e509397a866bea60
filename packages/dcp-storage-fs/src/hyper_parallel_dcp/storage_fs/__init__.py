"""hyper_parallel_dcp.storage_fs: safetensors checkpoint files on a filesystem."""

from hyper_parallel_dcp.core.backends import storage_writer_for

from .__about__ import __version__
from .filesystem import METADATA_FILE, FileSystemReader, FileSystemWriter, load_checkpoint_metadata

__all__ = ["METADATA_FILE", "FileSystemReader", "FileSystemWriter", "__version__", "load_checkpoint_metadata", "storage_writer_for"]
