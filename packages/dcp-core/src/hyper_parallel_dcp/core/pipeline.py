"""The one save and load pipeline (``save_state_dict``, ``load_state_dict``): planner and storage
writer/reader run through :class:`DistWrapper`, independent of any backend."""

from __future__ import annotations

import copy
import itertools
import uuid
from dataclasses import replace
from operator import attrgetter
from typing import Any, Callable, Optional

import torch.distributed as dist

from .collectives import DistWrapper
from .errors import CheckpointTimeoutError, MismatchError, MissingKeyError, MissingRegionError
from .flatten import flatten_state_dict, match_stored_keys, set_by_path
from .gc_pause import gc_paused
from .layout import is_tensor_leaf
from .load_planning import StandardLoadPlanner
from .metadata import Metadata, MetadataIndex, StorageInfo, pack_metadata, storage_table, unpack_metadata
from .planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from .reader_assignment import SplitReads, apply_assignment, assign_reads, read_layout
from .save_planning import StandardSavePlanner
from .settings import CHUNK_EXCHANGE, fault_point, log_info, phase
from .stateful import expand_stateful, restore_stateful
from .storage import StorageReader, StorageWriter, WriteResult, read_metadata_once

__all__ = ["ReadExecutor", "attach_results", "load_state_dict", "process_rank", "save_state_dict"]

# (final plan of this rank, reader, planner, group) -> None; the plan's planner_data is the
# rank's ReaderAssignment (its replica groups and every group the load needs)
ReadExecutor = Callable[[LoadPlan, StorageReader, LoadPlanner, Optional[dist.ProcessGroup]], None]

# save_id of a cached plan → how many times it was reused (same on every rank).
_cache_uses: dict[str, itertools.count] = {}


def process_rank(group: Optional[dist.ProcessGroup] = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


_RESULT_INDEX = attrgetter("index")
_RESULT_STORAGE = attrgetter("storage_data")
_RESULT_FILE = attrgetter("storage_data.relative_path")
_RESULT_SIZE = attrgetter("file_size")
_RESULT_DIGEST = attrgetter("header_digest")


def attach_results(metadata: Metadata, results: list[list[WriteResult]]) -> Metadata:
    """``metadata`` (a global plan's) with every rank's write results: storage entries,
    file sizes, header digests and the per-rank copies of objects."""
    md = copy.copy(metadata)
    storage_data: dict[MetadataIndex, StorageInfo] = {}
    md.files = {}
    md.header_digests = {}
    for rank_results in results:  # whole lists at a time
        storage_data.update(zip(map(_RESULT_INDEX, rank_results), map(_RESULT_STORAGE, rank_results)))
        names = list(map(_RESULT_FILE, rank_results))
        md.files.update(zip(names, map(_RESULT_SIZE, rank_results)))
        md.header_digests.update(zip(names, map(_RESULT_DIGEST, rank_results)))
    # a file whose writer recorded no digest (objects, another backend's writer) has none
    md.header_digests = {name: digest for name, digest in md.header_digests.items() if digest is not None}
    if md.rank_objects:  # objects whose copies differ, named by the global plan: each rank's
        md.rank_objects = {fqn: {} for fqn in md.rank_objects}
        for rank, rank_results in enumerate(results):
            for result in rank_results:
                if result.index.offset is None and result.index.fqn in md.rank_objects:
                    md.rank_objects[result.index.fqn][rank] = result.storage_data
        for fqn, copies in md.rank_objects.items():  # the plain entry: the lowest saving rank's copy
            if copies:
                storage_data[MetadataIndex(fqn)] = copies[min(copies)]
    md.storage_data = storage_data
    md.storage_data = storage_table(md)  # as columns: what the JSON and the packing read
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
    """Save ``state_dict`` through ``storage_writer``; returns the metadata (the global one with
    collectives).  On any failure every rank raises and ``storage_writer.abort`` runs.
    ``dist_wrapper`` (ignored with ``no_dist``) replaces the process-group collectives."""
    use_collectives = use_collectives and not no_dist
    if dist_wrapper is not None and not no_dist:
        dw = dist_wrapper
        rank, world_size = dw.rank, dw.world_size
    else:
        rank, world_size = (0, 1) if no_dist else process_rank(process_group)
        dw = DistWrapper(process_group, use_dist=use_collectives and world_size > 1,
                         coordinator_rank=coordinator_rank)
    is_coordinator = rank == coordinator_rank if use_collectives or world_size == 1 else True
    planner = planner if planner is not None else StandardSavePlanner()

    with phase("save", rank), gc_paused():
        try:
            return _save(state_dict, storage_writer, planner, dw, rank, world_size, is_coordinator, use_collectives)
        except BaseException as exc:
            storage_writer.abort(exc)
            raise


def _save(state_dict: dict[str, Any], storage_writer: StorageWriter, planner: SavePlanner, dw: DistWrapper,
          rank: int, world_size: int, is_coordinator: bool, use_collectives: bool) -> Metadata:
    global_metadata: list[Optional[Metadata]] = [None]  # the coordinator's, from the global step or the cache
    looked_up: list[Optional[tuple[SavePlan, Optional[Metadata]]]] = [None]

    def set_up_step() -> Optional[tuple[str, Any]]:
        fault_point("save.setup", rank)
        # Stateful leaves give their state_dict() inside the first collective step
        expanded, _ = expand_stateful(state_dict)
        flat, _ = flatten_state_dict(expanded, is_tensor_leaf)
        storage_writer.set_up_storage_writer(is_coordinator=is_coordinator, rank=rank, world_size=world_size,
                                             use_collectives=use_collectives)
        planner.set_up_planner(flat, is_coordinator=is_coordinator, rank=rank, world_size=world_size,
                               use_collectives=use_collectives)
        looked_up[0] = planner.lookup_cached_plan()
        return None if looked_up[0] is None else ("hit", planner.cache_token())

    # one step first: a set-up failure or a plan-cache miss (or differing tokens) on one
    # rank sends every rank the same way
    hits = dw.all_gather("plan_cache", set_up_step)
    cached = looked_up[0] if all(hits) and len(set(hits)) == 1 else None
    fault_point("save.plan", rank)
    planner.cache_hit = cached is not None
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
            # torch's contract: the planner returns the final plans and the metadata; each
            # rank gets its final plan back (``finish_plan`` takes the rank's own item objects)
            with phase("build_global_plan", rank):
                plans, global_metadata[0] = planner.create_global_plan(all_plans)
                save_id = uuid.uuid4().hex[:16]
                return [replace(p, save_id=save_id) for p in storage_writer.prepare_global_plan(plans)]

        final_plan = planner.finish_plan(dw.reduce_scatter("plan", local_step, global_step))

    own_results: list[list[WriteResult]] = []

    def write_step() -> Optional[list[WriteResult]]:
        fault_point("save.write", rank)
        with phase("execute_write", rank):
            results = storage_writer.execute_write(final_plan, planner)
        if not is_coordinator:
            fault_point("save.commit", rank)
        elif dw.use_dist:
            # the coordinator's own results stay here (the gather would pickle them)
            own_results.append(results)
            return None
        return results

    gathered_results: list[list[list[WriteResult]]] = []
    final_metadata: list[Metadata] = []

    def prepare_step(gathered: list[Optional[list[WriteResult]]]) -> Any:
        all_results = [own_results[0] if r is None else r for r in gathered]  # None: the coordinator's own
        with phase("prepare_metadata", rank):
            assert global_metadata[0] is not None
            metadata = attach_results(global_metadata[0], all_results)
            storage_writer.prepare_finalize(metadata, all_results)
        gathered_results.append(all_results)
        final_metadata.append(metadata)
        return pack_metadata(metadata) if dw.use_dist else None

    def sync_step() -> None:
        with phase("sync_written", rank):
            storage_writer.sync_written()

    def commit_step(_: Any) -> None:
        fault_point("save.commit", rank)
        with phase("finalize_checkpoint", rank):
            storage_writer.finalize_checkpoint(final_metadata[0], gathered_results[0])

    with phase("_save_impl", rank):
        packed = dw.all_reduce_confirmed("write", write_step, prepare_step, sync_step, commit_step)
    if not final_metadata:  # not the coordinator
        final_metadata.append(unpack_metadata(packed))
    if cached is None and not final_metadata[0].rank_objects:  # a plan that made a checkpoint (one copy of each object)
        planner.cache_plan(final_plan, global_metadata[0] if is_coordinator else None)
    return final_metadata[0]


def _share_metadata(storage_reader: StorageReader, dw: DistWrapper,
                    rank: int) -> tuple[StorageReader, Callable[[], Metadata], bool]:
    """``(reader, metadata_of, collectives_required)``: the checkpoint's reader, a parser of its
    metadata (call it in a failure-propagating step) and whether it allows collectives.  With
    collectives only the coordinator reads the metadata and broadcasts it."""
    fault_point("load.setup", rank)
    if not dw.use_dist:
        with phase("read_metadata", rank):
            storage_reader, metadata = read_metadata_once(storage_reader)
        return storage_reader, (lambda: metadata), storage_reader.collectives_required

    def read_step() -> tuple[Any, bool]:
        return storage_reader.read_metadata_payload(), storage_reader.collectives_required

    # every rank agrees whether collectives follow
    with phase("read_metadata", rank):
        payload, collectives_required = dw.broadcast_step("read_metadata", read_step)
    storage_reader = storage_reader.reader_for(payload)
    parsed: list[Metadata] = []

    def metadata_of() -> Metadata:
        if not parsed:
            with phase("parse_metadata", rank):
                parsed.append(storage_reader.metadata_from_payload(payload))
        return parsed[0]

    return storage_reader, metadata_of, collectives_required


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
    """Load into ``state_dict`` in place (tensors copied into, objects replaced), only its keys.
    ``read_executor`` (read-once + broadcast) runs the reads instead of ``execute_read`` when the
    load's collectives span the default group: the coordinator then picks one reader per shard."""
    use_collectives = use_collectives and not no_dist
    rank, world_size = (0, 1) if no_dist else process_rank(process_group)
    planner = planner if planner is not None else StandardLoadPlanner()
    original = state_dict
    state_dict, stateful = expand_stateful(state_dict)  # filled, then handed to load_state_dict

    with phase("load", rank), gc_paused():
        first = DistWrapper(process_group, use_dist=use_collectives and world_size > 1,
                            coordinator_rank=coordinator_rank)
        storage_reader, metadata_of, collectives_required = _share_metadata(storage_reader, first, rank)
        use_collectives = use_collectives and collectives_required and world_size > 1
        dw = DistWrapper(process_group, use_dist=use_collectives, coordinator_rank=coordinator_rank)
        # replica groups come from dist.new_group, which every rank of the default group enters
        broadcast = read_executor is not None and dw.use_dist and (
            process_group is None or dist.get_world_size(process_group) == dist.get_world_size())
        paths: dict[str, Any] = {}
        plan = _plan_load(state_dict, metadata_of, storage_reader, planner, dw, rank, world_size, broadcast, paths)
        _execute_read(plan, storage_reader, planner, dw, rank, read_executor if broadcast else None, process_group)
        for fqn, value in getattr(planner, "loaded_objects", {}).items():  # the non-tensor objects
            state_dict[paths[fqn][0]] = set_by_path(state_dict[paths[fqn][0]], paths[fqn][1:], value)
        restore_stateful(original, state_dict, stateful)


def _plan_load(state_dict: dict[str, Any], metadata_of: Callable[[], Metadata], storage_reader: StorageReader,
               planner: LoadPlanner, dw: DistWrapper, rank: int, world_size: int, assign: bool,
               paths: dict[str, Any]) -> LoadPlan:
    """This rank's final load plan; fills ``paths`` (FQN → path in ``state_dict``).  With
    ``assign`` the coordinator picks the readers of replicated shards."""
    is_coordinator = rank == dw.coordinator_rank
    local: list[LoadPlan] = []
    own_splits: list[SplitReads] = []  # this rank's, beside the coordinator's answer to them

    def local_step() -> LoadPlan:
        fault_point("load.plan", rank)
        metadata = metadata_of()
        flat, found = flatten_state_dict(state_dict, is_tensor_leaf)
        flat, found = match_stored_keys(flat, found, metadata.state_dict_metadata)  # torch DCP's lists
        paths.update(found)
        storage_reader.set_up_storage_reader(metadata, is_coordinator=is_coordinator, rank=rank)
        planner.set_up_planner(flat, metadata, is_coordinator=is_coordinator, rank=rank, world_size=world_size)
        with phase("build_local_plan", rank):
            try:
                plan = storage_reader.prepare_local_plan(planner.create_local_plan())
            except (MissingKeyError, MismatchError, MissingRegionError) as exc:
                # the planner knows the key, the reader which checkpoint it is
                where = storage_reader.location()
                if where is not None and exc.args and isinstance(exc.args[0], str):
                    exc.args = (f"{exc.args[0]} (checkpoint {where})", *exc.args[1:])
                raise
        local.append(plan)
        return plan

    if not assign:
        error: Optional[BaseException] = None
        try:
            local_step()
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the check below
            error = exc
        dw.check("plan", error)
        return planner.finish_plan(local[0])

    def layout_step() -> tuple[Any, Any, bool]:
        plan, metadata = local_step(), metadata_of()
        layout, splits = read_layout(plan, metadata)
        own_splits.append(splits)
        # a chunk exchange costs more than it saves where every rank's reads are memory copies
        copies = bool(splits) and CHUNK_EXCHANGE.get() is None and storage_reader.reads_are_copies()
        return layout, splits, copies

    def global_step(gathered: list[Any]) -> list[Any]:
        with phase("build_global_plan", rank):
            exchange = CHUNK_EXCHANGE.get()
            if exchange is None:
                exchange = not all(copies for _, splits, copies in gathered if splits)
            return assign_reads([layout for layout, _, _ in gathered],
                                [splits for _, splits, _ in gathered] if exchange else None)

    reply = dw.reduce_scatter("plan", layout_step, global_step)
    plan = apply_assignment(local[0], metadata_of(), own_splits[0], reply, dw.rank)
    return planner.finish_plan(plan)


def _execute_read(plan: LoadPlan, storage_reader: StorageReader, planner: LoadPlanner, dw: DistWrapper,
                  rank: int, read_executor: Optional[ReadExecutor],
                  process_group: Optional[dist.ProcessGroup]) -> None:
    """Run the reads (through ``read_executor`` when given); a failure on any rank is raised on all."""
    error: Optional[BaseException] = None
    try:
        with phase("execute_read", rank):
            fault_point("load.read", rank)
            if read_executor is not None:
                read_executor(plan, storage_reader, planner, process_group)
            else:
                storage_reader.execute_read(plan, planner)
    except CheckpointTimeoutError:
        raise  # a rank is gone: the check below would only wait for it once more
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the check below
        error = exc
    dw.check("read", error)
