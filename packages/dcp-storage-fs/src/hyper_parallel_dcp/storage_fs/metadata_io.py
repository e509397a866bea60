"""Reading a checkpoint's metadata from any location: :func:`read_stored_metadata` (one
rank; broadcast), :meth:`StoredMetadata.parse` (every rank), :func:`load_checkpoint_metadata`, :func:`chunk_sizes`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hyper_parallel_dcp.core.errors import CheckpointFormatError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
    chunk_columns,
    metadata_from_json,
)

from .diagnose import header_disagreement
from .files import Location, as_checkpoint_files
from .layout import METADATA_FILE
from .rank_metadata import load_rank_metadata, merge_rank_metadata

__all__ = ["StoredMetadata", "chunk_sizes", "load_checkpoint_metadata", "parse_metadata", "read_stored_metadata"]


@dataclass(frozen=True)
class StoredMetadata:
    """A checkpoint's metadata as stored: ``data``, the JSON of ``.metadata`` (``source``
    names it in errors), or for a save without collectives (``is_global`` false) the
    ``merged`` ``{rank}.metadata`` files."""

    data: bytes
    source: str
    is_global: bool
    merged: Optional[Metadata] = None

    def parse(self, location: Optional[Location] = None) -> Metadata:
        """The metadata; ``location``: the checkpoint as this rank sees it (default: the
        directory of ``source``), as :func:`parse_metadata` takes it."""
        if self.merged is not None:
            return self.merged
        return parse_metadata(self.data, self.source, Path(self.source).parent if location is None else location)


def parse_metadata(data: bytes, source: str, location: Location) -> Metadata:
    """``metadata_from_json``; a ``.metadata`` changed after the save is refused naming the
    first chunk whose location its file's header contradicts, where one does."""
    try:
        return metadata_from_json(data, source=source)
    except CorruptCheckpointError as exc:
        found = header_disagreement(location, metadata_from_json(data, source=source, check_digest=False))
        if found is None:
            found = "none in the chunk locations (the change is elsewhere in the file)"
        raise CorruptCheckpointError(f"{exc}; first disagreement with the data files: {found}") from None


def read_stored_metadata(location: Location) -> StoredMetadata:
    """The bytes of ``.metadata`` at ``location``, else every ``{rank}.metadata`` merged;
    raises as :func:`load_checkpoint_metadata` does."""
    files = as_checkpoint_files(location)
    try:
        return StoredMetadata(files.read(METADATA_FILE), files.where(METADATA_FILE), True)
    except (FileNotFoundError, NotADirectoryError):
        pass
    merged = merge_rank_metadata(load_rank_metadata(files))
    return StoredMetadata(b"", f"{files}/{{rank}}.metadata (merged)", False, merged)


def load_checkpoint_metadata(location: Location) -> tuple[Metadata, bool]:
    """``(metadata, is_global)`` of ``.metadata``, else of every ``{rank}.metadata`` merged;
    raises :class:`CheckpointNotFoundError` or :class:`CheckpointFormatError`."""
    files = as_checkpoint_files(location)
    stored = read_stored_metadata(files)
    return stored.parse(files), stored.is_global


def chunk_sizes(metadata: Metadata, index: MetadataIndex) -> tuple[int, ...]:
    """The shape of the stored chunk ``index`` names; :class:`CheckpointFormatError` if none."""
    md = metadata.state_dict_metadata[index.fqn]
    assert isinstance(md, TensorStorageMetadata)
    ndim, offsets, sizes, _ = chunk_columns(md)
    want = tuple(index.offset or ())
    if ndim == 0 or not want:
        if not want and md.chunks:
            return md.chunks[0].sizes
    else:
        count = len(offsets) // ndim
        pos = index.index
        if pos is None or not 0 <= pos < count or tuple(offsets[pos * ndim:(pos + 1) * ndim]) != want:
            pos = next((p for p in range(count) if tuple(offsets[p * ndim:(p + 1) * ndim]) == want), None)
        if pos is not None:
            return tuple(sizes[pos * ndim:(pos + 1) * ndim])
    raise CheckpointFormatError(f"{index.fqn!r}: no stored chunk at offsets {index.offset}")
