"""DCP → full state dict, and DCP → Hugging Face safetensors, one whole tensor at a time."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.flatten import flatten_state_dict
from hyper_parallel_dcp.core.layout import is_tensor_leaf
from hyper_parallel_dcp.core.metadata import TensorStorageMetadata

from .blocks import CheckpointBlocks, StagingBuffer
from .hf_writer import TensorSpec, write_huggingface_checkpoint
from .keymap import KeyMapping, map_keys, only_prefixes, resolve_key_mapping, strip_prefixes
from .options import cast_floating, output_dtype, parse_dtype
from .progress import ConversionReport

__all__ = ["MODEL_PREFIX", "convert_dcp_to_huggingface", "dcp_to_full_state_dict", "is_trainer_checkpoint",
           "save_state_dict_as_huggingface_format"]

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
#: The subtree of a trainer checkpoint that holds the model (``{"model": model.state_dict(), ...}``).
MODEL_PREFIX = "model."


def dcp_to_full_state_dict(path: PathLike, *, key_mapping: KeyMapping = None) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path`` as a flat ``{fqn: full tensor or object}``
    in checkpoint order, renamed by ``key_mapping`` (the whole model in memory).  Raises
    :class:`CheckpointNotFoundError` for no checkpoint, and the load's errors."""
    source = CheckpointBlocks(path)
    sd_md = source.metadata.state_dict_metadata
    names = map_keys(sd_md, key_mapping)
    targets = {fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata)
               else None for fqn, md in ((fqn, sd_md[fqn]) for fqn in names)}
    objects = source.read(targets)
    return {new: objects[old] if targets[old] is None else targets[old] for old, new in names.items()}


def is_trainer_checkpoint(sd_md: Mapping[str, Any]) -> bool:
    """Whether ``sd_md`` (FQN → stored metadata) is a trainer's checkpoint: a
    :data:`MODEL_PREFIX` subtree of tensors beside non-tensor state (optimizer, step, ...)."""
    has_model = any(fqn.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata) for fqn, md in sd_md.items())
    return has_model and any(not fqn.startswith(MODEL_PREFIX) and not isinstance(md, TensorStorageMetadata)
                             for fqn, md in sd_md.items())


def _model_weights(src: PathLike, sd_md: Mapping[str, Any], key_mapping: KeyMapping, said: bool) -> KeyMapping:
    """The mapping that keeps the :data:`MODEL_PREFIX` subtree, stripped, then ``key_mapping``."""
    inside = sum(1 for fqn, md in sd_md.items() if fqn.startswith(MODEL_PREFIX)
                 and isinstance(md, TensorStorageMetadata))
    if not inside:
        raise ValueError(f"{src} holds no tensor under {MODEL_PREFIX!r}: nothing to export as the model's weights")
    if said:
        logger.warning("%s is a trainer checkpoint: exporting the model's weights, the %d tensors under %r with "
                       "the prefix stripped, and leaving out its %d other entries (optimizer state, step, ...); "
                       "--all (model_only=False) exports everything", src, inside, MODEL_PREFIX,
                       sum(1 for fqn in sd_md if not fqn.startswith(MODEL_PREFIX)))
    strip, rest = strip_prefixes(MODEL_PREFIX), resolve_key_mapping(key_mapping)
    return only_prefixes([MODEL_PREFIX], lambda key: rest(strip(key)))


def convert_dcp_to_huggingface(src: PathLike, dst: PathLike, max_shard_size: Union[int, str] = "5GB", *,
                               dtype: Union[None, str, torch.dtype] = None, key_mapping: KeyMapping = None,
                               model_only: Optional[bool] = False, progress: bool = False,
                               sync_files: bool = True) -> ConversionReport:
    """Export the checkpoint at ``src`` as Hugging Face safetensors in ``dst``, streaming.

    Floating tensors cast to ``dtype`` when given; non-tensor entries skipped.
    ``model_only=True`` exports the ``model.`` tensors, prefix stripped; ``None`` does so
    for a trainer checkpoint; ``False`` exports all.  Raises :class:`CheckpointNotFoundError`,
    ``ValueError`` for a bad size or dtype or ``model_only=True`` without a ``model.`` tensor.
    """
    cast = parse_dtype(dtype)
    source = CheckpointBlocks(src)
    sd_md = source.metadata.state_dict_metadata
    if model_only or (model_only is None and is_trainer_checkpoint(sd_md)):
        key_mapping = _model_weights(src, sd_md, key_mapping, said=model_only is None)
    tensors = {fqn: md for fqn, md in sd_md.items() if isinstance(md, TensorStorageMetadata)}
    names = map_keys(tensors, key_mapping)
    keep = resolve_key_mapping(key_mapping)  # `--only model.` leaves the optimizer's objects out anyway
    skipped = [fqn for fqn in sd_md if fqn not in tensors and keep(fqn) is not None]
    if skipped:
        logger.warning("%s: %d non-tensor entr%s not exported (safetensors holds tensors only): %s%s", src,
                       len(skipped), "y is" if len(skipped) == 1 else "ies are", ", ".join(map(repr, skipped[:5])),
                       ", ..." if len(skipped) > 5 else "")
    specs = [TensorSpec(name, tuple(tensors[fqn].size), output_dtype(tensors[fqn].properties.dtype, cast))
             for fqn, name in names.items()]
    fqn_of = {name: fqn for fqn, name in names.items()}
    # each tensor is written before the next is asked for: one buffer holds them in turn
    buffer = StagingBuffer(max((tensors[fqn].size.numel() * tensors[fqn].properties.dtype.itemsize
                                for fqn in names), default=0))

    def fetch(name: str) -> torch.Tensor:
        md = tensors[fqn_of[name]]
        box = ChunkBox((0,) * len(md.size), tuple(md.size))
        return cast_floating(source.read_block(fqn_of[name], box, buffer.view(box.sizes, md.properties.dtype)), cast)

    report = ConversionReport(str(src), str(dst))
    return write_huggingface_checkpoint(dst, specs, fetch, max_shard_size, report=report, progress=progress,
                                        sync_files=sync_files)


def save_state_dict_as_huggingface_format(dst: PathLike, state_dict: Union[Mapping[str, Any], PathLike],
                                          max_shard_size: Union[int, str] = "5GB", *,
                                          dtype: Union[None, str, torch.dtype] = None, key_mapping: KeyMapping = None,
                                          progress: bool = False, sync_files: bool = True) -> ConversionReport:
    """Write ``state_dict`` (a nested dict of tensors, DTensors gathered, or a checkpoint's
    path) as Hugging Face safetensors in ``dst``; ``max_shard_size`` bytes or ``"5GB"``.
    Raises ``ValueError`` for a bad size or dtype or for two keys that map to one name.
    """
    if isinstance(state_dict, (str, os.PathLike)):
        return convert_dcp_to_huggingface(state_dict, dst, max_shard_size, dtype=dtype, key_mapping=key_mapping,
                                          progress=progress, sync_files=sync_files)
    cast = parse_dtype(dtype)
    flat, _ = flatten_state_dict(state_dict, is_tensor_leaf)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    if len(tensors) != len(flat):
        logger.warning("%d non-tensor entries are not exported (safetensors holds tensors only)",
                       len(flat) - len(tensors))
    names = map_keys(tensors, key_mapping)
    specs = [TensorSpec(new, tuple(tensors[old].shape), output_dtype(tensors[old].dtype, cast))
             for old, new in names.items()]
    fqn_of = {new: old for old, new in names.items()}

    def fetch(name: str) -> torch.Tensor:
        tensor = tensors[fqn_of[name]]
        if hasattr(tensor, "full_tensor"):  # a DTensor: this process needs the whole of it
            tensor = tensor.full_tensor()
        return cast_floating(tensor.detach().cpu(), cast)

    return write_huggingface_checkpoint(dst, specs, fetch, max_shard_size, progress=progress, sync_files=sync_files,
                                        report=ConversionReport("<state_dict>", str(Path(dst))))
