"""``save`` / ``load`` on a filesystem path for the tests of packages below the umbrella.

A package's test environment (``nox -s "tests(package=...)"``) holds only that package
and its siblings, not the umbrella, so its tests cannot ``import hyper_parallel_dcp as
dcp``.  These two functions run the same pipeline the umbrella's ``save``/``load`` run,
with a :class:`FileSystemWriter` / :class:`FileSystemReader` on ``checkpoint_id``.
Helpers that need only core live in :mod:`hyper_parallel_dcp.core.testing`.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel_dcp.core.metadata import Metadata
from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict

from .reader import FileSystemReader
from .writer import FileSystemWriter

__all__ = ["load", "save"]


def save(state_dict: dict[str, Any], *, checkpoint_id: Any, planner: Any = None, **kwargs: Any) -> Metadata:
    """``save_state_dict`` into a :class:`FileSystemWriter` on ``checkpoint_id``."""
    return save_state_dict(state_dict, FileSystemWriter(checkpoint_id), planner, **kwargs)


def load(state_dict: dict[str, Any], *, checkpoint_id: Any, verify: bool = False, **kwargs: Any) -> None:
    """``load_state_dict`` from a :class:`FileSystemReader` on ``checkpoint_id`` (in place)."""
    load_state_dict(state_dict, FileSystemReader(checkpoint_id, verify=verify), **kwargs)
