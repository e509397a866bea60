"""Checks of the values read from a ``.metadata`` document, shared by both format readers.

Each raises :class:`~hyper_parallel_dcp.core.errors.CheckpointFormatError` saying what was
expected and what was found.  Exports :func:`int_tuple`, :func:`flat_ints`,
:func:`is_file_name`, :func:`referenced_checkpoint` and :data:`HEX16`.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from ..errors import CheckpointFormatError

__all__ = ["HEX16", "flat_ints", "int_tuple", "is_file_name", "referenced_checkpoint"]

#: An xxh3-64 digest as the format writes it.
HEX16 = re.compile(r"[0-9a-f]{16}")


def int_tuple(value: Any, what: str) -> tuple[int, ...]:
    """A JSON list of integers >= 0 as a tuple; ``what`` names it in the error."""
    # the common valid case checked with C-level builtins (json gives exact ints; bool is
    # another type), the slow path only explains
    if type(value) is list and (not value or (set(map(type, value)) == {int} and min(value) >= 0)):
        return tuple(value)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise CheckpointFormatError(f"{what} must be a list of integers, got {value!r}")
    if any(v < 0 for v in value):
        raise CheckpointFormatError(f"{what} must not be negative, got {value!r}")
    return tuple(value)


def flat_ints(value: Any, what: str, length: int, *, low: int = 0) -> list[int]:
    """A JSON list of ``length`` integers, each ``>= low`` (the list itself, not a copy)."""
    if type(value) is not list or len(value) != length:
        found = len(value) if isinstance(value, list) else "-"
        raise CheckpointFormatError(f"{what} must be a list of {length} integers, got "
                                    f"{type(value).__name__} of length {found}")
    if value and (set(map(type, value)) != {int} or min(value) < low):
        bad = next((v for v in value if type(v) is not int or v < low), None)
        raise CheckpointFormatError(f"{what} must hold integers >= {low}, found {bad!r}")
    return value


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and "/" not in name and "\\" not in name and name not in ("", ".", "..")


def referenced_checkpoint(name: Any) -> Optional[str]:
    """The checkpoint beside this one that file ``name`` is in, for a name ``../<checkpoint>/<file>``
    (an incremental save's reference to an earlier checkpoint's bytes, SPEC §14); else ``None``."""
    if isinstance(name, str) and name.startswith("../"):
        parts = name[3:].split("/")
        if len(parts) == 2 and _plain_name(parts[0]) and _plain_name(parts[1]):
            return parts[0]
    return None


def is_file_name(name: Any) -> bool:
    """Whether ``name`` may name a data file: a plain name inside the checkpoint directory, or
    ``../<checkpoint>/<file>``, a file of a checkpoint beside it (:func:`referenced_checkpoint`)."""
    return _plain_name(name) or referenced_checkpoint(name) is not None
