"""What the training process and its writer process send each other; what the writer holds
already is left out (:class:`WriterMirror`, :class:`WriterHoldings`).  Also exports
:data:`PING`, :class:`Mode`, :class:`SaveRequest`, :class:`SaveReply`, :func:`clean_planner`,
:func:`parent_cache_entry`."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core import Metadata, SavePlanner, StandardSavePlanner, StorageWriter
from hyper_parallel_dcp.core.plan_cache import PlanCacheEntry
from hyper_parallel_dcp.core.settings import DEFAULT_TIMEOUT_S

from .staged import StagedStateDict

__all__ = ["PING", "Mode", "SaveReply", "SaveRequest", "WriterHoldings", "WriterMirror", "clean_planner",
           "parent_cache_entry"]

#: A request the writer answers with ``PING`` once it is ready (torch imported, serving).
PING = "ping"


class Mode(enum.Enum):
    """How the writer processes of one save coordinate."""

    LOCAL = "local"  # one process (world size 1 or no_dist): nothing to coordinate
    NONE = "none"  # several ranks, use_collectives=False: {rank}.metadata each
    GLOO = "gloo"  # the writers' own CPU gloo group
    FILES = "files"  # the file mailbox in the checkpoint directory


@dataclass
class SaveRequest:
    """One save for the writer process; ``cache``: the plan-cache entry; ``save_suffix`` goes
    after a cached plan's save_id."""

    seq: int
    storage_writer: StorageWriter
    planner: Optional[SavePlanner]
    mode: Mode
    rank: int
    world_size: int
    no_dist: bool
    use_collectives: bool
    staged: StagedStateDict = field(default_factory=StagedStateDict)
    gloo_init: Optional[str] = None
    mailbox_dir: Optional[str] = None
    mailbox_tag: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    cache: Optional[PlanCacheEntry] = None
    save_suffix: str = ""
    # set by WriterMirror.send: the slabs the writer lacks; the entry's value left out as held
    new_slabs: dict[int, torch.Tensor] = field(default_factory=dict)
    cache_held: bool = False


@dataclass
class SaveReply:
    """The writer's answer to request ``seq``: the metadata, or the error (the exception
    itself when it pickles, and its text with the writer's traceback)."""

    seq: int
    metadata: Optional[Metadata] = None
    cache: Optional[PlanCacheEntry] = None  # a fresh plan's entry; None on a cache hit
    cache_hit: Optional[bool] = None
    error: Optional[BaseException] = None
    error_text: str = ""


class WriterMirror:
    """What one writer process holds, as its training process knows it."""

    def __init__(self) -> None:
        self.slabs: set[int] = set()
        self.cache: dict[Any, Any] = {}  # plan-cache key -> the entry object of this process's cache

    def send(self, conn: Any, request: SaveRequest, slabs: dict[int, torch.Tensor]) -> None:
        """Send ``request`` with the ``slabs`` the writer lacks, without the plan-cache entry
        it holds, then note what it holds (nothing when ``conn.send`` raises)."""
        cache, held = request.cache, False
        if cache is not None and cache[1] is not None and self.cache.get(cache[0]) is cache[1]:
            cache, held = (cache[0], None), True
        conn.send(replace(request, new_slabs={i: t for i, t in slabs.items() if i not in self.slabs}, cache=cache,
                          cache_held=held))
        self.slabs = set(request.staged.slab_ids)
        self.note_cache(request.cache)

    def note_cache(self, entry: Optional[PlanCacheEntry]) -> None:
        """The writer holds ``entry`` (sent to it, or sent back by it and installed here)."""
        if entry is not None and entry[1] is not None:
            self.cache[entry[0]] = entry[1]


class WriterHoldings:
    """The writer's side of :class:`WriterMirror`: what it keeps from the requests it got."""

    def __init__(self) -> None:
        self.slabs: dict[int, torch.Tensor] = {}
        self.cache: dict[Any, Any] = {}

    def receive(self, req: SaveRequest) -> tuple[dict[int, torch.Tensor], Optional[PlanCacheEntry]]:
        """The live slabs and plan-cache entry of ``req``; what this writer holds is updated
        first (its training process assumes so, whatever the save does next)."""
        self.slabs.update(req.new_slabs)
        for slab_id in [i for i in self.slabs if i not in req.staged.slab_ids]:
            del self.slabs[slab_id]
        if req.cache is None:
            return self.slabs, None
        key, value = req.cache
        if req.cache_held:
            value = self.cache.get(key)  # missing: this save plans afresh (on every rank)
        elif value is not None:
            self.cache[key] = value
        else:
            self.cache.pop(key, None)
        return self.slabs, (key, value)

    def note_cache(self, entry: PlanCacheEntry) -> None:
        """The writer sent ``entry`` back: its training process installs and then holds it."""
        if entry[1] is not None:
            self.cache[entry[0]] = entry[1]


def clean_planner(planner: Optional[SavePlanner]) -> Optional[SavePlanner]:
    """A copy of ``planner`` without per-save state (which may reference a state dict's tensors)."""
    return planner.without_state() if isinstance(planner, StandardSavePlanner) else planner


def parent_cache_entry(planner: Optional[SavePlanner], flat_keys: Iterable[str], rank: int, world_size: int,
                       use_collectives: bool) -> Optional[PlanCacheEntry]:
    """This process's plan-cache entry for a save of ``flat_keys``, to mirror into the
    writer; ``None`` when the save uses no plan cache."""
    if not use_collectives:
        return None
    probe = planner if planner is not None else StandardSavePlanner()
    if not isinstance(probe, StandardSavePlanner) or not probe.enable_plan_caching:
        return None
    probe = probe.without_state()
    probe.set_up_planner(dict.fromkeys(flat_keys), is_coordinator=rank == 0, rank=rank, world_size=world_size,
                         use_collectives=use_collectives)
    return probe.plan_cache.export(probe.cache_key())
