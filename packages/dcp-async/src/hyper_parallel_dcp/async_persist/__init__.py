"""Asynchronous checkpoint persistence for hyper-parallel-dcp.

``async_save`` stages a state dict into reusable shared host memory (the only part the
caller waits for) and hands it to a persistent writer process that runs the ordinary save
pipeline; ``DataCopier`` decides how non-tensor leaves are snapshotted.  The modules,
top-down, are listed in the package README."""

from .__about__ import __version__
from .copier import DataCopier
from .errors import AsyncSaveError, AsyncSaveFailureWarning
from .persist import AsyncSaveResponse, async_save, shutdown_writer, start_writer

__all__ = ["AsyncSaveError", "AsyncSaveFailureWarning", "AsyncSaveResponse", "DataCopier", "__version__", "async_save",
           "shutdown_writer", "start_writer"]
