"""A local step saved by another world size, seen as one checkpoint (SPEC §13).

Each rank's local copy is a ``no_dist`` checkpoint whose metadata records its chunks' global
offsets (a DTensor's shard as a box of the global tensor), so the copies of every old rank,
merged as a save without collectives merges its ``{rank}.metadata`` files
(:func:`~hyper_parallel_dcp.storage_fs.merge_rank_metadata`: chunks deduplicated by
offsets, rank-own objects kept per rank), are the whole step.  The load planner, run on
that view, names the chunks a new rank's target needs and so the old copies it must hold;
:class:`CopiesReader` then loads them through the normal resharding load.
Exports :func:`merged_view`, :func:`needed_copies`, :class:`CopiesReader`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from hyper_parallel_dcp.core.flatten import flatten_state_dict, match_stored_keys
from hyper_parallel_dcp.core.layout import is_tensor_leaf
from hyper_parallel_dcp.core.load_planning import create_local_load_plan
from hyper_parallel_dcp.core.metadata import Metadata
from hyper_parallel_dcp.core.planner import LoadItemType
from hyper_parallel_dcp.core.stateful import expand_stateful
from hyper_parallel_dcp.storage_fs import FileSystemReader, merge_rank_metadata
from hyper_parallel_dcp.storage_fs.metadata_io import StoredMetadata

__all__ = ["CopiesReader", "merged_view", "needed_copies"]


def merged_view(copies: dict[int, Metadata], where: dict[int, str]) -> Metadata:
    """One metadata of the old ranks' ``copies`` (old rank -> its copy's metadata), each
    copy's files named by the directory ``where[rank]`` (relative to the reader's root)."""
    parts = {}
    for rank, md in copies.items():
        prefix = where[rank]
        storage = {index: replace(info, relative_path=f"{prefix}/{info.relative_path}")
                   for index, info in (md.storage_data or {}).items()}
        parts[rank] = replace(md, storage_data=storage, files={f"{prefix}/{n}": s for n, s in md.files.items()},
                              header_digests={f"{prefix}/{n}": d for n, d in md.header_digests.items()},
                              rank_objects={})
    return merge_rank_metadata(parts)


def needed_copies(state_dict: dict[str, Any], copies: dict[int, Metadata], rank: int,
                  allow_partial_load: bool) -> set[int]:
    """The old ranks whose copies hold what ``rank``'s ``state_dict`` loads (a chunk stored
    by several, a replicated tensor's, comes from the lowest); raises as a load plans."""
    view = merged_view(copies, {r: str(r) for r in copies})
    flat, _ = flatten_state_dict(expand_stateful(state_dict)[0], is_tensor_leaf)
    flat, _ = match_stored_keys(flat, {}, view.state_dict_metadata)
    plan, _ = create_local_load_plan(flat, view, allow_partial_load=allow_partial_load)
    storage = view.storage_data or {}
    needed = set()
    for item in plan.items:
        if item.type is LoadItemType.BYTE_IO:
            info = view.object_storage(item.storage_index.fqn, rank)
        else:
            info = storage[item.storage_index]
        if info is not None:
            needed.add(int(info.relative_path.split("/", 1)[0]))
    return needed


class CopiesReader(FileSystemReader):
    """Reads ``metadata`` (a :func:`merged_view`) under ``root`` as new rank ``rank``: its
    rank-own objects are the copies old rank ``rank`` saved, else the lowest's (SPEC §4)."""

    def __init__(self, root: Path, metadata: Metadata, rank: int, *, verify: bool) -> None:
        super().__init__(root, verify=verify)
        self._merged, self._new_rank = metadata, rank

    def read_metadata_payload(self) -> StoredMetadata:
        self._is_global = False
        return StoredMetadata(b"", f"{self._root()} (local copies of another world size, merged)", False,
                              self._merged)

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        super().set_up_storage_reader(metadata, is_coordinator=is_coordinator, rank=self._new_rank)
