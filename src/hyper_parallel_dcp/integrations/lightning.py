"""PyTorch Lightning: ``ModelParallelStrategy`` (FSDP2 / TP) sharded checkpoints in our format.

Replace ``from pytorch_lightning.strategies import ModelParallelStrategy`` by
``from hyper_parallel_dcp.integrations.lightning import ModelParallelStrategy``: the
Trainer's ``save_checkpoint`` and ``fit(ckpt_path=...)`` then write and read the sharded
checkpoint through :class:`~hyper_parallel_dcp.torch_compat.StorageWriter` /
:class:`~hyper_parallel_dcp.torch_compat.StorageReader` (torch's default planner, its plan cache on, and
``meta.pt`` unchanged), and it resumes on another world size.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import lightning_fabric.strategies.model_parallel as fabric_model_parallel
import pytorch_lightning.strategies.model_parallel as pl_model_parallel
from pytorch_lightning.strategies import ModelParallelStrategy as _LightningModelParallelStrategy

from .. import torch_compat

__all__ = ["ModelParallelStrategy"]


@contextlib.contextmanager
def _through_us() -> Iterator[None]:
    """Lightning's two distributed-checkpoint calls routed to the plugin while inside."""
    saved = pl_model_parallel._distributed_checkpoint_save, fabric_model_parallel._distributed_checkpoint_load
    # torch's planner, its plan cache on (Lightning's private hooks: typed for its own functions)
    pl_model_parallel._distributed_checkpoint_save = torch_compat.save  # type: ignore[assignment]
    fabric_model_parallel._distributed_checkpoint_load = torch_compat.load  # type: ignore[assignment]
    try:
        yield
    finally:
        pl_model_parallel._distributed_checkpoint_save, fabric_model_parallel._distributed_checkpoint_load = saved


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose sharded checkpoints are hyper-parallel-dcp's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        with _through_us():
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        with _through_us():
            return super().load_checkpoint(checkpoint_path, weights_only)
