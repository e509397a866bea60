"""Writing Hugging Face safetensors checkpoints as ``save_pretrained`` does: shards split as
``huggingface_hub`` splits them, ``model.safetensors.index.json``, ``{"format": "pt"}``."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from hyper_parallel_dcp.storage_fs.atomic import fsync_dir, write_file_atomic
from hyper_parallel_dcp.storage_fs.safetensors_stream import TensorEntry, write_safetensors

from .hf_source import INDEX_FILE, SINGLE_FILE
from .options import parse_size
from .progress import ConversionReport, progress_bar

__all__ = ["HFShardPlan", "TensorSpec", "plan_huggingface_shards", "write_huggingface_checkpoint"]

logger = logging.getLogger(__name__)

_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to export: its name in the output, shape and (output) dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class HFShardPlan:
    """Output files (name → tensor names, in write order) and the index metadata."""

    files: dict[str, list[str]]
    total_size: int
    total_parameters: int

    @property
    def is_sharded(self) -> bool:
        return len(self.files) > 1

    def weight_map(self) -> dict[str, str]:
        return {name: file for file, names in self.files.items() for name in names}


def plan_huggingface_shards(specs: Sequence[TensorSpec], max_shard_size: Union[int, str] = "5GB") -> HFShardPlan:
    """Split ``specs`` (in their order) into files exactly as ``huggingface_hub`` does;
    ``ValueError`` for an unreadable ``max_shard_size`` or a repeated name."""
    limit = parse_size(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor name {spec.name!r} appears twice in the export")
        seen.add(spec.name)
        size = spec.nbytes
        if size > limit:
            shards.append([spec.name])
            continue
        if current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(spec.name)
        current_size += size
    if current:
        shards.append(current)
    if len(shards) <= 1:
        files = {SINGLE_FILE: shards[0] if shards else []}
    else:
        files = {f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors": names for k, names in enumerate(shards)}
    return HFShardPlan(files, sum(s.nbytes for s in specs), sum(math.prod(s.shape) for s in specs))


def _remove_stale(dst: Path, plan: HFShardPlan) -> None:
    """Drop weight files of an earlier export that the new one does not replace; other files stay."""
    keep = set(plan.files)
    for entry in os.scandir(dst):
        stale_shard = _SHARD_FILE.match(entry.name) or entry.name == SINGLE_FILE
        stale_index = entry.name == INDEX_FILE and not plan.is_sharded
        if (stale_shard or stale_index) and entry.name not in keep and entry.is_file():
            os.unlink(entry.path)
            logger.info("removed %s from an earlier export", entry.path)


def write_huggingface_checkpoint(dst: Union[str, os.PathLike], specs: Sequence[TensorSpec],
                                 fetch: Callable[[str], torch.Tensor], max_shard_size: Union[int, str] = "5GB", *,
                                 report: Optional[ConversionReport] = None, progress: bool = False,
                                 sync_files: bool = True) -> ConversionReport:
    """Write the tensors named by ``specs`` as a Hugging Face checkpoint in ``dst``.

    ``fetch(name)`` returns each tensor just before it is written.  Files are written
    atomically, the index after the shards, stale weight files removed last.  Raises
    ``ValueError`` for a bad ``max_shard_size`` and what ``fetch`` raises.
    """
    root = Path(dst)
    plan = plan_huggingface_shards(specs, max_shard_size)
    by_name = {s.name: s for s in specs}
    report = report if report is not None else ConversionReport("<state_dict>", str(root))
    root.mkdir(parents=True, exist_ok=True)
    with progress_bar(report, plan.total_size, "-> HF safetensors", progress) as advance:
        for file, names in plan.files.items():
            def produce(name: str) -> torch.Tensor:
                tensor = fetch(name)
                advance(by_name[name].nbytes)
                return tensor

            entries = [TensorEntry(name, by_name[name].dtype, by_name[name].shape, (lambda n=name: produce(n)),
                                   label=f"tensor {name!r} of {file}") for name in names]
            write_file_atomic(root / file, functools.partial(write_safetensors, entries=entries), sync_files)
            report.files.append(file)
        if plan.is_sharded:
            index = {"metadata": {"total_parameters": plan.total_parameters, "total_size": plan.total_size},
                     "weight_map": plan.weight_map()}
            text = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            write_file_atomic(root / INDEX_FILE, lambda f: f.write(text), sync_files)
            report.files.append(INDEX_FILE)
        report.tensors = len(specs)
        _remove_stale(root, plan)
        if sync_files:
            fsync_dir(root)
    logger.info("wrote Hugging Face checkpoint %s: %s", root, report.summary())
    return report
