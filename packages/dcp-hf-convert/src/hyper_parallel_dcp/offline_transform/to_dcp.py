"""Full checkpoints (Hugging Face safetensors, ``torch.save`` files, in-memory dicts) → DCP,
through the single-process save; a file source is read one tensor at a time as written (a
``torch.save`` file mapped, each tensor's pages handed back once written; an old non-zip
file loaded whole)."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch

from hyper_parallel_dcp.core.backends import storage_writer_for
from hyper_parallel_dcp.core.errors import CheckpointFormatError, CheckpointNotFoundError
from hyper_parallel_dcp.core.flatten import flatten_state_dict
from hyper_parallel_dcp.core.layout import is_tensor_leaf
from hyper_parallel_dcp.core.pipeline import save_state_dict
from hyper_parallel_dcp.core.planner import WriteItem, WriteItemType
from hyper_parallel_dcp.core.standard_planner import StandardSavePlanner
from hyper_parallel_dcp.storage_fs.posix import dont_need

from .blocks import StagingBuffer
from .hf_source import read_entry, scan_huggingface_checkpoint
from .keymap import KeyMapping, map_keys
from .progress import ConversionReport, progress_bar

__all__ = ["StreamingSavePlanner", "convert_full_checkpoint_to_dcp", "full_state_dict_to_dcp_format",
           "load_torch_checkpoint", "save_streaming"]

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]


def load_torch_checkpoint(path: PathLike) -> tuple[Any, bool]:
    """``(loaded object, mapped)`` for a ``torch.save`` file, ``mapped`` when its tensors view
    a file mapping (zip format).  Never runs code from the file (``weights_only=True``).
    Raises :class:`CheckpointNotFoundError` for a missing file, :class:`CheckpointFormatError`
    for one torch cannot read (or naming a class that is not allow-listed)."""
    file = Path(path)
    if not file.is_file():
        raise CheckpointNotFoundError(f"PyTorch checkpoint file {file} does not exist "
                                      "(src_platform='torch' wants a file)")
    for mapped in (True, False):
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mapped), mapped
        except Exception as exc:  # pickle errors, UnpicklingError for disallowed globals, ...
            if not (mapped and isinstance(exc, RuntimeError) and ("mmap" in str(exc) or "zip" in str(exc))):
                raise CheckpointFormatError(f"cannot load PyTorch checkpoint {file}: {exc}") from None
        logger.info("%s is in the legacy (non-zip) format; loading it whole", file)
    raise AssertionError("unreachable")


def _release_pages(tensor: torch.Tensor) -> None:
    """Drop the resident pages of a tensor viewing a *file mapping* (``MADV_DONTNEED``: a later
    access reads the file again); on ordinary memory it would zero data."""
    storage = tensor.untyped_storage()
    # Outward to whole pages: the mapping spans the whole file, so the neighbouring
    # bytes are file pages too (clean, re-readable), never someone else's memory.
    if storage.nbytes() and not dont_need(storage.data_ptr(), storage.nbytes()):
        logger.debug("madvise(DONTNEED) failed with errno %d; pages stay resident", ctypes.get_errno())


class StreamingSavePlanner(StandardSavePlanner):
    """A save planner whose tensor data is ``fetch(write_item)`` at write time (the planned
    state dict may hold meta tensors), its shape checked against the plan; without
    ``fetch``, the state dict's own.  ``on_tensor(nbytes)`` is called for each tensor."""

    def __init__(self, fetch: Optional[Callable[[WriteItem], torch.Tensor]] = None,
                 on_tensor: Optional[Callable[[int], None]] = None) -> None:
        super().__init__(enable_plan_caching=False, remove_redundancy=False)
        self._fetch = fetch
        self._on_tensor = on_tensor

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type is not WriteItemType.TENSOR or self._fetch is None:
            data = super().resolve_data(write_item)
        else:
            fqn = write_item.index.fqn
            data = self._fetch(write_item)
            if write_item.sizes is not None and tuple(data.shape) != write_item.sizes:
                raise ValueError(f"{fqn!r}: the source gave shape {list(data.shape)}, planned {list(write_item.sizes)}")
        if write_item.type is WriteItemType.TENSOR and self._on_tensor is not None:
            self._on_tensor(write_item.nbytes)
        return data


def save_streaming(plan_sd: dict[str, Any], src: Any, dst: PathLike,
                   fetch: Optional[Callable[[WriteItem], torch.Tensor]], progress: bool, desc: str,
                   total: Optional[int] = None) -> ConversionReport:
    """Save ``plan_sd`` (meta tensors served by ``fetch``) at ``dst`` in one process, with a
    progress bar over ``total`` bytes (default: the tensors'); returns the report."""
    report = ConversionReport(str(src), str(dst))
    if total is None:
        total = sum(t.numel() * t.element_size() for t in plan_sd.values() if isinstance(t, torch.Tensor))
    report.objects = sum(1 for t in plan_sd.values() if not is_tensor_leaf(t))
    report.tensors = len(plan_sd) - report.objects
    with progress_bar(report, total, desc, progress) as advance:
        planner = StreamingSavePlanner(fetch, advance)
        metadata = save_state_dict(plan_sd, storage_writer_for(dst, None), planner, no_dist=True)
    report.files = sorted(metadata.files) + [".metadata"]
    logger.info("converted %s -> %s: %s", report.source, report.destination, report.summary())
    return report


def full_state_dict_to_dcp_format(state_dict: Mapping[str, Any], dst: PathLike, *,
                                  key_mapping: KeyMapping = None, progress: bool = False) -> ConversionReport:
    """Save a full in-memory state dict (not modified) as a checkpoint at ``dst``, replacing one there
    atomically, keys dotted and renamed by ``key_mapping``; raises what the save raises."""
    flat, _ = flatten_state_dict(state_dict, is_tensor_leaf)
    names = map_keys(flat, key_mapping)
    plan_sd = {new: flat[old] for old, new in names.items()}
    return save_streaming(plan_sd, "<state_dict>", dst, None, progress, "state_dict -> DCP")


def _from_safetensors(src: PathLike, dst: PathLike, key_mapping: KeyMapping, progress: bool) -> ConversionReport:
    entries = scan_huggingface_checkpoint(src)
    names = map_keys(entries, key_mapping)
    source_of = {new: old for old, new in names.items()}
    plan_sd = {new: torch.empty(entries[old].shape, dtype=entries[old].dtype, device="meta")
               for old, new in names.items()}
    # The writer writes each tensor before it asks for the next: one buffer serves all.
    buffer = StagingBuffer(max((e.nbytes for e in entries.values()), default=0))

    def fetch(item: WriteItem) -> torch.Tensor:
        entry = entries[source_of[item.index.fqn]]
        return read_entry(entry, out=buffer.view(entry.shape, entry.dtype))

    return save_streaming(plan_sd, src, dst, fetch, progress, "HF -> DCP")


def _from_torch_file(src: PathLike, dst: PathLike, key_mapping: KeyMapping, progress: bool) -> ConversionReport:
    loaded, mapped = load_torch_checkpoint(src)
    if not isinstance(loaded, Mapping):
        raise TypeError(f"{src} holds a {type(loaded).__name__}, not a state dict")
    flat, _ = flatten_state_dict(loaded, is_tensor_leaf)
    names = map_keys(flat, key_mapping)
    source = {new: flat[old] for old, new in names.items()}
    plan_sd = {new: (torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v)
               for new, v in source.items()}
    previous: list[torch.Tensor] = []

    def fetch(item: WriteItem) -> torch.Tensor:
        # asked for only once the previous tensor is written: its pages can go now
        if mapped and previous:
            _release_pages(previous.pop())
        previous.append(source[item.index.fqn])
        return previous[-1]

    try:
        return save_streaming(plan_sd, src, dst, fetch, progress, "torch -> DCP")
    finally:
        if mapped and previous:
            _release_pages(previous.pop())


def convert_full_checkpoint_to_dcp(src: PathLike, dst: PathLike, src_platform: str = "huggingface", *,
                                   key_mapping: KeyMapping = None, progress: bool = False) -> ConversionReport:
    """Convert a full checkpoint at ``src`` into a checkpoint at ``dst``, streaming, replacing
    one there atomically.  ``src_platform``: ``"huggingface"`` or ``"torch"`` (a
    ``torch.save`` or ``.safetensors`` file).  Returns a :class:`ConversionReport`.  Raises
    :class:`CheckpointNotFoundError` / :class:`CheckpointFormatError` naming the file,
    ``ValueError`` for an unknown ``src_platform``.
    """
    platform = src_platform.lower()
    if platform in ("huggingface", "hf"):
        return _from_safetensors(src, dst, key_mapping, progress)
    if platform in ("torch", "pytorch", "pt"):
        if Path(src).suffix == ".safetensors":
            return _from_safetensors(src, dst, key_mapping, progress)
        return _from_torch_file(src, dst, key_mapping, progress)
    raise ValueError(f"src_platform must be 'huggingface' or 'torch', got {src_platform!r}")
