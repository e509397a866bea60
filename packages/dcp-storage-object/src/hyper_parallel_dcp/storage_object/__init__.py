"""hyper_parallel_dcp.storage_object: checkpoints on object storage (``s3://bucket/prefix``)."""

from .__about__ import __version__
from .client import ObjectStore, ObjectStoreError, ObjectStoreSettings, parse_url
from .files import ObjectFiles
from .reader import ObjectStoreReader
from .writer import ObjectStoreWriter

__all__ = [
    "ObjectFiles",
    "ObjectStore",
    "ObjectStoreError",
    "ObjectStoreReader",
    "ObjectStoreSettings",
    "ObjectStoreWriter",
    "__version__",
    "parse_url",
]
