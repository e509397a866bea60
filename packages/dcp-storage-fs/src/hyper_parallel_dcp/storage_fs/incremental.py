"""Incremental saves (SPEC §14): :func:`reference_base` and :class:`ReferenceBase`, which
reference chunks equal to an earlier checkpoint's (``../<base>/<file>``) instead of writing
them, :func:`missing_file_error` for a referenced file that is gone, and :func:`map_in_order`
(the chunk-at-a-time thread pool of the hashing and of the compression)."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import posixpath
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

import torch
import xxhash

from hyper_parallel_dcp.core.errors import CheckpointNotFoundError
from hyper_parallel_dcp.core.metadata import (
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    chunk_location,
    referenced_checkpoint,
)
from hyper_parallel_dcp.core.planner import WriteItem
from hyper_parallel_dcp.core.storage import WriteResult

from .files import CheckpointFiles, Location, as_checkpoint_files
from .metadata_io import load_checkpoint_metadata
from .posix import tensor_bytes
from .safetensors_header import to_stored

__all__ = ["ReferenceBase", "map_in_order", "missing_file_error", "reference_base"]

T = TypeVar("T")
R = TypeVar("R")


def map_in_order(fn: Callable[[T], R], items: Iterable[T], name: str) -> Iterator[tuple[T, R]]:
    """``(item, fn(item))`` for each of ``items``, in order, ``fn`` run on a pool of up to 8
    threads named ``name`` with at most two items a thread in flight (``items`` is consumed
    on the caller's thread, never all held at once); ``fn``'s error propagates."""
    threads = max(1, min(8, os.cpu_count() or 1))
    with cf.ThreadPoolExecutor(threads, thread_name_prefix=name) as pool:
        window: collections.deque[tuple[T, cf.Future[R]]] = collections.deque()
        for item in items:
            window.append((item, pool.submit(fn, item)))
            if len(window) > 2 * threads:
                done, future = window.popleft()
                yield done, future.result()
        while window:
            done, future = window.popleft()
            yield done, future.result()


class ReferenceBase:
    """The chunks of ``metadata`` (checkpoint ``name``, beside the one being saved)."""

    def __init__(self, metadata: Metadata, name: str) -> None:
        self.metadata = metadata
        self.name = name

    def reference(self, fqn: str, offsets: tuple[int, ...], stored_dtype: torch.dtype, sizes: tuple[int, ...],
                  key: str, digest: str) -> Optional[tuple[StorageInfo, int, Optional[str]]]:
        """``(where the bytes are, that file's size, its header digest)`` when the base stores
        the chunk of ``fqn`` at ``offsets`` with the same sizes, stored dtype, key and xxh3
        ``digest``; else ``None``.  The file is named relative to the new checkpoint."""
        md = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata) or (md.properties.stored_as or md.properties.dtype) != stored_dtype:
            return None
        index = MetadataIndex(fqn, offsets)
        where = chunk_location(self.metadata, index)
        info = (self.metadata.storage_data or {}).get(index)
        if where is None or info is None or tuple(where[2]) != tuple(sizes) or info.key != key or \
                info.checksum != digest:
            return None
        name = posixpath.normpath(f"../{self.name}/{info.relative_path}")
        size = self.metadata.files.get(info.relative_path)
        if size is None:
            return None
        rebased = StorageInfo(name, info.offset, info.length, info.checksum, info.key)
        return rebased, size, self.metadata.header_digests.get(info.relative_path)

    def split(self, keyed: list[tuple[str, WriteItem]], resolve: Callable[[WriteItem], Any]
              ) -> tuple[list[tuple[str, WriteItem]], list[WriteResult]]:
        """``keyed`` (``(storage key, item)`` pairs, in order) split into those to write and
        the results of those the base holds equal (:meth:`reference`); each chunk is hashed
        once on a thread pool, at most ``2 x threads`` in flight (``docs/perf/storage.md``)."""
        changed: list[tuple[str, WriteItem]] = []
        referenced: list[WriteResult] = []
        stored = ((key, it, to_stored(resolve(it))) for key, it in keyed)  # resolved on this thread
        for (key, it, tensor), digest in map_in_order(lambda entry: _digest(entry[2]), stored, "hp-dcp-xxh3"):
            assert it.sizes is not None and it.index.offset is not None
            found = self.reference(it.index.fqn, it.index.offset, tensor.dtype, tuple(it.sizes), key, digest)
            if found is None:
                changed.append((key, it))
            else:
                referenced.append(WriteResult(it.index, *found))
        return changed, referenced


def _digest(tensor: torch.Tensor) -> str:
    tensor = tensor.detach().to("cpu").contiguous()
    return xxhash.xxh3_64_hexdigest(tensor_bytes(tensor))


def _parent_and_name(files: CheckpointFiles) -> tuple[str, str]:
    target = files.target
    text = os.path.abspath(target) if isinstance(target, Path) else str(target).rstrip("/")
    parent, _, name = text.rpartition("/")
    return parent, name


def reference_base(base: Location, target: Location) -> ReferenceBase:
    """The checkpoint ``base`` as seen from ``target`` (the checkpoint being saved).

    Raises ``ValueError`` unless ``base`` is another checkpoint in the same parent
    directory (or prefix) as ``target``, and what :func:`load_checkpoint_metadata` raises
    for a missing or unreadable ``base``."""
    base_files, target_files = as_checkpoint_files(base), as_checkpoint_files(target)
    (base_parent, name), (target_parent, target_name) = _parent_and_name(base_files), _parent_and_name(target_files)
    if base_parent != target_parent or name == target_name or not name:
        raise ValueError(f"incremental_from={str(base_files)!r} must be another checkpoint beside {target_files} "
                         "(the same parent directory or prefix): the new .metadata names its files by a path "
                         "relative to itself, ../<checkpoint>/<file>")
    metadata, _ = load_checkpoint_metadata(base_files)
    return ReferenceBase(metadata, name)


def missing_file_error(where: str, name: str) -> CheckpointNotFoundError:
    """The error for file ``name`` of a checkpoint, missing at ``where`` (how it is shown)."""
    base = referenced_checkpoint(name)
    if base is None:
        return CheckpointNotFoundError(f"checkpoint file {where} is missing")
    where = where.replace(os.sep, "/")
    scheme, _, path = where.rpartition("://")  # a URL's "//" stays
    shown = f"{scheme}://{posixpath.normpath(path)}" if scheme else posixpath.normpath(path)
    needing = posixpath.basename(where[:-len(name)].rstrip("/"))
    return CheckpointNotFoundError(
        f"checkpoint file {shown} is missing: checkpoint {needing} is an incremental save whose unchanged chunks "
        f"are stored in {base}, which was deleted or damaged; restore {base}, or load a checkpoint saved in full")
