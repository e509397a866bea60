"""The newest complete checkpoint under a root of step directories, without torch:
:func:`newest_checkpoint`, :func:`metadata_complete`, :func:`step_directories` and :data:`STEP_NAME`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional, Union

from hyper_parallel_dcp.core.backends import parse_step_name
from hyper_parallel_dcp.core.format_version import FORMAT_VERSION, format_version_of

from .files import CheckpointFiles, Location, as_checkpoint_files
from .layout import METADATA_FILE, RANK_METADATA

__all__ = ["STEP_NAME", "metadata_complete", "newest_checkpoint", "step_directories"]

#: A directory name ending in a step number (``step_100``, ``global_step2000``, ``300``).
STEP_NAME = re.compile(r"(\d+)$")

FullCheck = Callable[[CheckpointFiles], bool]


def step_directories(entries: list[tuple[str, Optional[int]]]) -> list[tuple[int, str]]:
    """``(step, name)`` of the sub-locations among ``entries`` whose name ends in a step (not hidden)."""
    return [(int(match.group(1)), name) for name, size in entries
            if size is None and not name.startswith(".") and (match := STEP_NAME.search(name))]


def metadata_complete(location: Location, full_check: Optional[FullCheck] = None) -> bool:
    """Whether ``location``'s ``.metadata`` parses as JSON of a known format version; what JSON
    cannot tell (torch DCP, ``{rank}.metadata``) ``full_check`` decides (``False`` without)."""
    files = as_checkpoint_files(location)
    try:
        text = files.read(METADATA_FILE)
    except OSError:
        try:
            rank_local = any(RANK_METADATA.match(name) for name, size in files.entries() if size is not None)
        except OSError:
            return False
        return rank_local and full_check is not None and full_check(files)
    if text[:1] == b"\x80":  # a pickle: torch DCP
        return full_check is not None and full_check(files)
    version = format_version_of(text)
    return version is not None and 1 <= version <= FORMAT_VERSION


def newest_checkpoint(root: Location, is_complete: FullCheck) -> Optional[Union[Path, str]]:
    """The complete (``is_complete``) checkpoint under ``root`` whose directory name ends in
    the highest step (only ``step_N`` ones where there are any); its ``Path`` or URL, or ``None``."""
    base = as_checkpoint_files(root)
    try:
        entries = base.entries()
    except (FileNotFoundError, NotADirectoryError):
        return None
    candidates = step_directories(entries)
    manager_steps = [(step, name) for step, name in candidates if parse_step_name(name) is not None]
    for _, name in sorted(manager_steps or candidates, reverse=True):
        child = base.child(name)
        if is_complete(child):
            return child.target
    return None
