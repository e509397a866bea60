"""torchtitan: its ``CheckpointManager`` writing and reading our format.

``hyper_parallel_dcp.integrations.torchtitan.CheckpointManager`` is torchtitan's manager
(intervals, ``step-N`` folders, retention, async modes, loading the newest step) whose
two storage calls, ``dcp_save`` and ``dcp_load``, go through
:class:`~hyper_parallel_dcp.torch_compat.StorageWriter` / ``StorageReader``; the
Hugging Face paths (``to_hf`` / ``from_hf``) stay torchtitan's.  Build it from its
``Config`` as torchtitan's (``CheckpointManager.Config(...).build(...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.components.checkpointer.dcp import CheckpointManager as _TitanCheckpointManager
from torchtitan.tools.utils import GarbageCollection

from .. import torch_compat
from ..torch_compat import StorageWriter

__all__ = ["CheckpointManager"]


class CheckpointManager(_TitanCheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` with hyper-parallel-dcp's storage."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanCheckpointManager.Config):  # torchtitan builds the class that declares Config
        pass

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = StorageWriter(checkpoint_id)
        result: Any
        if async_mode == AsyncMode.ASYNC:
            result = tdcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            result = tdcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                     async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        else:
            result = torch_compat.save(state_dict, checkpoint_id)  # torch's planner, its plan cache on
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        torch_compat.load(state_dict, checkpoint_id)
        if MODEL in self.states:  # torchtitan flattens the model's states: put back as it does
            self.states[MODEL].load_state_dict(state_dict)

