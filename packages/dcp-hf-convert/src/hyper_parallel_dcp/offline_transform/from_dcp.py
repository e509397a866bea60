"""DCP → full state dict, and DCP → Hugging Face safetensors, streaming.

Reads go through the ordinary single-process load (``load_state_dict`` with a
``FileSystemReader``, ``no_dist=True``) into freshly allocated full tensors.  The
streaming export loads the tensors of the checkpoint in batches of about
``batch_bytes``, in the order the output files are written, and each batch uses a fresh
reader: the reader maps its source files, and dropping it at the end of a batch unmaps
them, so the touched pages of the source never pile up in memory.  Peak memory is about
one batch plus the largest tensor, whatever the size of the model or of an output shard.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Union

import torch

from hyper_parallel_dcp.core.flatten import flatten_state_dict
from hyper_parallel_dcp.core.layout import is_tensor_leaf
from hyper_parallel_dcp.core.metadata import Metadata, TensorStorageMetadata
from hyper_parallel_dcp.core.pipeline import load_state_dict
from hyper_parallel_dcp.storage_fs.filesystem import FileSystemReader, load_checkpoint_metadata

from .dtypes import cast_floating, output_dtype, parse_dtype
from .hf_writer import TensorSpec, write_huggingface_checkpoint
from .keymap import KeyMapping, map_keys
from .progress import ConversionReport

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DcpTensorSource",
    "convert_dcp_to_huggingface",
    "dcp_to_full_state_dict",
    "save_state_dict_as_huggingface_format",
]

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
#: Bytes of tensors one streaming load step brings into memory (a larger tensor is loaded alone).
DEFAULT_BATCH_BYTES = 256 * 1024 * 1024


class _KnownMetadataReader(FileSystemReader):
    """A ``FileSystemReader`` that reuses metadata already read, instead of parsing
    ``.metadata`` again for every batch."""

    def __init__(self, path: PathLike, metadata: Metadata) -> None:
        super().__init__(path)
        self._known = metadata

    def load_metadata(self) -> Metadata:
        self.metadata = self._known
        return self._known


def _load(path: PathLike, metadata: Metadata, fqns: Iterable[str]) -> dict[str, Any]:
    """Load ``fqns`` whole: tensors into new full CPU tensors, objects as restored."""
    target: dict[str, Any] = {}
    for fqn in fqns:
        md = metadata.state_dict_metadata[fqn]
        target[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    load_state_dict(target, _KnownMetadataReader(path, metadata), no_dist=True)
    return target


def dcp_to_full_state_dict(path: PathLike, *, key_mapping: KeyMapping = None) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path``, assembled into full tensors in memory.

    Returns a flat ``{fqn: tensor or object}`` dict in checkpoint order, renamed by
    ``key_mapping``.  Holds the whole model; to export without that, use
    :func:`convert_dcp_to_huggingface`.  Raises :class:`CheckpointNotFoundError` when
    ``path`` holds no checkpoint, and the load's errors for missing or corrupt files.
    """
    metadata, _ = load_checkpoint_metadata(path)
    names = map_keys(metadata.state_dict_metadata, key_mapping)
    loaded = _load(path, metadata, names)
    return {new: loaded[old] for old, new in names.items()}


class DcpTensorSource:
    """``source(fqn)`` → the full tensor, loaded in batches along ``order``.

    The first request for a tensor not yet in memory loads it together with the tensors
    after it in ``order``, up to ``batch_bytes``; each tensor is handed out once and then
    forgotten, so asking in ``order`` keeps at most one batch in memory.
    """

    def __init__(self, path: PathLike, metadata: Metadata, order: Iterable[str],
                 batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.path = path
        self.metadata = metadata
        self.order = list(order)
        self._position = {fqn: i for i, fqn in enumerate(self.order)}
        self.batch_bytes = batch_bytes
        self._ready: dict[str, torch.Tensor] = {}
        self.batches = 0

    def _nbytes(self, fqn: str) -> int:
        md = self.metadata.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        return md.size.numel() * md.properties.dtype.itemsize

    def __call__(self, fqn: str) -> torch.Tensor:
        tensor = self._ready.pop(fqn, None)
        if tensor is not None:
            return tensor
        start = self._position[fqn]
        batch, size = [], 0
        for name in self.order[start:]:
            nbytes = self._nbytes(name)
            if batch and size + nbytes > self.batch_bytes:
                break
            batch.append(name)
            size += nbytes
        self._ready = _load(self.path, self.metadata, batch)
        self.batches += 1
        return self._ready.pop(fqn)


def convert_dcp_to_huggingface(
    src: PathLike,
    dst: PathLike,
    max_shard_size: Union[int, str] = "5GB",
    *,
    dtype: Union[None, str, torch.dtype] = None,
    key_mapping: KeyMapping = None,
    progress: bool = False,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    sync_files: bool = True,
) -> ConversionReport:
    """Export the checkpoint at ``src`` as Hugging Face safetensors in ``dst``, streaming.

    Tensors keep the checkpoint's order and names (renamed by ``key_mapping``); floating
    tensors are cast to ``dtype`` when given (``"bf16"``, ``torch.float16``, ...);
    non-tensor entries are skipped (logged).  Files as :func:`write_huggingface_checkpoint`
    writes them (weights and index only, no config.json).  Memory holds about
    ``batch_bytes`` plus the largest tensor.  Raises :class:`CheckpointNotFoundError` when
    ``src`` holds no checkpoint, ``ValueError`` for a bad size or dtype.
    """
    cast = parse_dtype(dtype)
    metadata, _ = load_checkpoint_metadata(src)
    sd_md = metadata.state_dict_metadata
    tensors = [fqn for fqn, md in sd_md.items() if isinstance(md, TensorStorageMetadata)]
    skipped = len(sd_md) - len(tensors)
    if skipped:
        logger.warning("%s: %d non-tensor entries are not exported (safetensors holds tensors only)", src, skipped)
    names = map_keys(tensors, key_mapping)
    specs = []
    for fqn, name in names.items():
        md = sd_md[fqn]
        assert isinstance(md, TensorStorageMetadata)
        specs.append(TensorSpec(name, tuple(md.size), output_dtype(md.properties.dtype, cast)))
    source = DcpTensorSource(src, metadata, names, batch_bytes)
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
