"""Asynchronous checkpoint persistence for hyper-parallel-dcp.

``async_save`` stages a state dict into reusable shared host memory (the only part the
training process waits for) and hands it to a persistent background writer process that
runs the ordinary save pipeline.  ``DataCopier`` decides how non-tensor leaves are
snapshotted.
"""

from .__about__ import __version__
from .copier import DataCopier
from .persist import (
    AsyncSaveError,
    AsyncSaveFailureWarning,
    AsyncSaveResponse,
    async_save,
    shutdown_writer,
    start_writer,
)

__all__ = ["AsyncSaveError", "AsyncSaveFailureWarning", "AsyncSaveResponse", "DataCopier", "__version__", "async_save",
           "shutdown_writer", "start_writer"]
