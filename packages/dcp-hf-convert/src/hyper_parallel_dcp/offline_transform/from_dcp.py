"""DCP → full state dict, and DCP → Hugging Face safetensors, streaming.

Reads go through the ordinary single-process load (``load_state_dict`` with a
``FileSystemReader``, ``no_dist=True``) into freshly allocated full tensors.  The
streaming export assembles one tensor at a time, just before the safetensors writer
writes it, and drops it after: memory holds about the largest tensor, whatever the size
of the model or of an output shard.  One reader serves every tensor, so each source
file's header is parsed once; it fills the destination with ``preadv`` (no mapping whose
touched pages would stay resident).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch

from hyper_parallel_dcp.core.backends import storage_reader_for
from hyper_parallel_dcp.core.flatten import flatten_state_dict
from hyper_parallel_dcp.core.layout import is_tensor_leaf
from hyper_parallel_dcp.core.metadata import Metadata, TensorStorageMetadata
from hyper_parallel_dcp.core.pipeline import load_state_dict
from hyper_parallel_dcp.core.storage import StorageReader

from .dtypes import cast_floating, output_dtype, parse_dtype
from .hf_writer import TensorSpec, write_huggingface_checkpoint
from .keymap import KeyMapping, map_keys, resolve_key_mapping
from .progress import ConversionReport
from .staging import StagingBuffer

__all__ = [
    "DcpTensorSource",
    "convert_dcp_to_huggingface",
    "dcp_to_full_state_dict",
    "save_state_dict_as_huggingface_format",
]

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]


def _known_metadata_reader(path: PathLike, metadata: Metadata) -> StorageReader:
    """The storage backend's reader for ``path`` (a directory or an ``s3://`` URL), reusing
    metadata already read instead of fetching ``.metadata`` again for every batch."""
    reader = storage_reader_for(path, None)
    reader.use_metadata(metadata)
    return reader


def checkpoint_metadata(path: PathLike) -> Metadata:
    """The metadata of the checkpoint at ``path`` (any backend; rank-local ones merged)."""
    return storage_reader_for(path, None).load_metadata()


def _load(reader: StorageReader, metadata: Metadata, fqns: Iterable[str],
          into: Optional[StagingBuffer] = None) -> dict[str, Any]:
    """Load ``fqns`` whole: tensors into new full CPU tensors (or, for one tensor, into a
    view of ``into``), objects as restored."""
    target: dict[str, Any] = {}
    for fqn in fqns:
        md = metadata.state_dict_metadata[fqn]
        if not isinstance(md, TensorStorageMetadata):
            target[fqn] = None
        elif into is not None:
            target[fqn] = into.view(tuple(md.size), md.properties.dtype)
        else:
            target[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    load_state_dict(target, reader, no_dist=True)
    return target


def dcp_to_full_state_dict(path: PathLike, *, key_mapping: KeyMapping = None) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path``, assembled into full tensors in memory.

    Returns a flat ``{fqn: tensor or object}`` dict in checkpoint order, renamed by
    ``key_mapping``.  Holds the whole model; to export without that, use
    :func:`convert_dcp_to_huggingface`.  Raises :class:`CheckpointNotFoundError` when
    ``path`` holds no checkpoint, and the load's errors for missing or corrupt files.
    """
    metadata = checkpoint_metadata(path)
    names = map_keys(metadata.state_dict_metadata, key_mapping)
    loaded = _load(_known_metadata_reader(path, metadata), metadata, names)
    return {new: loaded[old] for old, new in names.items()}


class DcpTensorSource:
    """``source(fqn)`` → that tensor of the checkpoint, assembled whole from its chunks.

    Each call is one small single-process load (about 0.2 ms of planning per tensor,
    measured with 2000 tensors) into one reused buffer sized for the largest tensor: the
    result is valid until the next call, which is what a writer that writes each tensor
    before asking for the next needs.  One reader serves every call, so each source
    file's header is parsed once.
    """

    def __init__(self, path: PathLike, metadata: Metadata, fqns: Iterable[str]) -> None:
        self.metadata = metadata
        self._reader = _known_metadata_reader(path, metadata)
        sizes = [md.size.numel() * md.properties.dtype.itemsize for fqn in fqns
                 if isinstance(md := metadata.state_dict_metadata[fqn], TensorStorageMetadata)]
        self._buffer = StagingBuffer(max(sizes, default=0))

    def __call__(self, fqn: str) -> torch.Tensor:
        return _load(self._reader, self.metadata, [fqn], self._buffer)[fqn]


def convert_dcp_to_huggingface(
    src: PathLike,
    dst: PathLike,
    max_shard_size: Union[int, str] = "5GB",
    *,
    dtype: Union[None, str, torch.dtype] = None,
    key_mapping: KeyMapping = None,
    progress: bool = False,
    sync_files: bool = True,
) -> ConversionReport:
    """Export the checkpoint at ``src`` as Hugging Face safetensors in ``dst``, streaming.

    Tensors keep the checkpoint's order and names (renamed by ``key_mapping``); floating
    tensors are cast to ``dtype`` when given (``"bf16"``, ``torch.float16``, ...);
    non-tensor entries are skipped (logged).  Files as :func:`write_huggingface_checkpoint`
    writes them (weights and index only, no config.json).  Memory holds about the
    largest tensor (twice, when it is cast).  Raises :class:`CheckpointNotFoundError` when
    ``src`` holds no checkpoint, ``ValueError`` for a bad size or dtype.
    """
    cast = parse_dtype(dtype)
    metadata = checkpoint_metadata(src)
    sd_md = metadata.state_dict_metadata
    tensors = [fqn for fqn, md in sd_md.items() if isinstance(md, TensorStorageMetadata)]
    names = map_keys(tensors, key_mapping)
    # only the entries the mapping keeps: `--only model.` leaves optimizer objects out anyway
    keep = resolve_key_mapping(key_mapping)
    skipped = [fqn for fqn, md in sd_md.items() if not isinstance(md, TensorStorageMetadata) and keep(fqn) is not None]
    if skipped:
        logger.warning("%s: %d non-tensor entr%s not exported (safetensors holds tensors only): %s%s", src,
                       len(skipped), "y is" if len(skipped) == 1 else "ies are", ", ".join(map(repr, skipped[:5])),
                       ", ..." if len(skipped) > 5 else "")
    specs = []
    for fqn, name in names.items():
        md = sd_md[fqn]
        assert isinstance(md, TensorStorageMetadata)
        specs.append(TensorSpec(name, tuple(md.size), output_dtype(md.properties.dtype, cast)))
    source = DcpTensorSource(src, metadata, names)
    fqn_of = {name: fqn for fqn, name in names.items()}
    report = ConversionReport(str(src), str(dst))
    write_huggingface_checkpoint(dst, specs, lambda name: cast_floating(source(fqn_of[name]), cast), max_shard_size,
                                 report=report, progress=progress, sync_files=sync_files)
    return report


def save_state_dict_as_huggingface_format(
    dst: PathLike,
    state_dict: Union[Mapping[str, Any], PathLike],
    max_shard_size: Union[int, str] = "5GB",
    *,
    dtype: Union[None, str, torch.dtype] = None,
    key_mapping: KeyMapping = None,
    progress: bool = False,
    sync_files: bool = True,
) -> ConversionReport:
    """Write ``state_dict`` as a Hugging Face safetensors checkpoint in ``dst``.

    ``state_dict`` is a (possibly nested) dict of tensors — nested keys become dotted
    names, non-tensor leaves are skipped — or the path of a checkpoint directory, which is
    then exported streaming (:func:`convert_dcp_to_huggingface`).  DTensors are gathered
    with ``full_tensor()``.  Sharding and file names follow ``save_pretrained``
    (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``); ``max_shard_size`` is bytes or a string like
    ``"5GB"``/``"500MB"``/``"2GiB"``.  ``state_dict`` is not modified.  Raises
    ``ValueError`` for a bad size or dtype or for two keys that map to one name.
    """
    if isinstance(state_dict, (str, os.PathLike)):
        return convert_dcp_to_huggingface(state_dict, dst, max_shard_size, dtype=dtype, key_mapping=key_mapping,
                                          progress=progress, sync_files=sync_files)
    cast = parse_dtype(dtype)
    flat, _ = flatten_state_dict(state_dict, is_tensor_leaf)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    if len(tensors) != len(flat):
        logger.warning("%d non-tensor entries are not exported (safetensors holds tensors only)", len(flat) - len(tensors))
    names = map_keys(tensors, key_mapping)
    specs = [TensorSpec(new, tuple(tensors[old].shape), output_dtype(tensors[old].dtype, cast)) for old, new in names.items()]
    fqn_of = {new: old for old, new in names.items()}

    def fetch(name: str) -> torch.Tensor:
        tensor = tensors[fqn_of[name]]
        if hasattr(tensor, "full_tensor"):  # a DTensor: this process needs the whole of it
            tensor = tensor.full_tensor()
        return cast_floating(tensor.detach().cpu(), cast)

    report = ConversionReport("<state_dict>", str(Path(dst)))
    return write_huggingface_checkpoint(dst, specs, fetch, max_shard_size, report=report, progress=progress,
                                        sync_files=sync_files)
