"""Exceptions raised by hyper-parallel-dcp.

Every error is an ``Exception`` subclass whose message names the FQN, file or rank
concerned.  Several also derive from the built-in type a caller would naturally catch
(``FileNotFoundError``, ``KeyError``, ``ValueError``).
"""

from __future__ import annotations

import sys

__all__ = [
    "CheckpointError",
    "CheckpointException",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "ConcurrentSaveError",
    "CorruptCheckpointError",
    "MissingKeyError",
    "MismatchError",
    "MissingRegionError",
    "UnsafeObjectError",
    "UnsupportedPlacementError",
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


class CheckpointException(CheckpointError):
    """A failure on one or more ranks during a collective phase, raised on every rank.

    ``failures`` maps rank → the exception (or its description) raised there.
    """

    def __init__(self, phase: str, failures: dict[int, BaseException | str]):
        self.phase = phase
        self.failures = failures
        parts = []
        for rank in sorted(failures):
            err = failures[rank]
            text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
            parts.append(f"[rank {rank}] {text}")
        ranks = ", ".join(str(r) for r in sorted(failures))
        super().__init__(f"checkpoint phase '{phase}' failed on rank(s) {ranks}:\n" + "\n".join(parts))

    def __reduce__(self):  # picklable across processes (the async writer ships errors back)
        failures = {r: (e if isinstance(e, str) else f"{type(e).__name__}: {e}") for r, e in self.failures.items()}
        state = {"remote_tracebacks": self.remote_tracebacks} if hasattr(self, "remote_tracebacks") else None
        cls = type(self)
        if getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls:
            return (cls, (self.phase, failures), state)
        # A class made on the fly to also be the remote error's class (``except KeyError``
        # keeps working) cannot be found by name: rebuild it from that original class.
        original = next((b for b in cls.__bases__ if b is not CheckpointException), None)
        return (_rebuild_checkpoint_exception, (original, self.phase, failures), state)


def _rebuild_checkpoint_exception(original: type | None, phase: str, failures: dict) -> CheckpointException:
    if original is None:
        return CheckpointException(phase, failures)
    combined = type(original.__name__, (CheckpointException, original),
                    {"__module__": original.__module__, "__str__": CheckpointException.__str__})
    return combined(phase, failures)
