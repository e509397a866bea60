"""Storage interfaces: how a plan becomes bytes somewhere and back.

A custom backend subclasses :class:`StorageWriter` / :class:`StorageReader` and overrides
the abstract methods; the optional hooks have working defaults.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from .metadata import Metadata, MetadataIndex, StorageInfo
from .planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

__all__ = ["StorageReader", "StorageWriter", "WriteResult"]


@dataclass(frozen=True)
class WriteResult:
    """Where one write item landed; ``file_size`` is the final size of its file."""

    index: MetadataIndex
    storage_data: StorageInfo
    file_size: int


class StorageWriter(abc.ABC):
    @abc.abstractmethod
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        """Start a new save, optionally into another checkpoint."""

    def set_up_storage_writer(self, *, is_coordinator: bool, rank: int = 0, world_size: int = 1,
                              use_collectives: bool = True) -> None:
        """Called on every rank before planning (and before a plan-cache hit)."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    @abc.abstractmethod
    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Write every item of ``plan`` (data from ``planner.resolve_data``)."""

    @abc.abstractmethod
    def finalize_checkpoint(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator (or each rank without collectives): commit the checkpoint."""

    def abort(self, error: BaseException) -> None:
        """Called on every rank when the save failed; remove what this save left behind."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return True


class StorageReader(abc.ABC):
    @abc.abstractmethod
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None: ...

    @abc.abstractmethod
    def load_metadata(self) -> Metadata:
        """Read the checkpoint's metadata (works without a prior ``reset``)."""

    _known_metadata: Optional[Metadata] = None

    def use_metadata(self, metadata: Metadata) -> None:
        """Serve ``metadata`` instead of reading it again on every load through this reader
        (a tool that loads one checkpoint in many small loads, e.g. tensor by tensor)."""
        self._known_metadata = metadata

    def read_metadata(self) -> Metadata:
        """What the load pipeline calls: the metadata given to :meth:`use_metadata`, else
        :meth:`load_metadata`."""
        if self._known_metadata is not None:
            return self._known_metadata
        return self.load_metadata()

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        """Called on every rank once the metadata is known."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    @abc.abstractmethod
    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read every item of ``plan`` whose ``source`` is this rank (or ``None``)."""

    @property
    def collectives_required(self) -> bool:
        """False when the metadata came from per-rank files (no global view was written)."""
        return True

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        return {}
