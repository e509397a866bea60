"""``ObjectFiles``: a bucket prefix seen as a checkpoint location (``CheckpointFiles``): keys,
objects, sub-prefixes, sizes, ranged reads, and ``remove`` (``.metadata`` first)."""

from __future__ import annotations

import io
import posixpath
from typing import BinaryIO, Optional

from hyper_parallel_dcp.storage_fs.files import CheckpointFiles, RangeReader
from hyper_parallel_dcp.storage_fs.layout import METADATA_FILE

from .client import ObjectStore, ObjectStoreSettings, parse_url

__all__ = ["ObjectFiles"]


class ObjectFiles(CheckpointFiles):
    """The objects directly under ``scheme://bucket/prefix/``; ``store``: the bucket's client
    to use (its bucket and scheme must be the URL's), else a new one."""

    def __init__(self, url: str, settings: Optional[ObjectStoreSettings] = None,
                 store: Optional[ObjectStore] = None) -> None:
        scheme, bucket, prefix = parse_url(url)
        self.store = store or ObjectStore(bucket, settings, scheme)
        self.prefix = prefix
        self.target = f"{scheme}://{bucket}/{prefix}" if prefix else f"{scheme}://{bucket}"

    def key(self, name: str) -> str:
        """The key of object ``name`` under the prefix (``../<checkpoint>/<file>``: of the
        checkpoint beside it, an incremental save's reference)."""
        if name.startswith("../") and self.prefix:
            return posixpath.normpath(f"{self.prefix}/{name}").lstrip("/")
        return f"{self.prefix}/{name}" if self.prefix else name

    def names(self) -> list[str]:
        """The names of the objects directly under the prefix."""
        return [name for name, size in self.entries() if size is not None]

    def exists(self) -> bool:
        return any(True for _ in self.store.list_objects(self.key(""), delimiter="/"))

    def entries(self) -> list[tuple[str, Optional[int]]]:
        base = self.key("")
        out: list[tuple[str, Optional[int]]] = []
        for key, size in self.store.list_objects(base, delimiter="/"):
            name = key[len(base):]
            if size < 0:
                out.append((name.rstrip("/"), None))
            elif name:
                out.append((name, size))
        return out

    def size(self, name: str) -> Optional[int]:
        return self.store.size(self.key(name))

    def open(self, name: str) -> BinaryIO:
        size = self.size(name)
        if size is None:
            raise FileNotFoundError(f"{self.where(name)} does not exist")
        key = self.key(name)

        def ranged_get(position: int, view: memoryview) -> int:
            self.store.get_range_into(key, position, view)
            return len(view)

        return io.BufferedReader(RangeReader(size, ranged_get), buffer_size=1 << 20)  # type: ignore[return-value]

    def read(self, name: str) -> bytes:
        return self.store.get(self.key(name))

    def child(self, name: str) -> ObjectFiles:
        return ObjectFiles(f"{self.target}/{name}", store=self.store)

    def remove(self) -> None:
        base = self.key("")
        self.store.delete([self.key(METADATA_FILE)])
        keys = [k for k, size in self.store.list_objects(base) if size >= 0]
        self.store.delete(keys)
        self.store.abort_uploads(base)

    def total_size(self) -> int:
        return sum(size for _, size in self.store.list_objects(self.key("")) if size >= 0)
