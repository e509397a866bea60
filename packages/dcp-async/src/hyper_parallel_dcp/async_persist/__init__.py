"""Asynchronous checkpoint persistence for hyper-parallel-dcp.

``async_save`` stages a state dict into reusable shared host memory (the only part the
training process waits for) and hands it to a persistent background writer process that
runs the ordinary save pipeline.  ``DataCopier`` decides how non-tensor leaves are
snapshotted.

Modules, top-down: :mod:`.persist` (the API and one save's two halves) →
:mod:`.writer_process` (the writer as the training process sees it) →
:mod:`.coordination` (modes, the cross-rank outcome board) → :mod:`.protocol` (requests,
replies, what the writer holds) → :mod:`.writer` (the writer process's loop, with
:mod:`.mailbox` and :mod:`.safe_pickle`) → :mod:`.arena` (staging) → :mod:`.repeat`,
:mod:`.staged`, :mod:`.slabs`, :mod:`.copier` → :mod:`._torch_compat`, :mod:`._posix`.
"""

from .__about__ import __version__
from .copier import DataCopier
from .errors import AsyncSaveError, AsyncSaveFailureWarning
from .persist import AsyncSaveResponse, async_save, shutdown_writer, start_writer

__all__ = ["AsyncSaveError", "AsyncSaveFailureWarning", "AsyncSaveResponse", "DataCopier", "__version__", "async_save",
           "shutdown_writer", "start_writer"]
