"""The object-store backend of the scheme registry (``hyper_parallel_dcp.core.backends``)."""

from __future__ import annotations

from hyper_parallel_dcp.core.backends import StorageBackend

from .files import ObjectFiles
from .reader import ObjectStoreReader
from .steps import ObjectSteps
from .writer import ObjectStoreWriter

__all__ = ["S3_BACKEND"]


S3_BACKEND = StorageBackend("s3", lambda checkpoint_id: ObjectStoreWriter(str(checkpoint_id)),
                            lambda url, *, verify=None: ObjectStoreReader(str(url), verify=bool(verify)),
                            lambda location: ObjectFiles(str(location)), lambda root: ObjectSteps(str(root)))
