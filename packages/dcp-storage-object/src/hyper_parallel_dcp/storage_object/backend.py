"""The object-store backend of the scheme registry (``hyper_parallel_dcp.core.backends``)."""

from __future__ import annotations

from typing import Any, Optional

from hyper_parallel_dcp.core.backends import StorageBackend

from .files import ObjectFiles
from .reader import ObjectStoreReader
from .steps import ObjectSteps
from .writer import ObjectStoreWriter

__all__ = ["S3_BACKEND"]


def _reader(checkpoint_id: Any, *, verify: Optional[bool] = None) -> ObjectStoreReader:
    return ObjectStoreReader(str(checkpoint_id), verify=bool(verify))


S3_BACKEND = StorageBackend("s3", lambda checkpoint_id: ObjectStoreWriter(str(checkpoint_id)), _reader,
                            lambda location: ObjectFiles(str(location)), lambda root: ObjectSteps(str(root)))
