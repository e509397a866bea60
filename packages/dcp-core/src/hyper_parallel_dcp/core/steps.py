"""The vocabulary of a checkpoint-manager root (``root/step_N``): :class:`StepStorage`, what each
backend provides as the ``steps`` of its ``StorageBackend``."""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

__all__ = ["INFO_FILE", "Leftover", "StepEntry", "StepStorage", "parse_step_name", "step_name"]

#: The manager's per-step JSON (step, time, metrics), written before the save commits.
INFO_FILE = "hp-dcp-step.json"
_STEP_DIR = re.compile(r"^step_(0|[1-9][0-9]*)$")


def step_name(step: int) -> str:
    """The directory name of ``step``: ``step_N``."""
    return f"step_{step}"


def parse_step_name(name: str) -> Optional[int]:
    """``N`` for a directory name ``step_N`` (canonical integer), else ``None``."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class StepEntry:
    """One ``step_N`` directory: where it is and whether its save committed ``.metadata``."""

    step: int
    location: str
    complete: bool


@dataclass(frozen=True)
class Leftover:
    """Something a dead save left: ``kind`` is ``staging``, ``old``, ``lock``, ``readlock``,
    ``mailbox`` (files inside a step directory) or ``incomplete`` (a whole step directory)."""

    step: int
    kind: str
    location: str
    bytes: int
    paths: tuple[str, ...] = field(default=())


class StepStorage(Protocol):
    """What the manager and ``hp-dcp ls``/``clean`` need from a root.  ``remove_step`` never leaves
    a half-deleted step that looks complete, and returns False while a save or a :meth:`reading` runs."""

    root: Any

    def check_root(self) -> None: ...
    def location(self, step: int) -> str: ...
    def list_steps(self) -> list[StepEntry]: ...
    def is_complete(self, step: int) -> bool: ...
    def completeness_problems(self, step: int) -> list[str]: ...
    def size_bytes(self, step: int) -> int: ...
    def saved_at(self, step: int) -> Optional[float]: ...
    def read_info(self, step: int) -> Optional[dict[str, Any]]: ...
    def write_info(self, step: int, info: dict[str, Any]) -> None: ...
    def remove_step(self, step: int) -> bool: ...
    def reading(self, step: int) -> AbstractContextManager[None]: ...
    def find_leftovers(self, *, protected: frozenset[int] = frozenset(), older_than: Optional[int] = None,
                       max_step: Optional[int] = None, grace: float = 0.0,
                       check_running: bool = True) -> list[Leftover]: ...
    def remove_leftover(self, item: Leftover) -> bool: ...
