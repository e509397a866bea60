"""The names of a checkpoint's files and of the save machinery's files beside it (the
staging directory, the replaced checkpoint, the lock, the files ``async_save(use_gloo=False)``
exchanges: here, as the commit must know them and storage-fs cannot import ``dcp-async``),
for every backend (``docs/format.md``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["CHECKPOINT_FILE", "DONE_SUFFIX", "MAILBOX_FILE", "METADATA_FILE", "RANK_METADATA", "TMP_SUFFIX",
           "ack_file", "compressed_file_name", "gather_file", "is_checkpoint_artifact", "lock_path",
           "objects_file_name", "rank_metadata_file", "result_file", "scatter_file", "staging_dir", "stale_metadata",
           "stale_prefixes", "tensors_file_name"]

METADATA_FILE = ".metadata"
RANK_METADATA = re.compile(r"^(\d+)\.metadata$")  # group 1 is the rank
#: the files a checkpoint consists of (what a new save into its location replaces)
CHECKPOINT_FILE = re.compile(r"^(\.metadata|\d+\.metadata|_rank\d+_\.(safetensors|bytes|zstd))$")
TMP_SUFFIX = ".hp-dcp-tmp"  # a file written under its temporary name (``atomic``)
#: Marker written after a mailbox file; it carries the save's tag.
DONE_SUFFIX = ".done"
#: A regular expression (alternatives, unanchored) matching every mailbox file name.
MAILBOX_FILE = r"(LOCAL_PLAN|STORAGE_DATA)_\d+\.pkl(\.done)?|\.hp-dcp-.*"

_ARTIFACT = re.compile(rf"^(\.metadata|\d+\.metadata|_rank\d+_\.(safetensors|bytes|zstd)|.*{re.escape(TMP_SUFFIX)}|"
                       rf"{MAILBOX_FILE})$")


def tensors_file_name(rank: int) -> str:
    return f"_rank{rank}_.safetensors"


def compressed_file_name(rank: int) -> str:
    """Rank ``rank``'s file of compressed tensor chunks (``compression``)."""
    return f"_rank{rank}_.zstd"


def objects_file_name(rank: int) -> str:
    return f"_rank{rank}_.bytes"


def rank_metadata_file(rank: int) -> str:
    return f"{rank}.metadata"


def stale_metadata(names: Callable[[], Iterable[str]], rank: int, world_size: int) -> list[str]:
    """What ``rank`` of a save without collectives on ``world_size`` ranks removes first (the
    location no longer holds that checkpoint): ``.metadata``, its ``{rank}.metadata`` and, on
    rank 0, those among ``names()`` of ranks the save does not have (a load would merge them)."""
    stale = [METADATA_FILE, rank_metadata_file(rank)]
    if rank == 0:
        stale += [n for n in names() if (m := RANK_METADATA.match(n)) and int(m.group(1)) >= world_size]
    return stale


def is_checkpoint_artifact(name: str) -> bool:
    """Whether ``name`` belongs to a checkpoint (data, metadata, temp and mailbox files)."""
    return bool(_ARTIFACT.match(name))


def staging_dir(target: Path, save_id: str) -> Path:
    """Where save ``save_id`` writes before it is swapped in at ``target``."""
    return target.parent / f".{target.name}.hp-dcp-staging-{save_id}"


def stale_prefixes(target: Path) -> tuple[str, str]:
    """Name prefixes of the staging and replaced-checkpoint directories beside ``target``."""
    return f".{target.name}.hp-dcp-staging-", f".{target.name}.hp-dcp-old-"


def lock_path(target: Path) -> Path:
    """The save lock file of ``target`` (``.<name>.hp-dcp-lock`` beside it)."""
    return target.parent / f".{target.name}.hp-dcp-lock"


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
