"""Is a checkpoint complete (:func:`check_complete`), intact (:func:`verify_checkpoint`),
and which is the newest complete one (:func:`find_latest_checkpoint`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import xxhash

from hyper_parallel_dcp.core.errors import CheckpointError, CheckpointFormatError, CorruptCheckpointError, format_ranks
from hyper_parallel_dcp.core.format_version import format_version_of
from hyper_parallel_dcp.core.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    is_file_name,
    metadata_from_json,
)

from .files import CheckpointFiles, LocalFiles, Location, as_checkpoint_files
from .incremental import missing_file_error
from .latest import newest_checkpoint
from .layout import METADATA_FILE
from .metadata_io import (
    checkpoints_inside_hint,
    header_disagreement,
    header_mismatch,
    item_name,
    merge_rank_metadata,
    rank_metadata_names,
)
from .safetensors_header import SafetensorsHeaderError, read_header
from .torch_dcp import is_torch_dcp_checkpoint, read_torch_dcp_metadata

__all__ = ["CompletenessReport", "VerifyReport", "check_complete", "find_latest_checkpoint", "checkpoints_inside_hint",
           "header_disagreement", "verify_checkpoint"]

VERIFY_BLOCK_BYTES = 16 << 20  # bytes hashed per read by verify_checkpoint

#: More problems than this are summarised (a wholly wrong directory would list thousands).
_MAX_PROBLEMS = 200


@dataclass
class CompletenessReport:
    """Whether ``path`` holds a complete checkpoint, every reason it is not in ``problems``;
    ``format`` is ``"hyper-parallel-dcp"`` or ``"torch-dcp"``."""

    path: Union[Path, str]
    complete: bool
    problems: list[str] = field(default_factory=list)
    format_version: Optional[int] = None
    metadata: Optional[Metadata] = None
    format: str = "hyper-parallel-dcp"


@dataclass
class VerifyReport:
    """Result of :func:`verify_checkpoint`: ``ok`` when complete and every checksum matches."""

    path: Union[Path, str]
    ok: bool
    problems: list[str] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0


def _add(problems: list[str], text: str) -> None:
    if len(problems) < _MAX_PROBLEMS:
        problems.append(text)
    elif len(problems) == _MAX_PROBLEMS:
        problems.append("... further problems omitted")


def _read_one(root: CheckpointFiles, name: str, problems: list[str]) -> tuple[Optional[Metadata], Optional[int]]:
    """The metadata in file ``name`` and the format version it states, recording what fails."""
    file = root.where(name)
    try:
        text = root.read(name)
    except OSError as exc:
        _add(problems, f"{file} cannot be read: {exc}")
        return None, None
    try:
        try:
            return metadata_from_json(text, source=file), format_version_of(text)
        except CorruptCheckpointError as exc:  # a digest mismatch is a problem, and it is read anyway
            _add(problems, str(exc))
            return metadata_from_json(text, source=file, check_digest=False), format_version_of(text)
    except CheckpointFormatError as exc:
        _add(problems, str(exc))
        return None, format_version_of(text)


def _read_metadata(root: CheckpointFiles, problems: list[str]) -> tuple[Optional[Metadata], Optional[int]]:
    """Parse ``.metadata`` or merge the ``{rank}.metadata`` files, recording what fails."""
    if isinstance(root, LocalFiles) and is_torch_dcp_checkpoint(root.path):
        try:
            return read_torch_dcp_metadata(root.path)[0], None
        except CheckpointError as exc:
            _add(problems, str(exc))
            return None, None
    if root.size(METADATA_FILE) is not None:
        return _read_one(root, METADATA_FILE, problems)
    try:
        ranks = rank_metadata_names(root.entries())
    except OSError as exc:
        _add(problems, f"{root} cannot be listed: {exc}")
        return None, None
    if not ranks:
        _add(problems, f"{root} holds neither {METADATA_FILE} nor any {{rank}}.metadata file "
                       f"(the save never finished, or this is not a checkpoint){checkpoints_inside_hint(root)}")
        return None, None
    # A rank-local save cannot know how many ranks there were; a gap is at least detectable.
    missing = sorted(set(range(ranks[-1][0] + 1)) - {r for r, _ in ranks})
    if missing:
        _add(problems, f"{root}: the rank-local metadata of rank(s) [{format_ranks(missing)}] is missing")
    parts: dict[int, Metadata] = {}
    version: Optional[int] = None
    for rank, name in ranks:
        md, found = _read_one(root, name, problems)
        version = found if version is None else version
        if md is not None:
            parts[rank] = md
    if len(parts) != len(ranks):
        return None, version
    return merge_rank_metadata(parts), version


def _check_consistency(md: Metadata, source: CheckpointFiles, problems: list[str]) -> None:
    """Every saved item has a storage entry (the metadata does not contradict itself)."""
    storage = md.storage_data or {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                _add(problems, f"{source}: object {fqn!r} has no storage entry")
        elif isinstance(entry, TensorStorageMetadata):
            for chunk in entry.chunks:
                if MetadataIndex(fqn, chunk.offsets) not in storage:
                    _add(problems, f"{source}: {fqn!r} chunk at offsets {list(chunk.offsets)} has no storage entry")


def check_complete(path: Location) -> CompletenessReport:
    """Say whether ``path`` holds a complete checkpoint (metadata and ``stat`` only): the
    metadata parses, has a storage entry for every item, and every file has the recorded
    size.  Never raises for a bad checkpoint: every reason is in ``problems``."""
    root = as_checkpoint_files(path)
    problems: list[str] = []
    if not root.exists():
        what = f"checkpoint directory {root}" if isinstance(root.target, Path) else f"checkpoint {root} (no objects)"
        return CompletenessReport(root.target, False, [f"{what} does not exist"], None, None)
    md, version = _read_metadata(root, problems)
    if md is None:
        return CompletenessReport(root.target, False, problems or [f"{root}: no readable metadata"], version, None)
    _check_consistency(md, root, problems)
    kind = "torch-dcp" if isinstance(root, LocalFiles) and is_torch_dcp_checkpoint(root.path) else "hyper-parallel-dcp"
    sizes: dict[str, Optional[int]] = {}
    named = dict(md.files)
    for info in (md.storage_data or {}).values():
        named.setdefault(info.relative_path, -1)
    for name, expected in sorted(named.items()):
        file = root.where(name)
        sizes[name] = None
        if not is_file_name(name):
            _add(problems, f"{root}: the metadata names an invalid file {name!r}")
            continue
        try:
            actual = root.size(name)
        except OSError as exc:
            _add(problems, f"{file} cannot be examined: {exc}")
            continue
        if actual is None:
            _add(problems, str(missing_file_error(file, name)))
            continue
        sizes[name] = actual
        if expected >= 0 and actual != expected:
            _add(problems, f"{file} has {actual} bytes, the metadata records {expected} (truncated or replaced)")
        elif expected < 0 and kind != "torch-dcp":
            _add(problems, f"{root}: the metadata records no size for {name}")
    for index, info in _stored_items(md):
        size = sizes.get(info.relative_path)
        if size is not None and info.offset + info.length > size:
            _add(problems, f"{root.where(info.relative_path)}: {item_name(index)} needs bytes "
                           f"[{info.offset}, {info.offset + info.length}) but the file has {size}")
    if kind == "torch-dcp":
        for name, size in sizes.items():
            if size is not None:
                md.files.setdefault(name, size)  # torch records none: report what is there
        return CompletenessReport(root.target, not problems, problems, None, md, kind)
    return CompletenessReport(root.target, not problems, problems,
                              version if version is not None else md.format_version, md)


def _stored_items(md: Metadata) -> list[tuple[MetadataIndex, StorageInfo]]:
    """Every stored item, with every rank's copy of a rank-local object (merged views)."""
    items = list((md.storage_data or {}).items())
    listed = {(info.relative_path, info.offset) for _, info in items}
    for fqn, copies in md.rank_objects.items():
        for info in copies.values():
            if (info.relative_path, info.offset) not in listed:
                items.append((MetadataIndex(fqn), info))
    return items


def find_latest_checkpoint(root: Location) -> Optional[Union[Path, str]]:
    """The complete checkpoint (:func:`check_complete`) under ``root`` whose directory name
    ends in the highest step, as :func:`~.latest.newest_checkpoint` picks it; ``None`` if none."""
    return newest_checkpoint(root, lambda child: check_complete(child).complete)


def _hash_range(f, offset: int, length: int, buf: bytearray) -> tuple[str, int]:
    """xxh3-64 of ``length`` bytes at ``offset``; returns (hex digest, bytes actually read)."""
    hasher = xxhash.xxh3_64()
    view = memoryview(buf)
    f.seek(offset)
    done = 0
    while done < length:
        n = f.readinto(view[: min(len(buf), length - done)])
        if not n:
            break
        hasher.update(view[:n])
        done += n
    return hasher.hexdigest(), done


def verify_checkpoint(path: Location, *,
                      progress: Optional[Callable[[int, int], None]] = None) -> VerifyReport:
    """Check completeness, every header entry and every checksum at ``path``, reading each
    item once in file order (``progress(done_bytes, total_bytes)`` after each).  Never
    raises for a bad checkpoint: every problem is in the report, naming file, FQN and chunk."""
    files = as_checkpoint_files(path)
    report = check_complete(files)
    root = report.path
    problems = list(report.problems)
    md = report.metadata
    if md is None:
        return VerifyReport(root, False, problems, 0, 0)
    by_file: dict[str, list[tuple[MetadataIndex, StorageInfo]]] = defaultdict(list)
    for index, info in _stored_items(md):
        by_file[info.relative_path].append((index, info))
    total = sum(info.length for items in by_file.values() for _, info in items)
    done = chunks = checked = 0
    buf = bytearray(VERIFY_BLOCK_BYTES)
    for name in sorted(by_file):
        items = sorted(by_file[name], key=lambda p: p[1].offset)
        file = files.where(name)
        try:
            f = files.open(name)
        except OSError as exc:
            if not any(str(file) in p for p in problems):
                _add(problems, f"{file} cannot be opened: {exc}")
            done += sum(info.length for _, info in items)
            if progress is not None:
                progress(done, total)
            continue
        with f:
            size = files.size(name) or 0
            header = None
            if name.endswith(".safetensors"):
                try:
                    header = read_header(f, size)
                except SafetensorsHeaderError as exc:
                    _add(problems, f"{file}: {exc}")
            for index, info in items:
                where = f"{file}: {item_name(index)}"
                why = header_mismatch(md, index, info, header)
                if why is not None:
                    _add(problems, f"{where}: {why}")
                if info.checksum is None:
                    _add(problems, f"{where}: no checksum recorded, cannot be verified")
                elif info.offset + info.length > size:
                    _add(problems, f"{where}: truncated (needs bytes up to {info.offset + info.length}, file has {size})")
                else:
                    digest, got = _hash_range(f, info.offset, info.length, buf)
                    chunks += 1
                    checked += got
                    if got != info.length:
                        _add(problems, f"{where}: only {got} of {info.length} bytes could be read")
                    elif digest != info.checksum:
                        _add(problems, f"{where}: checksum mismatch (xxh3 {digest}, metadata records {info.checksum})")
                done += info.length
                if progress is not None:
                    progress(done, total)
    return VerifyReport(root, not problems, problems, chunks, checked)
