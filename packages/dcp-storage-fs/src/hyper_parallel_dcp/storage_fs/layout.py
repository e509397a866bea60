"""The names of a checkpoint's files and of the save machinery's files beside it (the
staging directory, the replaced checkpoint, the lock), for every backend (``docs/format.md``)."""

from __future__ import annotations

import re
from pathlib import Path

from .mailbox_names import MAILBOX_FILE

__all__ = ["CHECKPOINT_FILE", "METADATA_FILE", "RANK_METADATA", "TMP_SUFFIX", "compressed_file_name",
           "is_checkpoint_artifact", "lock_path",
           "objects_file_name", "rank_metadata_file", "staging_dir", "stale_prefixes", "tensors_file_name"]

METADATA_FILE = ".metadata"
RANK_METADATA = re.compile(r"^(\d+)\.metadata$")  # group 1 is the rank
#: the files a checkpoint consists of (what a new save into its location replaces)
CHECKPOINT_FILE = re.compile(r"^(\.metadata|\d+\.metadata|_rank\d+_\.(safetensors|bytes|zstd))$")
TMP_SUFFIX = ".hp-dcp-tmp"  # a file written under its temporary name (``atomic``)

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
