"""Reading Hugging Face safetensors checkpoints (a file, or a directory with an index and its
shards) one tensor at a time, with plain file reads (mapped pages would stay resident)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from hyper_parallel_dcp.core.errors import CheckpointFormatError, CheckpointNotFoundError, CorruptCheckpointError
from hyper_parallel_dcp.storage_fs.posix import pread_exact
from hyper_parallel_dcp.storage_fs.safetensors_stream import (
    SAFETENSORS_DTYPES,
    SafetensorsHeaderError,
    read_header,
    tensor_bytes,
)

from .keymap import KeyMapping, map_keys

__all__ = [
    "INDEX_FILE",
    "INDEX_SUFFIX",
    "SINGLE_FILE",
    "SafetensorsEntry",
    "parse_checkpoint_from_huggingface",
    "read_entry",
    "read_safetensors_header",
    "scan_huggingface_checkpoint",
]

INDEX_SUFFIX = ".safetensors.index.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = SINGLE_FILE.removesuffix(".safetensors") + INDEX_SUFFIX
_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class SafetensorsEntry:
    """Where one tensor lives: file, dtype, shape and its byte range in the file."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_safetensors_header(file: Union[str, os.PathLike]) -> list[SafetensorsEntry]:
    """The tensors of one safetensors file in file order; raises ``CheckpointNotFoundError``,
    ``CorruptCheckpointError`` (a malformed header), ``CheckpointFormatError`` (an unknown dtype)."""
    path = Path(file)
    try:
        with open(path, "rb") as f:
            header = read_header(f, os.fstat(f.fileno()).st_size)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"safetensors file {path} is missing") from None
    except SafetensorsHeaderError as exc:
        raise CorruptCheckpointError(f"{path} is not a valid safetensors file: {exc}") from None
    entries = []
    for name, entry in header.items():
        dtype = _DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has dtype {entry.dtype}, "
                                        "which this tool cannot convert")
        entries.append(SafetensorsEntry(name, path, dtype, entry.shape, entry.begin, entry.end - entry.begin))
    entries.sort(key=lambda e: e.start)
    return entries


def _find_index(root: Path) -> Union[Path, None]:
    preferred = root / INDEX_FILE
    if preferred.is_file():
        return preferred
    found = sorted(p for p in root.iterdir() if p.name.endswith(INDEX_SUFFIX) and p.is_file())
    if len(found) > 1:
        raise CheckpointFormatError(
            f"{root} holds several safetensors indexes ({', '.join(p.name for p in found)}); pass the one to use"
        )
    return found[0] if found else None


def _scan_index(index: Path) -> dict[str, SafetensorsEntry]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"{index} is not valid JSON ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFormatError(f"{index} has no \"weight_map\" object naming the shard of each tensor")
    root = index.parent
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    out: dict[str, SafetensorsEntry] = {}
    # shards in file-name order, tensors in file order: the model's save order (the index is sorted)
    for shard in sorted(shards):
        file = root / shard
        if not file.is_file():
            raise CheckpointNotFoundError(
                f"shard file {file} is missing: {index.name} maps {len(shards[shard])} tensors to it "
                f"(e.g. {shards[shard][0]!r})"
            )
        entries = {e.name: e for e in read_safetensors_header(file)}
        for name in shards[shard]:
            if name not in entries:
                raise CheckpointFormatError(f"{index.name} maps tensor {name!r} to {shard}, "
                                            f"but {file} does not hold it")
        for name, entry in entries.items():
            mapped = weight_map.get(name)
            if mapped != shard:
                where = f"maps it to {mapped}" if mapped is not None else "has no entry for it"
                raise CheckpointFormatError(f"{file} holds tensor {name!r} but {index.name} {where}")
            out[name] = entry
    return {name: out[name] for name in sorted(out, key=lambda n: (out[n].file.name, out[n].start))}


def scan_huggingface_checkpoint(path: Union[str, os.PathLike]) -> dict[str, SafetensorsEntry]:
    """Every tensor of a Hugging Face safetensors checkpoint (headers only, no data read).

    ``path``: a ``.safetensors`` or ``*.safetensors.index.json`` file, or a directory with
    an index or one ``.safetensors`` file.  Raises :class:`CheckpointNotFoundError`, and
    :class:`CheckpointFormatError` when the index and the shards disagree.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointNotFoundError(f"Hugging Face checkpoint {root} does not exist")
    if root.is_file():
        if root.name.endswith(INDEX_SUFFIX):
            return _scan_index(root)
        return {e.name: e for e in read_safetensors_header(root)}
    index = _find_index(root)
    if index is not None:
        return _scan_index(index)
    if (root / ".metadata").exists() or any(root.glob("*.metadata")):
        raise CheckpointNotFoundError(
            f"{root} is a hyper-parallel-dcp checkpoint, not a Hugging Face one: convert it with dcp-to-hf"
        )
    single = root / SINGLE_FILE
    files = [single] if single.is_file() else sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if len(files) == 1:
        return {e.name: e for e in read_safetensors_header(files[0])}
    if files:
        raise CheckpointFormatError(
            f"{root} holds {len(files)} safetensors files but no *{INDEX_SUFFIX} saying which tensor is where"
        )
    listing = ", ".join(sorted(p.name for p in root.iterdir())[:8]) or "nothing"
    raise CheckpointNotFoundError(
        f"{root} is not a Hugging Face checkpoint: no {SINGLE_FILE}, no *{INDEX_SUFFIX} and no .safetensors file "
        f"(it holds {listing})"
    )


def read_entry(entry: SafetensorsEntry, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensor ``entry`` describes, read with plain file reads into ``out`` (a contiguous
    CPU tensor of its shape and dtype) or a new tensor.  Raises :class:`CorruptCheckpointError`
    when the file ends early, ``ValueError`` when ``out`` does not fit."""
    tensor = torch.empty(entry.shape, dtype=entry.dtype) if out is None else out
    if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype or not tensor.is_contiguous() or (
            tensor.device.type != "cpu"):
        raise ValueError(f"{entry.name!r}: cannot read {entry.dtype} {list(entry.shape)} "
                         f"into {tensor.dtype} {list(tensor.shape)}")
    with open(entry.file, "rb", buffering=0) as f:
        try:
            pread_exact(f.fileno(), tensor_bytes(tensor), entry.start, str(entry.file))
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"tensor {entry.name!r}: {exc}") from None
    return tensor


def parse_checkpoint_from_huggingface(path: Union[str, os.PathLike], *,
                                      key_mapping: KeyMapping = None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint at ``path``, ``{name: tensor}`` in file order, renamed or
    dropped by ``key_mapping``; raises as :func:`scan_huggingface_checkpoint` and :func:`read_entry`."""
    entries = scan_huggingface_checkpoint(path)
    return {new: read_entry(entries[old]) for old, new in map_keys(entries, key_mapping).items()}
