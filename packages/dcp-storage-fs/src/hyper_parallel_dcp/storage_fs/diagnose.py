"""Read-only diagnoses that make a low-level error say what is wrong and what to do; none
raises for a bad checkpoint."""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

from hyper_parallel_dcp.core.metadata import Metadata, MetadataIndex, StorageInfo, TensorStorageMetadata
from hyper_parallel_dcp.core.steps import parse_step_name

from .files import CheckpointFiles, Location, as_checkpoint_files
from .latest import STEP_NAME
from .layout import METADATA_FILE
from .safetensors_header import HeaderEntry, SafetensorsHeaderError, entry_mismatch, read_header

__all__ = ["checkpoints_inside_hint", "header_disagreement", "header_mismatch", "item_name"]


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
    steps = []
    for name, size in entries:
        match = STEP_NAME.search(name)
        if size is None and match and not name.startswith(".") and root.child(name).size(METADATA_FILE) is not None:
            steps.append((int(match.group(1)), name))
    if not steps:
        return ""
    newest = root.child(max(steps)[1])
    # `hp-dcp ls` lists a manager's step_N directories only; other names it would not find
    managed = all(parse_step_name(name) is not None for _, name in steps)
    tool = f"`hp-dcp ls {root}` lists them" if managed else f"`hp-dcp inspect {newest}` shows what it holds"
    return f"; it is a directory of {len(steps)} checkpoint(s): pass one of them, e.g. the newest, {newest} ({tool})"
