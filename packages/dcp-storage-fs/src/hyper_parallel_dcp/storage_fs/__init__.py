"""hyper_parallel_dcp.storage_fs: safetensors checkpoint files on a filesystem."""

from .__about__ import __version__
from .filesystem import METADATA_FILE, FileSystemReader, FileSystemWriter, load_checkpoint_metadata, storage_writer_for
from .rank_metadata import load_rank_metadata, merge_rank_metadata

__all__ = ["METADATA_FILE", "FileSystemReader", "FileSystemWriter", "__version__", "load_checkpoint_metadata",
           "load_rank_metadata", "merge_rank_metadata", "storage_writer_for"]
