"""Exceptions raised by hyper-parallel-dcp.

Every error is an ``Exception`` subclass whose message names the FQN, file or rank
concerned.  Several also derive from the built-in type a caller would naturally catch
(``FileNotFoundError``, ``KeyError``, ``ValueError``).  The text helpers of messages
(:func:`format_ranks`, :func:`format_bytes`) live here too.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable

__all__ = [
    "CheckpointError",
    "CheckpointException",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointStoreLostError",
    "CheckpointTimeoutError",
    "ConcurrentSaveError",
    "CorruptCheckpointError",
    "MissingKeyError",
    "MismatchError",
    "MissingRegionError",
    "UnsafeObjectError",
    "UnsupportedPlacementError",
    "UnsupportedTensorError",
    "describe_failures",
    "format_bytes",
    "format_ranks",
    "remote_error_class",
]


class CheckpointError(Exception):
    """Base class of every error hyper-parallel-dcp raises on purpose."""


class CheckpointFormatError(CheckpointError, ValueError):
    """``.metadata`` (or a shard file header) cannot be understood."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory or one of its files does not exist."""


class MissingKeyError(CheckpointError, KeyError):
    """A key requested by the load is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class MissingRegionError(CheckpointError, ValueError):
    """Part of a requested tensor region was never saved."""


class MismatchError(CheckpointError, ValueError):
    """The target tensor's shape or dtype differs from the stored one."""


class UnsupportedPlacementError(CheckpointError, ValueError):
    """A DTensor placement that cannot be checkpointed (``Partial``)."""


class UnsupportedTensorError(CheckpointError, TypeError):
    """A tensor that cannot be saved or loaded into: sparse, nested, quantized, or on the
    meta device."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match their checksum, or a file is truncated."""


class UnsafeObjectError(CheckpointError):
    """A stored object would need code that is not allow-listed to be restored."""


class ConcurrentSaveError(CheckpointError):
    """Another save into the same checkpoint directory is in progress."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """Some ranks did not reach a checkpoint collective in time (``missing_ranks`` names them)."""

    def __init__(self, message: str, phase: str = "", missing_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.phase = phase
        self.missing_ranks = missing_ranks

    def __reduce__(self):  # picklable across processes
        return (type(self), (str(self), self.phase, self.missing_ranks))


class CheckpointStoreLostError(CheckpointTimeoutError):
    """The job's store went away while a rank waited at it for the others: its host (often
    rank 0) died, so the others cannot be told apart as alive or dead."""


class CheckpointException(CheckpointError):
    """A failure on one or more ranks during a collective phase, raised on every rank.

    ``failures`` maps rank → the exception (or its description) raised there.
    """

    def __init__(self, phase: str, failures: dict[int, BaseException | str]):
        self.phase = phase
        self.failures = failures
        super().__init__(f"checkpoint phase '{phase}' failed on rank(s) {format_ranks(failures)}:\n"
                         + self.describe())

    def _texts(self) -> dict[int, str]:
        return {rank: e if isinstance(e, str) else f"{type(e).__name__}: {e}" for rank, e in self.failures.items()}

    def describe(self) -> str:
        """What failed where, without the phase: :func:`describe_failures` of the failures."""
        return describe_failures(self._texts())

    def __reduce__(self):  # picklable across processes (the async writer ships errors back)
        failures = self._texts()
        state = {"remote_tracebacks": self.remote_tracebacks} if hasattr(self, "remote_tracebacks") else None
        cls = type(self)
        if getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls:
            return (cls, (self.phase, failures), state)
        # A class made on the fly to also be the remote error's class (``except KeyError``
        # keeps working) cannot be found by name: rebuild it from that original class.
        original = next((b for b in cls.__bases__ if b is not CheckpointException), None)
        return (_rebuild_checkpoint_exception, (original, self.phase, failures), state)


def remote_error_class(original: type) -> type[CheckpointException]:
    """A :class:`CheckpointException` class that is also ``original`` (the class of a
    failure on another rank), so ``except KeyError`` keeps working; raises ``TypeError``
    where the two cannot be combined (a layout conflict with a builtin base)."""
    return type(original.__name__, (CheckpointException, original),
                {"__module__": original.__module__, "__str__": CheckpointException.__str__})


def _rebuild_checkpoint_exception(original: type | None, phase: str, failures: dict) -> CheckpointException:
    return CheckpointException(phase, failures) if original is None else remote_error_class(original)(phase, failures)


def format_bytes(n: float) -> str:
    """A short human size in binary units: ``512 B``, ``1.50 KiB``, ``3.00 GiB``, up to ``PiB``."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024.0
        if n < 1024 or unit == "PiB":
            break
    return f"{n:.2f} {unit}"


def format_ranks(ranks: Iterable[int]) -> str:
    """``ranks`` sorted, runs of three or more as ``first-last``: ``0-511, 513-1023``
    instead of a thousand numbers (``1, 3`` and ``1, 2`` stay as they are)."""
    parts: list[str] = []
    for _, pairs in itertools.groupby(enumerate(sorted(set(ranks))), lambda pair: pair[1] - pair[0]):
        run = [rank for _, rank in pairs]
        parts.extend([f"{run[0]}-{run[-1]}"] if len(run) >= 3 else map(str, run))
    return ", ".join(parts)


def describe_failures(texts: dict[int, str], limit: int = 8) -> str:
    """One line per distinct failure text, ``[rank 3] text`` or ``[ranks 0-1023] text``
    for ranks that failed alike (a key missing on every rank of a large job is one
    line, not one per rank); past ``limit`` distinct texts, one line counts the rest."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(texts):
        by_text.setdefault(texts[rank], []).append(rank)
    lines = [f"[{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}] {text}"
             for text, ranks in list(by_text.items())[:limit]]
    rest = [r for ranks in list(by_text.values())[limit:] for r in ranks]
    if rest:
        lines.append(f"... and {len(by_text) - limit} other failure(s) on rank(s) {format_ranks(rest)}")
    return "\n".join(lines)
