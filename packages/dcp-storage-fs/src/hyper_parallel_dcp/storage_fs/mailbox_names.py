"""Names of the files ``async_save(use_gloo=False)`` exchanges in a checkpoint directory:
here, so that the commit knows them as artifacts (storage-fs cannot import ``dcp-async``)."""

from __future__ import annotations

__all__ = ["DONE_SUFFIX", "MAILBOX_FILE", "ack_file", "gather_file", "result_file", "scatter_file"]

#: Marker written after a mailbox file; it carries the save's tag.
DONE_SUFFIX = ".done"

#: A regular expression (alternatives, unanchored) matching every mailbox file name.
MAILBOX_FILE = r"(LOCAL_PLAN|STORAGE_DATA)_\d+\.pkl(\.done)?|\.hp-dcp-.*"


def gather_file(step: str, rank: int) -> str:
    """What ``rank`` posts in a gathering ``step`` (plans and write results keep DCP's names)."""
    if step == "plan":
        return f"LOCAL_PLAN_{rank}.pkl"
    if step == "write":
        return f"STORAGE_DATA_{rank}.pkl"
    return f".hp-dcp-mailbox-{step}-{rank}.pkl"


def scatter_file(step: str, rank: int) -> str:
    """The coordinator's answer to ``rank`` in a scattering ``step``."""
    return f".hp-dcp-mailbox-{step}-to-{rank}.pkl"


def result_file(step: str) -> str:
    """The coordinator's answer to everybody in a broadcasting ``step``."""
    return f".hp-dcp-mailbox-{step}-result.pkl"


def ack_file(rank: int) -> str:
    """``rank`` read the last answer (the coordinator then removes the save's files)."""
    return f".hp-dcp-mailbox-ack-{rank}.pkl"

