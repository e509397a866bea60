"""The one loader of per-rank metadata (``{rank}.metadata``, a save without collectives).

Every path that has no ``.metadata`` — ``load``'s fallback, ``check_complete`` /
``verify_checkpoint``, the ``hp-dcp`` tools and the converter — reads the per-rank files
with :func:`load_rank_metadata` and merges them with :func:`merge_rank_metadata`, so all
of them give the same view: tensor chunks deduplicated across ranks, and for a non-tensor
object saved by several ranks (RNG state, data-loader position) every rank's copy, kept
in ``Metadata.rank_objects``; :meth:`Metadata.object_storage` says which copy a rank
loads (SPEC §4: its own, else the lowest saving rank's).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

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

__all__ = ["RANK_METADATA", "load_rank_metadata", "merge_rank_metadata", "rank_metadata_files"]

#: File name of one rank's metadata; group 1 is the rank.
RANK_METADATA = re.compile(r"^(\d+)\.metadata$")

# (file, its bytes or None when unreadable, the error) -> None; records instead of raising
OnError = Callable[[Path, Optional[bytes], Exception], None]


def rank_metadata_files(root: Union[str, os.PathLike]) -> list[tuple[int, Path]]:
    """``(rank, path)`` of every ``{rank}.metadata`` in ``root``, by rank ([] if none)."""
    base = Path(root)
    found = []
    for entry in os.scandir(base):
        match = RANK_METADATA.match(entry.name)
        if match:
            found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found)


def load_rank_metadata(root: Union[str, os.PathLike], *, on_error: Optional[OnError] = None) -> dict[int, Metadata]:
    """Parse every ``{rank}.metadata`` in ``root``: ``{rank: Metadata}``.

    Raises :class:`CheckpointNotFoundError` naming ``root`` when there is none, and the
    parse error (:class:`CheckpointFormatError`, ``OSError``) of a bad file — unless
    ``on_error`` is given, which is then called for that file instead and the file skipped.
    """
    files = rank_metadata_files(root)
    if not files:
        from .files import as_checkpoint_files
        from .integrity import checkpoints_inside_hint

        raise CheckpointNotFoundError(
            f"{root} holds no checkpoint: neither .metadata nor any {{rank}}.metadata file "
            f"(an interrupted save leaves none){checkpoints_inside_hint(as_checkpoint_files(root))}"
        )
    parts: dict[int, Metadata] = {}
    for rank, path in files:
        text: Optional[bytes] = None
        try:
            text = path.read_bytes()
            parts[rank] = metadata_from_json(text, source=str(path))
        except Exception as exc:  # noqa: BLE001 - handed to on_error, or re-raised
            if on_error is None:
                raise
            on_error(path, text, exc)
    return parts


def merge_rank_metadata(parts: Mapping[int, Metadata]) -> Metadata:
    """One view of several ranks' metadata.

    Tensor chunks are deduplicated by offsets (the lowest rank's storage wins).  An object
    FQN saved by more than one rank keeps every copy in ``rank_objects`` (saving rank →
    storage); ``storage_data`` holds the lowest saving rank's copy.
    """
    sd: dict[str, Any] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    files: dict[str, int] = {}
    header_digests: dict[str, str] = {}
    seen: dict[str, set] = {}
    copies: dict[str, dict[int, StorageInfo]] = {}
    for rank in sorted(parts):
        md = parts[rank]
        for fqn, entry in md.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                sd.setdefault(fqn, entry)
                info = (md.storage_data or {}).get(MetadataIndex(fqn))
                if info is not None:
                    copies.setdefault(fqn, {})[rank] = info
                continue
            mine = sd.get(fqn)
            if mine is None:
                mine = sd[fqn] = TensorStorageMetadata(entry.properties, entry.size, [])
                seen[fqn] = set()
            for chunk in entry.chunks:
                if chunk.offsets not in seen[fqn]:
                    seen[fqn].add(chunk.offsets)
                    mine.chunks.append(ChunkStorageMetadata(chunk.offsets, chunk.sizes))
        for index, info in (md.storage_data or {}).items():
            storage.setdefault(index, info)
        files.update(md.files)
        header_digests.update(md.header_digests)
    for entry in sd.values():
        if isinstance(entry, TensorStorageMetadata):
            entry.chunks.sort(key=lambda c: c.offsets)
    rank_objects = {fqn: by_rank for fqn, by_rank in copies.items() if len(by_rank) > 1}
    return Metadata(state_dict_metadata=sd, storage_data=storage, files=files, rank_objects=rank_objects,
                    header_digests=header_digests)
