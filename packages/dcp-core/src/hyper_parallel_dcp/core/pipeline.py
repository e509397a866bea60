"""The save and load pipelines, independent of any storage backend.

``save_state_dict`` and ``load_state_dict`` run the planner and the storage
writer/reader through :class:`DistWrapper`.  The umbrella's ``save``/``load``, the async
writer process and the offline converter all call these; there is no second copy.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from dataclasses import replace
from typing import Any, Callable, Optional

import torch.distributed as dist

from .collectives import DistWrapper
from .flatten import flatten_state_dict, match_stored_keys, set_by_path
from .layout import is_tensor_leaf
from .metadata import Metadata
from .planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from .standard_planner import StandardLoadPlanner, StandardSavePlanner, _gc_paused
from .stateful import expand_stateful, restore_stateful
from .storage import StorageReader, StorageWriter, WriteResult
from .timing import log_info, phase

__all__ = ["ReadExecutor", "load_state_dict", "process_rank", "save_state_dict"]

# (plan of this rank, global plans of all ranks, reader, planner, group) -> None
ReadExecutor = Callable[[LoadPlan, list[LoadPlan], StorageReader, LoadPlanner, Optional[dist.ProcessGroup]], None]

# save_id of a cached plan → how many times it was reused (same on every rank).
_cache_uses: dict[str, itertools.count] = {}


def process_rank(group: Optional[dist.ProcessGroup] = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _is_whole_world(group: Optional[dist.ProcessGroup]) -> bool:
    return group is None or dist.get_world_size(group) == dist.get_world_size()


def _attach_results(metadata: Metadata, results: list[list[WriteResult]]) -> Metadata:
    md = copy.copy(metadata)
    md.storage_data = {}
    md.files = {}
    for rank_results in results:
        for res in rank_results:
            md.storage_data[res.index] = res.storage_data
            md.files[res.storage_data.relative_path] = res.file_size
    return md


def save_state_dict(
    state_dict: dict[str, Any],
    storage_writer: StorageWriter,
    planner: Optional[SavePlanner] = None,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    use_collectives: bool = True,
    dist_wrapper: Optional[DistWrapper] = None,
) -> Metadata:
    """Save ``state_dict`` through ``storage_writer``; returns the metadata.

    With collectives the returned metadata is the global one on every rank; without, the
    rank's own.  On any failure every rank raises and ``storage_writer.abort`` runs.
    ``dist_wrapper`` (ignored with ``no_dist``) replaces the process-group collectives and
    gives rank and world size: the async writer process has no process group and
    exchanges through files, or not at all (``use_dist=False``, rank identity only).
    """
    use_collectives = use_collectives and not no_dist
    state_dict, _ = expand_stateful(state_dict)  # torch's Stateful leaves: their state_dict()
    if dist_wrapper is not None and not no_dist:
        dw = dist_wrapper
        rank, world_size = dw.rank, dw.world_size
    else:
        rank, world_size = (0, 1) if no_dist else process_rank(process_group)
        dw = DistWrapper(process_group, use_dist=use_collectives and world_size > 1,
                         coordinator_rank=coordinator_rank)
    is_coordinator = rank == coordinator_rank if use_collectives or world_size == 1 else True
    planner = planner if planner is not None else StandardSavePlanner()

    # A save or load allocates many small objects (plan items, metadata) while the
    # caller's large heap is alive: full collections re-traversing it cost more than the
    # planning itself (2000 tensors: ~0.2 s of a 0.3 s load), so the collector pauses.
    with phase("save", rank), _gc_paused():
        try:
            return _save(state_dict, storage_writer, planner, dw, rank, world_size, is_coordinator, use_collectives)
        except BaseException as exc:
            storage_writer.abort(exc)
            raise


def _save(state_dict: dict[str, Any], storage_writer: StorageWriter, planner: SavePlanner, dw: DistWrapper,
          rank: int, world_size: int, is_coordinator: bool, use_collectives: bool) -> Metadata:
    global_metadata: list[Optional[Metadata]] = [None]
    looked_up: list[Optional[tuple[SavePlan, Optional[Metadata]]]] = [None]

    def set_up_step() -> bool:
        flat, _ = flatten_state_dict(state_dict, is_tensor_leaf)
        storage_writer.set_up_storage_writer(is_coordinator=is_coordinator, rank=rank, world_size=world_size,
                                             use_collectives=use_collectives)
        planner.set_up_planner(flat, is_coordinator=is_coordinator, rank=rank, world_size=world_size,
                               use_collectives=use_collectives)
        looked_up[0] = planner.lookup_cached_plan()
        return looked_up[0] is not None

    if dw.use_dist:
        # One collective step before anything else, so that every rank takes the same
        # path: a failure in the set-up on one rank (the coordinator finding another save
        # holding the directory, a Partial DTensor, colliding FQNs) is raised on every
        # rank, and a plan-cache miss on one rank (other keys or another layout there)
        # sends all ranks through planning; otherwise the others would wait forever.
        hits = dw.all_gather("plan_cache", set_up_step)
        cached = looked_up[0] if all(hits) else None
        if cached is None and looked_up[0] is not None and getattr(planner, "cache_hit", False):
            # this rank's hit was not used
            planner.cache_hit = False  # type: ignore[attr-defined]
    else:
        set_up_step()
        cached = looked_up[0]
    if cached is not None:
        log_info(rank, "Hit final plan and metadata cache.")
        final_plan, global_metadata[0] = cached
        assert final_plan.save_id is not None
        uses = next(_cache_uses.setdefault(final_plan.save_id, itertools.count(1)))
        final_plan = replace(final_plan, save_id=f"{final_plan.save_id}-{uses}")
    else:
        def local_step() -> SavePlan:
            with phase("build_local_plan", rank):
                return storage_writer.prepare_local_plan(planner.create_local_plan())

        def global_step(all_plans: list[SavePlan]) -> list[SavePlan]:
            with phase("build_global_plan", rank):
                plans, metadata = planner.create_global_plan(all_plans)
                plans = storage_writer.prepare_global_plan(plans)
                save_id = uuid.uuid4().hex[:16]
                global_metadata[0] = metadata
                return [replace(p, save_id=save_id) for p in plans]

        central = dw.reduce_scatter("plan", local_step, global_step)
        final_plan = planner.finish_plan(central)
        planner.cache_plan(final_plan, global_metadata[0] if is_coordinator else None)

    def write_step() -> list[WriteResult]:
        with phase("execute_write", rank):
            return storage_writer.execute_write(final_plan, planner)

    def finish_step(all_results: list[list[WriteResult]]) -> Metadata:
        assert global_metadata[0] is not None
        metadata = _attach_results(global_metadata[0], all_results)
        with phase("finalize_checkpoint", rank):
            storage_writer.finalize_checkpoint(metadata, all_results)
        return metadata

    with phase("_save_impl", rank):
        return dw.all_reduce("write", write_step, finish_step)


def load_state_dict(
    state_dict: dict[str, Any],
    storage_reader: StorageReader,
    planner: Optional[LoadPlanner] = None,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    use_collectives: bool = True,
    read_executor: Optional[ReadExecutor] = None,
) -> None:
    """Load into ``state_dict`` in place (tensors copied into, objects replaced).

    Only keys present in ``state_dict`` are loaded.  ``read_executor`` (e.g. read-once +
    broadcast) is used when this load exchanges plans (collectives on, more than one
    rank, a checkpoint with a global ``.metadata``) over every rank of the default group:
    then the global plan chooses one reader per replicated shard and the executor runs
    the reads instead of ``storage_reader.execute_read``.  Otherwise it is not called.
    """
    use_collectives = use_collectives and not no_dist
    rank, world_size = (0, 1) if no_dist else process_rank(process_group)
    planner = planner if planner is not None else StandardLoadPlanner()
    original = state_dict
    state_dict, stateful = expand_stateful(state_dict)  # filled, then handed to load_state_dict

    with phase("load", rank), _gc_paused():
        read: list[Metadata] = []

        def read_step() -> bool:
            with phase("read_metadata", rank):
                read.append(storage_reader.read_metadata())
            return storage_reader.collectives_required

        first = DistWrapper(process_group, use_dist=use_collectives and world_size > 1,
                            coordinator_rank=coordinator_rank)
        if first.use_dist:
            # A rank that cannot read the metadata (wrong path, no shared filesystem) must
            # fail every rank, and all ranks must agree whether collectives follow: one
            # rank falling back to {rank}.metadata alone would leave the others waiting.
            if not all(first.all_gather("read_metadata", read_step)):
                use_collectives = False
        elif not read_step():
            use_collectives = False
        metadata = read[0]
        dw = DistWrapper(process_group, use_dist=use_collectives and world_size > 1,
                         coordinator_rank=coordinator_rank)
        is_coordinator = rank == coordinator_rank
        # Whether read-once + broadcast runs is decided here, once, for the planner and
        # for the read: only this step knows whether the plans are exchanged.  Replica
        # groups are made with dist.new_group, which every rank of the default group must
        # enter: a load on a sub-group reads each shard on each rank instead.
        broadcast = read_executor is not None and dw.use_dist and _is_whole_world(process_group)
        paths: dict[str, Any] = {}

        def local_step() -> LoadPlan:
            # The set-up runs inside the gathered step: a failure on one rank (e.g. two
            # paths flattening to one FQN) is raised on every rank instead of hanging them.
            flat, found = flatten_state_dict(state_dict, is_tensor_leaf)
            flat, found = match_stored_keys(flat, found, metadata.state_dict_metadata)  # torch DCP's lists
            paths.update(found)
            storage_reader.set_up_storage_reader(metadata, is_coordinator=is_coordinator, rank=rank)
            planner.set_up_planner(flat, metadata, is_coordinator=is_coordinator, rank=rank, world_size=world_size)
            if isinstance(planner, StandardLoadPlanner):
                planner.assign_readers = broadcast
            with phase("build_local_plan", rank):
                return storage_reader.prepare_local_plan(planner.create_local_plan())

        if dw.use_dist:
            all_plans = dw.all_gather("plan", local_step)
        else:
            all_plans = [local_step()]
        with phase("build_global_plan", rank):
            global_plans = storage_reader.prepare_global_plan(planner.create_global_plan(all_plans))
        plan = planner.finish_plan(global_plans[dw.rank])

        error: Optional[BaseException] = None
        try:
            with phase("execute_read", rank):
                if broadcast:
                    assert read_executor is not None
                    read_executor(plan, global_plans, storage_reader, planner, process_group)
                else:
                    storage_reader.execute_read(plan, planner)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the check below
            error = exc
        dw.check("read", error)

        loaded = getattr(planner, "loaded_objects", {})
        for fqn, value in loaded.items():
            root_key = paths[fqn][0]
            state_dict[root_key] = set_by_path(state_dict[root_key], paths[fqn][1:], value)
        restore_stateful(original, state_dict, stateful)
