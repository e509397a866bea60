"""Reading a checkpoint's metadata from any location: :func:`read_stored_metadata` (one
rank; broadcast), :meth:`StoredMetadata.parse` (every rank), :func:`load_checkpoint_metadata`,
:func:`chunk_sizes`, :func:`storage_entry`, :func:`check_region`; the per-rank metadata (``{rank}.metadata``, SPEC §4):
:func:`load_rank_metadata`, :func:`merge_rank_metadata`; and the read-only diagnoses that
make a low-level error say what is wrong and what to do (none raises for a bad checkpoint)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from hyper_parallel_dcp.core.backends import parse_step_name
from hyper_parallel_dcp.core.errors import CheckpointFormatError, CheckpointNotFoundError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    chunk_columns,
    metadata_from_json,
)

from .files import CheckpointFiles, Location, as_checkpoint_files
from .latest import step_directories
from .layout import METADATA_FILE, RANK_METADATA
from .safetensors_header import HeaderEntry, SafetensorsHeaderError, entry_mismatch, read_header

__all__ = ["RANK_METADATA", "StoredMetadata", "check_region", "checkpoints_inside_hint", "chunk_sizes", "header_disagreement",
           "header_mismatch", "item_name", "load_checkpoint_metadata", "load_rank_metadata", "merge_rank_metadata",
           "parse_metadata", "rank_metadata_names", "read_stored_metadata", "storage_entry"]


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


def check_region(where: str, offsets: Sequence[int], lengths: Sequence[int], sizes: Sequence[int]) -> None:
    """:class:`CheckpointFormatError` (``where`` names file, FQN and chunk) unless the region
    ``offsets + lengths`` lies inside a stored chunk of ``sizes``."""
    if len(offsets) != len(sizes) or len(lengths) != len(sizes) or any(
            o + n > s for o, n, s in zip(offsets, lengths, sizes)):
        raise CheckpointFormatError(f"{where}: requested region offsets={list(offsets)} lengths={list(lengths)} "
                                    f"exceeds the stored chunk of size {list(sizes)}")


def storage_entry(metadata: Optional[Metadata], index: MetadataIndex, location: object) -> StorageInfo:
    """The storage entry of ``index`` in ``metadata`` (of the checkpoint ``location``; read
    already); :class:`CheckpointFormatError` naming both when there is none."""
    assert metadata is not None
    try:
        return metadata.storage_data[index]  # type: ignore[index]
    except (KeyError, TypeError):
        raise CheckpointFormatError(f"{index.fqn!r}: the metadata of {location} has no storage entry for "
                                    f"the chunk at {index.offset}") from None


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


def item_name(index: MetadataIndex) -> str:
    """How a stored item is named in messages."""
    if index.offset is None:
        return f"object {index.fqn!r}"
    return f"{index.fqn!r} chunk at offsets {list(index.offset)}"


def header_mismatch(md: Metadata, index: MetadataIndex, info: StorageInfo,
                    header: Optional[dict[str, HeaderEntry]]) -> Optional[str]:
    """Why ``header``'s entry for tensor chunk ``index`` disagrees with ``md``, or ``None``."""
    entry = md.state_dict_metadata.get(index.fqn)
    if header is None or index.offset is None or not isinstance(entry, TensorStorageMetadata):
        return None
    sizes = next((c.sizes for c in entry.chunks if c.offsets == index.offset), None)
    key = info.key or ""
    return entry_mismatch(header.get(key), key, entry.properties.dtype, sizes or (), info.offset, info.length)


def header_disagreement(location: Location, md: Metadata) -> Optional[str]:
    """The first stored tensor chunk (by file, then offset) whose location in ``md`` its
    file's header contradicts, as ``"<file>: <chunk>: <why>"`` (or an unreadable header);
    ``None`` when every chunk agrees."""
    files = as_checkpoint_files(location)
    by_file: dict[str, list[tuple[MetadataIndex, StorageInfo]]] = defaultdict(list)
    for index, info in (md.storage_data or {}).items():
        if index.offset is not None:
            by_file[info.relative_path].append((index, info))
    for name in sorted(by_file):
        file = files.where(name)
        try:
            with files.open(name) as f:
                header = read_header(f, files.size(name) or 0)
        except (OSError, SafetensorsHeaderError) as exc:
            return f"{file}: its header cannot be read ({exc})"
        for index, info in sorted(by_file[name], key=lambda item: item[1].offset):
            why = header_mismatch(md, index, info, header)
            if why is not None:
                return f"{file}: {item_name(index)}: {why}"
    return None


def checkpoints_inside_hint(root: CheckpointFiles) -> str:
    """For a message about ``root`` holding no checkpoint: ``""``, or the hint that it is a
    directory of checkpoints and which one to pass (looks one level down)."""
    try:
        entries = root.entries()
    except OSError:
        return ""
    steps = [(step, name) for step, name in step_directories(entries) if root.child(name).size(METADATA_FILE) is not None]
    if not steps:
        return ""
    newest = root.child(max(steps)[1])
    # `hp-dcp ls` lists a manager's step_N directories only; other names it would not find
    managed = all(parse_step_name(name) is not None for _, name in steps)
    tool = f"`hp-dcp ls {root}` lists them" if managed else f"`hp-dcp inspect {newest}` shows what it holds"
    return f"; it is a directory of {len(steps)} checkpoint(s): pass one of them, e.g. the newest, {newest} ({tool})"
