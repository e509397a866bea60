"""Save planning: local write items, the global plan (dedup + metadata, over columns in
:mod:`.global_save`), and the default planner :class:`StandardSavePlanner`."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from .chunks import full_box
from .gc_pause import gc_paused
from .global_save import plan_global_columns
from .layout import is_tensor_leaf, to_tensor_shards
from .metadata import Metadata, MetadataIndex, dtype_name
from .objects import serialize_object
from .plan_cache import PlanCache
from .plan_columns import WriteColumns
from .planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from .settings import log_info

__all__ = [
    "StandardSavePlanner",
    "build_metadata",
    "create_local_save_plan",
    "dedup_save_plans",
    "plan_global_save",
    "plan_global_save_deferred",
]


def create_local_save_plan(flat: dict[str, Any], *, digests: bool = True
                           ) -> tuple[SavePlan, dict[MetadataIndex, Any], bool]:
    """Write items for a flattened state dict: the plan, item index → data, and whether a ragged
    leaf is present.  ``digests``: objects carry a digest of their bytes.  Raises ``ValueError``
    when two local pieces of one tensor start at one offset, and as ``to_tensor_shards`` does."""
    items: list[WriteItem] = []
    data: dict[MetadataIndex, Any] = {}
    ragged = False
    layouts: dict[Hashable, Any] = {}  # each DTensor layout's pieces, worked out once

    def add(index: MetadataIndex, item: WriteItem, value: Any) -> None:
        if index in data:
            raise ValueError(f"{index.fqn!r}: two local pieces start at offsets {index.offset}")
        items.append(item)
        data[index] = value

    for fqn, leaf in flat.items():
        if not is_tensor_leaf(leaf):
            index = MetadataIndex(fqn)
            digest = hashlib.blake2b(serialize_object(leaf), digest_size=8).hexdigest() if digests else None
            add(index, WriteItem(index, WriteItemType.BYTE_IO, digest=digest), leaf)
            continue
        shards = to_tensor_shards(leaf, fqn, meta=False, layouts=layouts)
        ragged = ragged or shards.ragged
        dtype = dtype_name(shards.dtype)
        pieces = shards.pieces
        if math.prod(shards.global_shape) == 0:
            # the metadata must still hold the tensor: one empty full-size chunk
            empty = full_box(shards.global_shape)
            pieces = [(empty, torch.empty(empty.sizes, dtype=shards.dtype))]
        for box, view in pieces:
            if box.is_empty() and box.volume != math.prod(shards.global_shape):
                continue
            index = MetadataIndex(fqn, box.offsets)
            add(index, WriteItem(index, WriteItemType.TENSOR, box.sizes, shards.global_shape, dtype,
                                 box.volume * shards.dtype.itemsize), view)
    return SavePlan(WriteColumns.from_items(items)), data, ragged


def dedup_save_plans(plans: Sequence[SavePlan], save_to_minimum_rank: bool = False) -> list[SavePlan]:
    """Keep each item held by several ranks on one of them: the holder with the fewest bytes so
    far (largest first, ties → lowest rank), or the lowest with ``save_to_minimum_rank``.
    Differing object copies are each kept.  Raises ``ValueError`` naming the key and both ranks
    when two ranks hold different pieces at one key, and as :func:`build_metadata` does."""
    return plan_global_save(plans, save_to_minimum_rank=save_to_minimum_rank, metadata=False)[0]


def build_metadata(plans: Sequence[SavePlan]) -> Metadata:
    """The global metadata (without storage data) for deduplicated plans.  Raises ``ValueError``
    when ranks disagree on a key's kind, shape or dtype, or a tensor's chunks are malformed or overlap."""
    metadata = plan_global_save(plans, dedup=False)[1]
    assert metadata is not None
    return metadata


def plan_global_save(plans: Sequence[SavePlan], *, dedup: bool = True, save_to_minimum_rank: bool = False,
                     metadata: bool = True) -> tuple[list[SavePlan], Optional[Metadata]]:
    """The coordinator's save planning in one pass (:func:`.global_save.plan_global_columns`):
    :func:`dedup_save_plans` (with ``dedup``), then :func:`build_metadata` of the result (with
    ``metadata``; else ``None``)."""
    return plan_global_columns(plans, dedup=dedup, save_to_minimum_rank=save_to_minimum_rank, metadata=metadata)


def plan_global_save_deferred(plans: Sequence[SavePlan], *, dedup: bool = True, save_to_minimum_rank: bool = False
                              ) -> tuple[list[SavePlan], Callable[[], Metadata]]:
    """:func:`plan_global_save` with the metadata returned by a function (every error is raised here)."""
    out, metadata = plan_global_save(plans, dedup=dedup, save_to_minimum_rank=save_to_minimum_rank)
    assert metadata is not None
    return out, lambda: metadata


class StandardSavePlanner(SavePlanner):
    """Default save planner: cross-rank dedup (``remove_redundancy``) and a process-wide plan cache
    (``enable_plan_caching``; off without collectives and with a ragged leaf).  A subclass that
    overrides ``resolve_data`` gets ``resolved_data_stable`` False unless it declares it."""

    plan_cache: PlanCache = PlanCache()

    resolved_data_stable = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "resolve_data" in vars(cls) and "resolved_data_stable" not in vars(cls):
            cls.resolved_data_stable = False

    def __init__(self, enable_plan_caching: bool = True, remove_redundancy: bool = True,
                 save_to_minimum_rank: bool = False) -> None:
        self.enable_plan_caching = enable_plan_caching
        self.remove_redundancy = remove_redundancy
        self.save_to_minimum_rank = save_to_minimum_rank
        self._reset_state()
        self._set_up({}, True, 0, 1, True)

    def _reset_state(self) -> None:
        self._data: dict[MetadataIndex, Any] = {}
        self._local_plan: Optional[SavePlan] = None
        self._ragged = False

    @classmethod
    def clear_cache(cls) -> None:
        """Forget every cached plan of this process."""
        cls.plan_cache.clear()

    def without_state(self) -> StandardSavePlanner:
        """A copy with the same options and no per-save state (no reference to any tensor)."""
        fresh = type(self).__new__(type(self))
        fresh.__dict__.update(self.__dict__)
        fresh.flat = {}
        fresh.cache_hit = False
        fresh._reset_state()
        return fresh

    def set_up_planner(self, state_dict: dict[str, Any], *, is_coordinator: bool, rank: int = 0,
                       world_size: int = 1, use_collectives: bool = True) -> None:
        self._set_up(state_dict, is_coordinator, rank, world_size, use_collectives)

    def _set_up(self, state_dict: dict[str, Any], is_coordinator: bool, rank: int, world_size: int,
                use_collectives: bool) -> None:
        self.flat: dict[str, Any] = state_dict
        self.is_coordinator, self.rank, self.world_size = is_coordinator, rank, world_size
        self.use_collectives = use_collectives
        self._local_plan = None
        self.cache_hit = False

    def _ensure_local(self) -> SavePlan:
        if self._local_plan is None:
            self._local_plan, self._data, self._ragged = create_local_save_plan(self.flat, digests=self.use_collectives)
        return self._local_plan

    def cache_key(self) -> Hashable:
        """The plan-cache key of the state dict set up last (keys, rank, world, options)."""
        return (type(self).__name__, frozenset(self.flat), self.rank, self.world_size,
                self.remove_redundancy, self.save_to_minimum_rank)

    def _fingerprint(self) -> tuple:
        return tuple((it.index, it.sizes, it.global_shape, it.dtype) for it in self._ensure_local().items
                     if it.type is WriteItemType.TENSOR)

    def cache_token(self) -> str:
        """A digest of this rank's objects (equal on every rank when all their copies are)."""
        digests = (str(it.digest) for it in self._ensure_local().items if it.type is WriteItemType.BYTE_IO)
        return hashlib.blake2b(" ".join(digests).encode(), digest_size=8).hexdigest()

    @property
    def caching(self) -> bool:
        """Whether this save may use and fill the plan cache."""
        return self.enable_plan_caching and self.use_collectives and not self.has_ragged

    def lookup_cached_plan(self) -> Optional[tuple[SavePlan, Optional[Metadata]]]:
        if not (self.enable_plan_caching and self.use_collectives):
            return None
        entry = self.plan_cache.lookup(self.cache_key())
        if entry is None or self.has_ragged:
            return None
        plan, metadata, fingerprint = entry
        if fingerprint != self._fingerprint():
            # same keys, another layout: plan again (cache_plan then replaces the entry)
            log_info(self.rank, "Plan cache entry does not match the state dict's layout; planning again.")
            return None
        return plan, metadata

    def cache_plan(self, final_plan: SavePlan, metadata: Optional[Metadata]) -> None:
        if self.caching:
            self.plan_cache.store(self.cache_key(), (final_plan, metadata, self._fingerprint()))

    def create_local_plan(self) -> SavePlan:
        return self._ensure_local()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with gc_paused():
            plans, metadata = plan_global_save(all_plans, dedup=self.remove_redundancy and self.use_collectives,
                                               save_to_minimum_rank=self.save_to_minimum_rank)
        assert metadata is not None
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        local = self._local_plan
        if local is not None and isinstance(new_plan.items, WriteColumns) and isinstance(local.items, WriteColumns):
            # the final plan is the local plan or a cut of it: reuse the rank's item objects
            new_plan.items.reuse_items_of(local.items)
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        self._ensure_local()
        return self._data[write_item.index]

    @property
    def has_ragged(self) -> bool:
        self._ensure_local()
        return self._ragged
