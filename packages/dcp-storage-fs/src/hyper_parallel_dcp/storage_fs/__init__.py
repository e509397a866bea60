"""hyper_parallel_dcp.storage_fs: safetensors checkpoint files on a filesystem."""

from hyper_parallel_dcp.core.backends import storage_writer_for

from .__about__ import __version__
from .commit import wait_for_removals
from .layout import METADATA_FILE
from .metadata_io import load_checkpoint_metadata
from .rank_metadata import load_rank_metadata, merge_rank_metadata
from .reader import FileSystemReader
from .torch_dcp import TorchDCPReader, is_torch_dcp_checkpoint, storage_reader_for_path
from .writer import FileSystemWriter

__all__ = ["METADATA_FILE", "FileSystemReader", "FileSystemWriter", "TorchDCPReader", "__version__",
           "is_torch_dcp_checkpoint", "load_checkpoint_metadata", "load_rank_metadata", "merge_rank_metadata",
           "storage_reader_for_path", "storage_writer_for", "wait_for_removals"]
