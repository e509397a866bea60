"""The object-store backend of the scheme registry (``hyper_parallel_dcp.core.backends``)."""

from __future__ import annotations

from typing import Any, Optional

from hyper_parallel_dcp.core.backends import StorageBackend
from hyper_parallel_dcp.core.storage import StorageReader, StorageWriter

from .files import object_files
from .reader import ObjectStoreReader
from .steps import object_steps
from .writer import ObjectStoreWriter

__all__ = ["S3_BACKEND"]


def _writer(checkpoint_id: Any) -> StorageWriter:
    return ObjectStoreWriter(str(checkpoint_id))


def _reader(checkpoint_id: Any, *, verify: Optional[bool] = None) -> StorageReader:
    return ObjectStoreReader(str(checkpoint_id), verify=bool(verify))


S3_BACKEND = StorageBackend("s3", _writer, _reader, object_files, object_steps)
