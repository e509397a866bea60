"""The errors and warnings of ``async_save``: :class:`AsyncSaveError`, :class:`AsyncSaveFailureWarning`."""

from __future__ import annotations

from hyper_parallel_dcp.core.errors import CheckpointError

__all__ = ["AsyncSaveError", "AsyncSaveFailureWarning"]


class AsyncSaveError(CheckpointError):
    """The writer failed without a more specific error (e.g. it was killed), or the save
    failed on another rank (the message names it; ``failed_ranks`` lists them)."""

    failed_ranks: tuple[int, ...] = ()


class AsyncSaveFailureWarning(RuntimeWarning):
    """An earlier ``async_save`` failed and nobody looked at its response (issued by the
    next ``async_save`` on that rank, which goes ahead)."""
