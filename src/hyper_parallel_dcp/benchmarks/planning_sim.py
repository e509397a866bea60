"""Planning at scale, simulated in one process.

For a synthetic LLM-like state dict laid out on a device mesh of ``world`` ranks we build
each rank's save plan from pure geometry (:func:`placement_boxes`, no process group),
then time what the coordinator does with all of them — dedup and metadata build — with
this project's planner and with ``torch.distributed.checkpoint``'s default planner on
the same input.  Load planning is timed for a resharded target: the slowest sampled
rank's local plan (every rank does this in parallel; it includes the compact target
description the rank sends) and the coordinator's reader assignment over every rank's
target description.  The bytes of the planning collectives are the pickled objects the
load pipeline sends: each rank's target description (gathered), each rank's answer
(scattered), and each rank's own final plan for comparison; the all-gather design they
replace made every rank receive every rank's plan.

Two layouts:

- ``dense``: a 7B-like decoder on a ``(dp, tp=8)`` mesh, DDP × TP (replicated over dp),
  so dedup collapses ``dp`` copies of every chunk; resharded target: ``tp=4``.
- ``moe``: an MoE decoder (64 experts per layer) on a ``(dp, ep=64)`` mesh, FSDP × EP,
  so every rank owns unique expert chunks and the metadata grows with the world size;
  resharded target: ``ep=32``.
"""

from __future__ import annotations

import gc
import math
import pickle
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

__all__ = ["GLOBAL_LOAD_SAMPLES", "LAYOUTS", "TensorSpec", "fit_exponent", "rank_boxes", "run_planning",
           "simulate_world"]

#: runs of the coordinator's reader assignment timed per world (the median is reported)
GLOBAL_LOAD_SAMPLES = 3


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the synthetic model and its placements on a 2-D mesh."""

    fqn: str
    shape: tuple[int, ...]
    placements: tuple[Any, ...]


def _decoder_specs(layers: int, hidden: int, vocab: int, embed: tuple[Any, ...], attn: Sequence[tuple[Any, ...]],
                   norm: tuple[Any, ...], mlp: Callable[[str], list[TensorSpec]]) -> list[TensorSpec]:
    """Embedding, per layer the q/k/v/o projections (placed by ``attn``), ``mlp(prefix)`` and
    the two norms, then the final norm and the LM head (placed as the embedding)."""
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), embed)]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [TensorSpec(f"{p}self_attn.{name}_proj.weight", (hidden, hidden), placements)
                  for name, placements in zip("qkvo", attn)]
        specs += mlp(p)
        specs += [TensorSpec(p + name, (hidden,), norm) for name in ("input_layernorm.weight",
                                                                     "post_attention_layernorm.weight")]
    specs += [TensorSpec("model.norm.weight", (hidden,), norm), TensorSpec("lm_head.weight", (vocab, hidden), embed)]
    return specs


def _dense_specs(layers: int = 32, hidden: int = 4096, inter: int = 11008, vocab: int = 32000) -> list[TensorSpec]:
    """A Llama-7B-like decoder; mesh ``(dp, tp)``, Replicate over dp, TP over tp."""
    from torch.distributed.tensor import Replicate, Shard

    col, row = (Replicate(), Shard(0)), (Replicate(), Shard(1))
    return _decoder_specs(layers, hidden, vocab, col, (col, col, col, row), (Replicate(), Replicate()), lambda p: [
        TensorSpec(p + "mlp.gate_proj.weight", (inter, hidden), col),
        TensorSpec(p + "mlp.up_proj.weight", (inter, hidden), col),
        TensorSpec(p + "mlp.down_proj.weight", (hidden, inter), row)])


def _moe_specs(layers: int = 24, hidden: int = 2048, experts: int = 64, inter: int = 1408,
               vocab: int = 102400) -> list[TensorSpec]:
    """An MoE decoder; mesh ``(dp, ep)``: FSDP over dp for everything, experts over ep."""
    from torch.distributed.tensor import Replicate, Shard

    fsdp, rep, expert = (Shard(0), Replicate()), (Replicate(), Replicate()), (Shard(1), Shard(0))
    return _decoder_specs(layers, hidden, vocab, fsdp, (fsdp,) * 4, rep, lambda p: [
        TensorSpec(p + "mlp.gate.weight", (experts, hidden), rep),
        TensorSpec(p + "mlp.experts.w1", (experts, inter, hidden), expert),
        TensorSpec(p + "mlp.experts.w2", (experts, hidden, inter), expert),
        TensorSpec(p + "mlp.experts.w3", (experts, inter, hidden), expert)])


@dataclass(frozen=True)
class Layout:
    """A synthetic model, its save mesh and a resharded load mesh for ``world`` ranks."""

    name: str
    specs: Callable[[], list[TensorSpec]]
    save_mesh: Callable[[int], tuple[int, int]]
    load_mesh: Callable[[int], tuple[int, int]]


LAYOUTS: dict[str, Layout] = {
    "dense": Layout("dense", _dense_specs, lambda w: (w // 8, 8), lambda w: (w // 4, 4)),
    "moe": Layout("moe", _moe_specs, lambda w: (max(1, w // 64), min(w, 64)), lambda w: (max(1, w // 32), min(w, 32))),
}


def rank_boxes(specs: Sequence[TensorSpec], mesh: tuple[int, int], rank: int,
               cache: Optional[dict] = None) -> Sequence[tuple[TensorSpec, Any]]:
    """The ``(spec, ChunkBox)`` pieces rank ``rank`` (row-major on ``mesh``) holds.

    ``cache`` (one per ``specs`` list) memoises boxes per (shape, placements, coordinate
    on the mesh dims the spec is sharded on): replicas and the layers' equal tensors share
    them, and ranks that differ only on a mesh dim no spec is sharded on share the whole
    answer (do not modify it).  That keeps generating 16384 plans cheap: torch's shard
    arithmetic is ~10 µs a call, and a check of a placement's type ~2 µs.
    """
    from torch.distributed.tensor import Shard

    from hyper_parallel_dcp.core.layout import placement_boxes

    cache = {} if cache is None else cache
    signatures = cache.get("_signatures")
    if signatures is None:  # per spec, the tensor dim each mesh dim shards (-1: none)
        signatures = cache["_signatures"] = [tuple(p.dim if isinstance(p, Shard) else -1 for p in spec.placements)
                                             for spec in specs]
        cache["_sharded_mesh_dims"] = {d for sig in signatures for d, dim in enumerate(sig) if dim >= 0}
    coord = (rank // mesh[1], rank % mesh[1])
    sharded = cache["_sharded_mesh_dims"]
    whole_key = None
    if len(sharded) < len(mesh):
        whole_key = ("_rank", mesh, tuple(c if d in sharded else -1 for d, c in enumerate(coord)))
        whole = cache.get(whole_key)
        if whole is not None:
            return whole
    out = []
    for spec, sig in zip(specs, signatures):
        key = (spec.shape, sig, mesh, tuple(c if dim >= 0 else -1 for c, dim in zip(coord, sig)))
        boxes = cache.get(key)
        if boxes is None:
            boxes = cache[key] = [b for b, _ in placement_boxes(spec.shape, mesh, coord, spec.placements, spec.fqn)]
        for box in boxes:
            out.append((spec, box))
    if whole_key is not None:
        cache[whole_key] = tuple(out)
    return out


# ------------------------------------------------------------------ our planner's input
def _our_save_plans(specs, mesh, world):
    """Every rank's local save plan as :func:`create_local_save_plan` makes it: the
    items as columns (built here from the geometry, without item objects)."""
    from array import array

    from hyper_parallel_dcp.core.plan_columns import WriteColumns
    from hyper_parallel_dcp.core.planner import SavePlan

    cache: dict = {}
    plans = []
    for rank in range(world):
        kinds: dict = {}
        rows, offsets, sizes = array("q"), array("q"), array("q")
        for spec, box in rank_boxes(specs, mesh, rank, cache):
            kind = kinds.setdefault(spec.fqn, (len(kinds), (spec.fqn, "tensor", spec.shape, "bfloat16")))[0]
            rows.extend((kind, len(box.offsets), len(box.sizes), box.volume * 2))
            offsets.extend(box.offsets)
            sizes.extend(box.sizes)
        plans.append(SavePlan(WriteColumns([k for _, k in kinds.values()], rows, offsets, sizes)))
    return plans


def _gathered(plans) -> tuple[list[bytes], int]:
    """The plans as the coordinator's gather receives them: one pickle per rank."""
    blobs = [pickle.dumps(plan) for plan in plans]
    return blobs, sum(map(len, blobs))


def _plan_entries(plans) -> list[list[tuple[str, tuple[int, ...], int]]]:
    """Per plan, its items' ``(fqn, offsets, nbytes)`` read from the columns (the write
    item objects a rank builds for its own plan are not needed to fake 8192 ranks' write
    results; the plans share a kind table, decoded once)."""
    from itertools import islice

    from hyper_parallel_dcp.core.plan_columns import WriteColumns

    tables: dict[str, list[str]] = {}
    out = []
    for plan in plans:
        columns = WriteColumns.of(plan.items)
        fqns = tables.get(columns.kinds_text)
        if fqns is None:
            fqns = tables[columns.kinds_text] = [k[0] for k in columns.kinds]
        offsets = iter(columns.offsets)
        out.append([(fqns[kind], tuple(islice(offsets, ndim)), nbytes)
                    for kind, ndim, _, nbytes in zip(*[iter(columns.rows)] * 4)])
    return out


def _our_storage_data(entries):
    """Synthetic write results (file, offset, length, checksum, key) like a real save's."""
    from hyper_parallel_dcp.core.metadata import MetadataIndex, StorageInfo, chunk_key

    storage = {}
    files = {}
    for rank, plan in enumerate(entries):
        name = f"_rank{rank}_.safetensors"
        offset = 0
        for fqn, offsets, nbytes in plan:
            storage[MetadataIndex(fqn, offsets)] = StorageInfo(name, offset, nbytes, "0123456789abcdef",
                                                               chunk_key(fqn, offsets))
            offset += nbytes
        if plan:
            files[name] = offset
    return storage, files


def _torch_save_plans(specs, mesh, world):
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=torch.bfloat16)
    cache: dict = {}
    made: dict = {}
    plans = []

    def item(spec, box) -> WriteItem:
        # One object per distinct chunk, shared by its replicas.  Building 2.4M distinct
        # items (or unpickling them, as torch's gather would) costs minutes of CPU over
        # the default worlds; shared objects make torch's dedup faster than after a real
        # gather (dense, 2048 ranks: 0.58 s shared against 2.24 s unpickled), so torch's
        # global save figures here are on the low side.
        key = (spec.fqn, id(box))
        found = made.get(key)
        if found is None:
            found = made[key] = WriteItem(
                index=MetadataIndex(spec.fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)),
                    properties=props,
                    size=torch.Size(spec.shape),
                ),
            )
        return found

    for rank in range(world):
        plans.append(SavePlan([item(spec, box) for spec, box in rank_boxes(specs, mesh, rank, cache)]))
    return plans


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """CPU seconds of this process running ``fn`` (planning is single-threaded Python;
    on a shared machine wall time mostly measures the neighbours)."""
    gc.collect()
    gc.freeze()  # what is alive now is left out of the collections fn may trigger (and of the next collect)
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def simulate_world(layout: Layout, world: int, *, with_torch: bool = True, load_ranks: int = 4,
                   torch_validate_budget_s: Optional[float] = None,
                   torch_validate_rate: Optional[float] = None, torch_planner_only: bool = False) -> dict[str, Any]:
    """See :func:`_simulate_world` (the garbage collector's frozen objects are released after)."""
    try:
        return _simulate_world(layout, world, with_torch=with_torch, load_ranks=load_ranks,
                               torch_validate_budget_s=torch_validate_budget_s, torch_validate_rate=torch_validate_rate,
                               torch_planner_only=torch_planner_only)
    finally:
        gc.unfreeze()


def _simulate_world(layout: Layout, world: int, *, with_torch: bool = True, load_ranks: int = 4,
                    torch_validate_budget_s: Optional[float] = None,
                    torch_validate_rate: Optional[float] = None, torch_planner_only: bool = False) -> dict[str, Any]:
    """Simulate one world size; returns a dict of CPU timings (seconds) and sizes (bytes).

    One record per (layout, world): other measurements of the same world add keys to it.
    torch's overlap validation is quadratic in the chunks of a tensor; with
    ``torch_validate_budget_s`` and ``torch_validate_rate`` (seconds per chunk pair,
    measured at a smaller world) it is not run when the projection passes the budget:
    the record then holds the projection, marked (see :func:`_torch_world`).
    ``torch_planner_only``: of torch, only its global save (dedup, metadata build and the
    validation or its projection) runs — not its local load plans nor its metadata's
    pickle (the largest worlds: minutes of CPU for figures no goal is judged on).
    """
    import torch

    from hyper_parallel_dcp.core.gc_pause import gc_paused
    from hyper_parallel_dcp.core.layout import TensorShards
    from hyper_parallel_dcp.core.load_planning import create_local_load_plan
    from hyper_parallel_dcp.core.metadata import metadata_to_json
    from hyper_parallel_dcp.core.reader_assignment import apply_assignment, assign_reads, read_layout
    from hyper_parallel_dcp.core.save_planning import StandardSavePlanner

    specs = layout.specs()
    mesh = layout.save_mesh(world)
    row: dict[str, Any] = {"layout": layout.name, "world": world, "save_mesh": list(mesh),
                           "load_mesh": list(layout.load_mesh(world))}
    t_gen, plans = _timed(lambda: _our_save_plans(specs, mesh, world))
    row["items_total"] = sum(len(p.items) for p in plans)
    row["generate_s"] = t_gen
    blobs, row["ours_save_gather_bytes"] = _gathered(plans)
    # what the coordinator pays to unpickle the gathered plans (not in the global save figure)
    row["ours_save_gather_unpickle_s"], plans = _timed(lambda: [pickle.loads(b) for b in blobs])
    blobs.clear()
    # the coordinator's real call (dedup + metadata build, GC paused inside)
    t_global, (deduped, metadata) = _timed(lambda: StandardSavePlanner().create_global_plan(plans))
    row["ours_global_save_s"] = t_global
    # counted from the columns: building every chunk list here would send metadata_to_json
    # below down its per-chunk path (a real save serialises the columns)
    row["chunks_stored"] = sum(_chunk_count(md) for md in metadata.state_dict_metadata.values())
    entries = _plan_entries(deduped)
    metadata.storage_data, metadata.files = _our_storage_data(entries)
    t_json, text = _timed(lambda: metadata_to_json(metadata))
    row["ours_metadata_json_bytes"] = len(text)
    row["ours_metadata_json_s"] = t_json
    row.update(_metadata_figures(text, metadata, entries, with_torch=with_torch and not torch_planner_only))
    del entries
    plans = deduped = text = None  # free before the load phase

    # load: a resharded target, built from geometry alone (views are never touched)
    lmesh = layout.load_mesh(world)
    dummy = torch.empty(0)
    cache: dict = {}

    def target(rank: int) -> dict[str, TensorShards]:
        flat: dict[str, TensorShards] = {}
        for spec, box in rank_boxes(specs, lmesh, rank, cache):
            flat.setdefault(spec.fqn, TensorShards(spec.shape, torch.bfloat16, [])).pieces.append((box, dummy))
        return flat

    sample = sorted({(world - 1) * i // max(1, load_ranks - 1) for i in range(load_ranks)})
    local_times = []
    local_plans = {}
    for rank in sample:
        flat = target(rank)

        def local_step(flat=flat) -> tuple:
            plan = create_local_load_plan(flat, metadata)[0]
            return plan, read_layout(plan, metadata)

        t, local_plans[rank] = _timed(local_step)
        local_times.append(t)
    row["ours_local_load_plan_s"] = max(local_times)
    # Every rank's target description, from geometry: what read_layout() sends, with the
    # request digest replaced by the shard's sizes (an opaque int to the coordinator).
    # Data-parallel replicas get equal tuples, not shared objects, as after unpickling.
    layouts = [_geometry_layout(specs, lmesh, rank, cache) for rank in range(world)]
    def coordinator_step() -> list:
        with gc_paused():  # as in load_state_dict
            return assign_reads(layouts)

    # The median of a few runs: one sample of seconds on a shared VM varies by a third (the
    # MoE layout at 16384 ranks: 3.0 to 4.2 s in runs minutes apart), enough to move the
    # fitted growth exponent past its goal.  The step does not change its input.
    samples = []
    replies: list = []
    for _ in range(GLOBAL_LOAD_SAMPLES):
        replies = []  # the previous run's answers freed before the next is timed
        t_assign, replies = _timed(coordinator_step)
        samples.append(t_assign)
    row["ours_global_load_s"] = statistics.median(samples)
    row["ours_global_load_samples_s"] = samples
    sent, received, own = [], [], []
    for rank in sample:
        plan, (targets, splits) = local_plans[rank]
        final = apply_assignment(plan, metadata, splits, replies[rank], rank)
        sent.append(len(pickle.dumps(targets)))
        received.append(len(pickle.dumps(("ok", replies[rank]))))
        own.append(len(pickle.dumps(final)))
    row["ours_load_rank_sent_bytes"] = max(sent)
    row["ours_load_rank_received_bytes"] = max(received)
    row["ours_load_rank_own_plan_bytes"] = min(own)
    row["ours_load_received_over_own_plan"] = max(r / o for r, o in zip(received, own))
    row["ours_load_coordinator_received_bytes"] = sum(len(pickle.dumps(lay)) for lay in layouts[:: max(1, world // 64)]
                                                      ) * world // len(layouts[:: max(1, world // 64)])
    # the all-gather design: every rank received every rank's plan (estimated from the sample)
    row["allgather_load_rank_received_bytes"] = world * sum(own) // len(own)
    layouts.clear()  # free before the torch side
    local_plans.clear()
    replies = []

    if with_torch:
        row.update(_torch_world(specs, mesh, lmesh, world, [] if torch_planner_only else sample,
                                torch_validate_budget_s, torch_validate_rate))
    return row


def _chunk_count(md) -> int:
    """How many chunks ``md`` has, without building its chunk list."""
    from hyper_parallel_dcp.core.metadata import chunk_columns

    ndim, offsets, _, _ = chunk_columns(md)
    return len(offsets) // ndim if ndim else len(md.chunks)


def _metadata_figures(text: str, metadata, entries, *, with_torch: bool = True) -> dict[str, Any]:
    """Parse time of our ``.metadata`` (format 2) and size and unpickle time of torch's.

    ``ours_metadata_parse_s``: bytes → ``Metadata`` as a load gets it (per-chunk objects
    are built on first use); ``ours_metadata_all_chunks_s``: that plus building every
    tensor's chunk list, what a rank touching every tensor pays.  torch's metadata is
    built from the same chunks and file assignment (what its planner would produce,
    without running it at worlds where its planning is over budget).
    """
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as TorchChunk
    from torch.distributed.checkpoint.metadata import Metadata as TorchMetadata
    from torch.distributed.checkpoint.metadata import MetadataIndex as TorchIndex
    from torch.distributed.checkpoint.metadata import TensorProperties as TorchProperties
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as TorchTensor

    from hyper_parallel_dcp.core.metadata import metadata_from_json

    data = text.encode()
    t_parse, parsed = _timed(lambda: metadata_from_json(data))
    t_chunks, _ = _timed(lambda: sum(len(md.chunks) for md in parsed.state_dict_metadata.values()))
    ours = {"ours_metadata_parse_s": t_parse, "ours_metadata_all_chunks_s": t_parse + t_chunks}
    if not with_torch:
        return ours
    props = TorchProperties(dtype=torch.bfloat16)
    sd: dict[str, Any] = {fqn: TorchTensor(props, torch.Size(md.size),
                                           [TorchChunk(torch.Size(c.offsets), torch.Size(c.sizes))
                                            for c in md.chunks])
                          for fqn, md in metadata.state_dict_metadata.items()}
    storage = {}
    for rank, plan in enumerate(entries):
        offset = 0
        for fqn, offsets, nbytes in plan:
            storage[TorchIndex(fqn, torch.Size(offsets))] = _StorageInfo(f"__{rank}_0.distcp", offset, nbytes)
            offset += nbytes
    blob = pickle.dumps(TorchMetadata(state_dict_metadata=sd, storage_data=storage))
    t_unpickle, _ = _timed(lambda: pickle.loads(blob))
    return dict(ours, torch_metadata_pickle_bytes=len(blob), torch_metadata_unpickle_s=t_unpickle)


def _geometry_layout(specs, lmesh, rank, cache) -> tuple:
    """Rank ``rank``'s target description as :func:`read_layout` builds it (bfloat16)."""
    return tuple((spec.fqn, tuple(box.offsets), box.volume * 2, hash(tuple(box.sizes)))
                 for spec, box in rank_boxes(specs, lmesh, rank, cache) if box.volume)


def _chunk_pairs(metadata) -> int:
    """Chunk pairs torch's ``_validate_global_plan`` may compare: its sweep runs along the
    largest dim, which the simulated layouts never shard, so every pair of a tensor."""
    return sum(len(md.chunks) * (len(md.chunks) - 1) // 2 for md in metadata.state_dict_metadata.values()
               if hasattr(md, "chunks"))


def _torch_world(specs, mesh, lmesh, world, sample, validate_budget_s=None, validate_rate=None) -> dict[str, Any]:
    """torch's global save (dedup, metadata, validation) and sampled local load plans.

    When ``validate_rate`` × chunk pairs passes ``validate_budget_s``, the validation is
    not run: ``torch_validate_s`` is that projection, ``torch_validate_projected`` is
    true and ``torch_global_save_s`` includes it (marked ``torch_global_save_projected``).
    """
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    row: dict[str, Any] = {}
    plans = _torch_save_plans(specs, mesh, world)
    planner = DefaultSavePlanner(flatten_state_dict=False, enable_plan_caching=False)
    t_dedup, deduped = _timed(lambda: planner._dedup_save_plans(plans))
    from torch.distributed.checkpoint.default_planner import _validate_global_plan, create_default_global_save_plan

    t_md, (global_plan, metadata) = _timed(lambda: create_default_global_save_plan(deduped))
    pairs = _chunk_pairs(metadata)
    row["torch_validate_chunk_pairs"] = pairs
    if validate_budget_s is not None and validate_rate is not None and validate_rate * pairs > validate_budget_s:
        t_val = validate_rate * pairs
        row["torch_validate_projected"] = True
        row["torch_global_save_projected"] = True
    else:
        t_val, _ = _timed(lambda: _validate_global_plan(global_plan, metadata))
    row["torch_dedup_s"] = t_dedup
    row["torch_build_metadata_s"] = t_md
    row["torch_validate_s"] = t_val
    row["torch_global_save_s"] = t_dedup + t_md + t_val
    plans = deduped = global_plan = None
    local_times = []
    cache: dict = {}
    for rank in sample:
        chunks: dict[str, list] = {}
        for spec, box in rank_boxes(specs, lmesh, rank, cache):
            chunks.setdefault(spec.fqn, []).append(
                ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)))

        def plan_rank(chunks=chunks) -> list:
            items = []
            for fqn, local in chunks.items():
                items.extend(create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], local))
            return items

        t, items = _timed(plan_rank)
        local_times.append(t)
        # torch's default load: gather the local plans, scatter each rank's plan back
        plan_bytes = len(pickle.dumps(LoadPlan(items)))
        row["torch_load_rank_sent_bytes"] = max(row.get("torch_load_rank_sent_bytes", 0), plan_bytes)
        row["torch_load_rank_received_bytes"] = max(row.get("torch_load_rank_received_bytes", 0), plan_bytes)
    if local_times:
        row["torch_local_load_plan_s"] = max(local_times)
    return row


def fit_exponent(worlds: Sequence[float], times: Sequence[float]) -> float:
    """Least-squares slope of log(time) against log(world): time ∝ world ** slope.

    Raises ``ValueError`` with fewer than two points or a non-positive value.
    """
    if len(worlds) != len(times) or len(worlds) < 2:
        raise ValueError("fit_exponent needs at least two (world, time) pairs of equal length")
    if any(w <= 0 for w in worlds) or any(t <= 0 for t in times):
        raise ValueError("fit_exponent needs positive worlds and times")
    xs = [math.log(w) for w in worlds]
    ys = [math.log(t) for t in times]
    mx = sum(xs) / len(xs)
    my = sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_exponent needs at least two distinct world sizes")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def run_planning(worlds: Sequence[int], layouts: Sequence[str] = ("dense", "moe"), *, with_torch: bool = True,
                 log: Callable[[str], None] = print, torch_validate_budget_s: float = 60.0,
                 torch_planner_only_above: Optional[int] = 8192) -> dict[str, Any]:
    """Simulate every (layout, world): ours and torch's planners on the same plans.

    torch runs at every world; above ``torch_planner_only_above`` ranks only its global
    save (see :func:`simulate_world`), which keeps the default run (1024, 8192 and 16384
    ranks) within minutes on a small machine.  Its overlap validation is quadratic in a tensor's chunks
    (all pairs, for the MoE expert tensors: 4.1 s at 1024 ranks, some 1,000 s projected
    at 16384); once the seconds per pair measured at a smaller world project past
    ``torch_validate_budget_s`` it is projected instead of run, and the record says so.
    """
    rows = []
    for name in layouts:
        layout = LAYOUTS[name]
        rate: Optional[float] = None
        for world in worlds:
            started = time.perf_counter()
            row = simulate_world(layout, world, with_torch=with_torch, torch_validate_budget_s=torch_validate_budget_s,
                                 torch_validate_rate=rate,
                                 torch_planner_only=torch_planner_only_above is not None
                                 and world > torch_planner_only_above)
            row["wall_s"] = time.perf_counter() - started  # the whole simulation of this world, generation included
            if not row.get("torch_validate_projected") and row.get("torch_validate_chunk_pairs", 0) > 10_000:
                rate = row["torch_validate_s"] / row["torch_validate_chunk_pairs"]
            rows.append(row)
            log(f"planning {name} world={world}: ours global save {row['ours_global_save_s']:.3f}s"
                + (f", torch {row['torch_global_save_s']:.3f}s" if "torch_global_save_s" in row else "")
                + (" (validation projected)" if row.get("torch_validate_projected") else "")
                + f", global load {row['ours_global_load_s']:.3f}s"
                + f", rank receives {row['ours_load_rank_received_bytes']} B"
                + f" ({row['ours_load_received_over_own_plan']:.2f}x its plan)"
                + f", metadata {row['ours_metadata_json_bytes'] / 1e6:.1f} MB"
                + f" ({row['wall_s']:.0f} s wall)")
    fits: dict[str, Any] = {}
    for name in layouts:
        sub = [r for r in rows if r["layout"] == name]
        for key in ("ours_global_save_s", "torch_global_save_s", "ours_local_load_plan_s",
                    "torch_local_load_plan_s", "ours_global_load_s", "ours_load_rank_received_bytes",
                    "ours_load_coordinator_received_bytes"):
            pts = [(r["world"], r[key]) for r in sub if r.get(key)]
            if len(pts) >= 2:
                fits[f"{name}.{key}"] = fit_exponent([p[0] for p in pts], [p[1] for p in pts])
    return {"rows": rows, "exponents": fits}
