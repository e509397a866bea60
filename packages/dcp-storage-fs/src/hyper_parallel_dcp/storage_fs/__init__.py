"""hyper_parallel_dcp.storage_fs: safetensors checkpoint files on a filesystem.

The names below load on first use, so that a light module (``layout``) imports no torch.
"""

from importlib import import_module
from typing import Any

from .__about__ import __version__

_EXPORTS = {  # name -> the module that defines it
    "METADATA_FILE": ".layout",
    "FileSystemReader": ".reader",
    "FileSystemWriter": ".writer",
    "TorchDCPReader": ".torch_dcp",
    "is_torch_dcp_checkpoint": ".torch_dcp",
    "load_checkpoint_metadata": ".metadata_io",
    "load_rank_metadata": ".metadata_io",
    "merge_rank_metadata": ".metadata_io",
    "storage_reader_for_path": ".torch_dcp",
    "storage_writer_for": "hyper_parallel_dcp.core.backends",
    "wait_for_removals": ".commit",
}
__all__ = ["METADATA_FILE", "FileSystemReader", "FileSystemWriter", "TorchDCPReader", "__version__",
           "is_torch_dcp_checkpoint", "load_checkpoint_metadata", "load_rank_metadata", "merge_rank_metadata",
           "storage_reader_for_path", "storage_writer_for", "wait_for_removals"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(import_module(_EXPORTS[name], __name__), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
