"""The one loader of per-rank metadata (``{rank}.metadata``): :func:`load_rank_metadata`
and :func:`merge_rank_metadata` (SPEC §4)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from hyper_parallel_dcp.core.errors import CheckpointNotFoundError
from hyper_parallel_dcp.core.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    metadata_from_json,
)

from .diagnose import checkpoints_inside_hint
from .files import Location, as_checkpoint_files
from .layout import RANK_METADATA

__all__ = ["RANK_METADATA", "load_rank_metadata", "merge_rank_metadata", "rank_metadata_names"]


def rank_metadata_names(entries: Iterable[tuple[str, Optional[int]]]) -> list[tuple[int, str]]:
    """``(rank, name)`` of every ``{rank}.metadata`` file among a location's ``entries``, by rank."""
    return sorted((int(match.group(1)), name) for name, size in entries
                  if size is not None and (match := RANK_METADATA.match(name)))


def load_rank_metadata(location: Location) -> dict[int, Metadata]:
    """``{rank: Metadata}`` of every ``{rank}.metadata`` at ``location``; raises
    :class:`CheckpointNotFoundError` when there is none, the parse error of a bad file."""
    files = as_checkpoint_files(location)
    try:
        names = rank_metadata_names(files.entries())
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"checkpoint directory {files} does not exist") from None
    if not names:
        raise CheckpointNotFoundError(
            f"{files} holds no checkpoint: neither .metadata nor any {{rank}}.metadata file "
            f"(an interrupted save leaves none){checkpoints_inside_hint(files)}")
    return {rank: metadata_from_json(files.read(name), source=files.where(name)) for rank, name in names}


def merge_rank_metadata(parts: Mapping[int, Metadata]) -> Metadata:
    """One view of several ranks' metadata: tensor chunks deduplicated by offsets (the
    lowest rank's wins); an object saved by several ranks keeps every copy in
    ``rank_objects`` (rank → storage), the lowest rank's in ``storage_data``."""
    sd: dict[str, Any] = {}
    chunks: dict[str, dict[tuple[int, ...], ChunkStorageMetadata]] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    files: dict[str, int] = {}
    header_digests: dict[str, str] = {}
    copies: dict[str, dict[int, StorageInfo]] = {}
    for rank in sorted(parts):
        md = parts[rank]
        for fqn, entry in md.state_dict_metadata.items():
            sd.setdefault(fqn, entry)
            if isinstance(entry, BytesStorageMetadata):
                info = (md.storage_data or {}).get(MetadataIndex(fqn))
                if info is not None:
                    copies.setdefault(fqn, {})[rank] = info
            else:
                mine = chunks.setdefault(fqn, {})
                for chunk in entry.chunks:
                    mine.setdefault(chunk.offsets, ChunkStorageMetadata(chunk.offsets, chunk.sizes))
        for index, info in (md.storage_data or {}).items():
            storage.setdefault(index, info)
        files.update(md.files)
        header_digests.update(md.header_digests)
    for fqn, by_offsets in chunks.items():
        first = sd[fqn]
        sd[fqn] = TensorStorageMetadata(first.properties, first.size, [by_offsets[o] for o in sorted(by_offsets)])
    rank_objects = {fqn: by_rank for fqn, by_rank in copies.items() if len(by_rank) > 1}
    return Metadata(state_dict_metadata=sd, storage_data=storage, files=files, rank_objects=rank_objects,
                    header_digests=header_digests)
