"""``hp-dcp explain``: a dry run of a resharded load, without processes or accelerators.

The load planner's own functions run on meta-device views of each simulated rank's targets;
bytes are counted as ``FileSystemReader.bytes_read`` counts them.  Exports
:func:`explain_load`, its result types and ``run``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core.chunks import span_elements
from hyper_parallel_dcp.core.errors import (
    CheckpointError,
    MismatchError,
    MissingKeyError,
    MissingRegionError,
    format_ranks,
)
from hyper_parallel_dcp.core.layout import TensorShards, placement_boxes
from hyper_parallel_dcp.core.load_planning import create_local_load_plan
from hyper_parallel_dcp.core.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata, dtype_from_name
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, ReadItem
from hyper_parallel_dcp.core.reader_assignment import ReaderAssignment, assign_readers, read_layout
from hyper_parallel_dcp.storage_fs.integrity import check_complete

from ._common import EXIT_OK, EXIT_PROBLEM, existing_dir, format_bytes, print_json, print_table, progress
from .target_spec import TargetSpec, load_target_spec, placement_fits

__all__ = ["KeyLayout", "LoadExplanation", "LoadProblem", "RankLoad", "explain_load", "run"]

# fqn -> (global shape, dtype, placements) of a tensor the target loads
_Layouts = dict[str, tuple[tuple[int, ...], torch.dtype, tuple[Any, ...]]]


@dataclass
class LoadProblem:
    """Something that makes the simulated load fail; ``kind`` is one of ``missing_key``,
    ``mismatch``, ``missing_region``, ``placement``, ``storage``."""

    kind: str
    fqn: str
    message: str
    ranks: list[int] = field(default_factory=list)


@dataclass
class KeyLayout:
    """How one checkpoint key is laid out in the target: its placements and the rule used."""

    fqn: str
    placements: str
    rule: Optional[str]


@dataclass
class RankLoad:
    """What one simulated rank reads: ``bytes_needed`` by its targets; ``bytes_read``/``files`` when
    every rank reads for itself, ``read_once_*`` with read-once + broadcast; ``broadcast_sent``/
    ``broadcast_received``: shard bytes it broadcasts as a group's reader / receives."""

    rank: int
    coordinate: tuple[int, ...]
    bytes_needed: int = 0
    bytes_read: int = 0
    files: list[str] = field(default_factory=list)
    read_once_bytes_read: int = 0
    read_once_files: list[str] = field(default_factory=list)
    broadcast_sent: int = 0
    broadcast_received: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "coordinate": list(self.coordinate), "bytes_needed": self.bytes_needed,
                "bytes_read": self.bytes_read, "files": self.files,
                "read_once": {"bytes_read": self.read_once_bytes_read, "files": self.read_once_files,
                              "broadcast_sent": self.broadcast_sent, "broadcast_received": self.broadcast_received}}


@dataclass
class LoadExplanation:
    """The result of :func:`explain_load`."""

    target: TargetSpec
    tensors: int
    objects: int
    stored_bytes: int
    ranks: list[RankLoad]
    keys: list[KeyLayout]
    broadcast_groups: int = 0
    broadcast_bytes: int = 0
    broadcast_delivered_bytes: int = 0
    problems: list[LoadProblem] = field(default_factory=list)

    @property
    def total_bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks)

    @property
    def read_once_total_bytes_read(self) -> int:
        return sum(r.read_once_bytes_read for r in self.ranks)

    @property
    def over_read_factor(self) -> Optional[float]:
        """Bytes read by all ranks / bytes stored for the loaded keys (1.0: each stored byte once)."""
        return self.total_bytes_read / self.stored_bytes if self.stored_bytes else None

    @property
    def read_once_over_read_factor(self) -> Optional[float]:
        return self.read_once_total_bytes_read / self.stored_bytes if self.stored_bytes else None

    def to_json(self) -> dict[str, Any]:
        """A plain-JSON view (what ``hp-dcp explain --json`` prints)."""
        t = self.target
        return {
            "target": {"world_size": t.world_size, "mesh": list(t.mesh_shape),
                       "mesh_dim_names": list(t.mesh_dim_names) if t.mesh_dim_names else None},
            "tensors": self.tensors, "objects": self.objects, "stored_bytes": self.stored_bytes,
            "total_bytes_read": self.total_bytes_read, "over_read_factor": self.over_read_factor,
            "read_once": {"total_bytes_read": self.read_once_total_bytes_read,
                          "over_read_factor": self.read_once_over_read_factor,
                          "broadcast_groups": self.broadcast_groups, "broadcast_bytes": self.broadcast_bytes,
                          "broadcast_delivered_bytes": self.broadcast_delivered_bytes},
            "ranks": [r.to_json() for r in self.ranks],
            "keys": {k.fqn: {"placements": k.placements, "rule": k.rule} for k in self.keys},
            "problems": [{"kind": p.kind, "fqn": p.fqn, "ranks": p.ranks, "message": p.message}
                         for p in self.problems],
        }


class _Problems:
    """Collects problems, merging the same (kind, fqn, message) across ranks."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str, str], LoadProblem] = {}

    def add(self, kind: str, fqn: str, message: str, rank: Optional[int] = None) -> None:
        problem = self.by_key.setdefault((kind, fqn, message), LoadProblem(kind, fqn, message))
        if rank is not None and rank not in problem.ranks:
            problem.ranks.append(rank)

    def all(self) -> list[LoadProblem]:
        return sorted(self.by_key.values(), key=lambda p: (p.fqn, p.kind, p.message))


def _kind(exc: CheckpointError) -> str:
    kinds = ((MissingKeyError, "missing_key"), (MissingRegionError, "missing_region"), (MismatchError, "mismatch"))
    return next((kind for cls, kind in kinds if isinstance(exc, cls)), "placement")


def _plan_rank(flat: dict[str, Any], metadata: Metadata, rank: int, problems: _Problems) -> LoadPlan:
    """The rank's local load plan, leaving out (and reporting) keys the planner rejects."""
    try:
        return create_local_load_plan(flat, metadata)[0]
    except CheckpointError:
        pass
    items: list[ReadItem] = []
    for fqn, leaf in flat.items():
        try:
            items.extend(create_local_load_plan({fqn: leaf}, metadata)[0].items)
        except CheckpointError as exc:
            problems.add(_kind(exc), fqn, str(exc), rank)
    return LoadPlan(tuple(items))


def _target_layouts(metadata: Metadata, spec: TargetSpec, problems: _Problems
                    ) -> tuple[_Layouts, list[str], list[KeyLayout]]:
    """The loaded tensors' layouts, the loaded objects and the key table."""
    sd = metadata.state_dict_metadata
    tensors: _Layouts = {}
    objects: list[str] = []
    keys: list[KeyLayout] = []
    for fqn in spec.expect:
        if fqn not in sd:
            problems.add("missing_key", fqn, f"key {fqn!r} is expected by the target but not in the checkpoint")
    for fqn in sorted(fqn for fqn in sd if spec.wants(fqn)):
        md, expected = sd[fqn], spec.expect.get(fqn, {})
        if isinstance(md, BytesStorageMetadata):
            objects.append(fqn)
            keys.append(KeyLayout(fqn, "object (every rank)", None))
            continue
        assert isinstance(md, TensorStorageMetadata)
        shape = tuple(expected["shape"]) if expected.get("shape") is not None else tuple(md.size)
        dtype = dtype_from_name(str(expected["dtype"])) if expected.get("dtype") else md.properties.dtype
        placements, rule = spec.placements_for(fqn, len(shape))
        keys.append(KeyLayout(fqn, "(" + ", ".join(str(p) for p in placements) + ")", rule))
        bad = [p for p in placements if not placement_fits(p, len(shape))]
        if bad:
            problems.add("placement", fqn, f"{fqn!r}: placement {bad[0]} (rule {rule!r}) does not fit a "
                         f"{len(shape)}-d tensor of shape {list(shape)}")
        else:
            tensors[fqn] = (shape, dtype, placements)
    return tensors, objects, keys


def _rank_leaves(spec: TargetSpec, rank: int, tensors: _Layouts, objects: list[str],
                 problems: _Problems) -> dict[str, Any]:
    """The flat target state dict of one simulated rank (meta views, ``None`` for objects)."""
    coord = spec.coordinate(rank)
    flat: dict[str, Any] = {}
    for fqn, (shape, dtype, placements) in tensors.items():
        try:
            boxes = placement_boxes(shape, spec.mesh_shape, coord, placements, fqn)
        except (CheckpointError, ValueError, IndexError, AssertionError) as exc:
            problems.add("placement", fqn, f"{fqn!r}: {type(exc).__name__}: {exc}", rank)
            continue
        flat[fqn] = TensorShards(shape, dtype, [(box, torch.empty(box.sizes, dtype=dtype, device="meta"))
                                                for box, _ in boxes])
    flat.update({fqn: None for fqn in objects})  # any non-tensor leaf plans as one object read
    return flat


class _Bytes:
    """Byte counts of plan items against one checkpoint's metadata."""

    def __init__(self, metadata: Metadata, problems: _Problems) -> None:
        self.storage = metadata.storage_data or {}
        tensors = {fqn: md for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
        self.itemsize = {fqn: md.properties.dtype.itemsize for fqn, md in tensors.items()}
        self.chunk_sizes = {(fqn, c.offsets): c.sizes for fqn, md in tensors.items() for c in md.chunks}
        self.problems = problems

    def item_needed(self, item: ReadItem) -> int:
        if item.type is LoadItemType.BYTE_IO:
            info = self.storage.get(item.storage_index)
            return info.length if info is not None else 0
        return math.prod(item.lengths) * self.itemsize[item.dest_index.fqn]

    def read_by(self, plan: LoadPlan, rank: int) -> tuple[int, list[str]]:
        """Bytes ``rank`` reads from storage for ``plan`` (items whose source it is) and the files."""
        total, files = 0, set()
        for item in plan.items:
            if item.source is not None and item.source != rank:
                continue
            index = item.storage_index
            info = self.storage.get(index)
            if info is None:
                self.problems.add("storage", index.fqn, f"{index.fqn!r}: the metadata has no storage entry for the "
                                  f"chunk at {list(index.offset or ())}", rank)
                continue
            files.add(info.relative_path)
            if item.type is LoadItemType.BYTE_IO:
                total += info.length
            else:
                sizes = self.chunk_sizes[(index.fqn, index.offset or ())]
                total += span_elements(sizes, item.storage_offsets, item.lengths) * self.itemsize[index.fqn]
        return total, sorted(files)

    def stored(self, tensors: _Layouts, objects: list[str]) -> int:
        """Bytes stored for the loaded ``tensors`` and ``objects``."""
        object_bytes = {i.fqn: info.length for i, info in self.storage.items() if i.offset is None}
        return (sum(math.prod(sizes) * self.itemsize[fqn] for (fqn, _), sizes in self.chunk_sizes.items()
                    if fqn in tensors) + sum(object_bytes.get(fqn, 0) for fqn in objects))


def explain_load(metadata: Metadata, spec: TargetSpec, *, progress: Any = None) -> LoadExplanation:
    """Simulate loading the checkpoint described by ``metadata`` into the ``spec`` layout: bytes and
    files per rank, with and without read-once + broadcast.  Keys the planner rejects are
    reported in ``problems`` and left out of the counts.  ``progress`` wraps the iteration
    over ranks.  Neither argument is modified."""
    problems = _Problems()
    tensors, objects, keys = _target_layouts(metadata, spec, problems)
    ranks = range(spec.world_size) if progress is None else progress(range(spec.world_size))
    plans = [_plan_rank(_rank_leaves(spec, rank, tensors, objects, problems), metadata, rank, problems)
             for rank in ranks]
    failed = {p.fqn for p in problems.by_key.values()}
    if failed:  # a key that fails on one rank fails the whole load; count only the rest
        plans = [LoadPlan(tuple(it for it in p.items if it.dest_index.fqn not in failed)) for p in plans]
        tensors = {k: v for k, v in tensors.items() if k not in failed}
        objects = [k for k in objects if k not in failed]
    once_plans = assign_readers(plans, metadata) if spec.world_size > 1 else plans
    count = _Bytes(metadata, problems)
    rank_loads = []
    shard_bytes = []  # per rank: (fqn, offsets) -> bytes of each tensor shard it loads, as readers are weighed
    for rank, (plan, once) in enumerate(zip(plans, once_plans)):
        load = RankLoad(rank, spec.coordinate(rank), bytes_needed=sum(count.item_needed(it) for it in plan.items))
        load.bytes_read, load.files = count.read_by(plan, rank)
        load.read_once_bytes_read, load.read_once_files = count.read_by(once, rank)
        shard_bytes.append({(fqn, offsets): n for fqn, offsets, n, _ in read_layout(plan, metadata)[0]})
        rank_loads.append(load)
    groups: dict[tuple[Any, tuple[int, ...]], int] = {}
    for rank, once in enumerate(once_plans):
        assignment = once.planner_data
        for group in assignment.groups if isinstance(assignment, ReaderAssignment) else ():
            nbytes = shard_bytes[group.source][group.dest_index.fqn, group.dest_index.offset or ()]
            if rank == group.source:
                rank_loads[rank].broadcast_sent += nbytes
            else:
                rank_loads[rank].broadcast_received += nbytes
            groups[(group.dest_index, tuple(group.ranks))] = nbytes
    return LoadExplanation(
        target=spec, tensors=len(tensors), objects=len(objects), stored_bytes=count.stored(tensors, objects),
        ranks=rank_loads, keys=keys, broadcast_groups=len(groups), broadcast_bytes=sum(groups.values()),
        broadcast_delivered_bytes=sum(b * (len(members) - 1) for (_, members), b in groups.items()),
        problems=problems.all())


def _print_human(path: Any, exp: LoadExplanation, complete: bool, show_keys: bool) -> None:
    print(f"checkpoint  {path}{'' if complete else '  (NOT complete)'}")
    print(f"target      {exp.target.describe()}")
    print(f"loads       {exp.tensors} tensors and {exp.objects} objects, {format_bytes(exp.stored_bytes)} stored")
    if show_keys:
        print()
        print_table(["FQN", "placements", "rule"],
                    [[k.fqn, k.placements, k.rule or ("-" if k.placements.startswith("object") else "default")]
                     for k in exp.keys])
    print()
    r = exp.ranks
    print_table(
        ["rank", "coord", "needed", "read", "files", "read-once", "files", "bcast sent", "bcast recv"],
        [[x.rank, "(" + ",".join(map(str, x.coordinate)) + ")", format_bytes(x.bytes_needed),
          format_bytes(x.bytes_read), len(x.files), format_bytes(x.read_once_bytes_read), len(x.read_once_files),
          format_bytes(x.broadcast_sent), format_bytes(x.broadcast_received)] for x in r]
        + [["total", "", format_bytes(sum(x.bytes_needed for x in r)), format_bytes(exp.total_bytes_read),
            len({f for x in r for f in x.files}), format_bytes(exp.read_once_total_bytes_read),
            len({f for x in r for f in x.read_once_files}), format_bytes(sum(x.broadcast_sent for x in r)),
            format_bytes(sum(x.broadcast_received for x in r))]],
        right=(2, 3, 4, 5, 6, 7, 8))

    def factor(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}x"

    print(f"\nover-read   {factor(exp.over_read_factor)} of the stored bytes when every rank reads for itself "
          f"(broadcast_replicated_tensors=False)")
    print(f"            {factor(exp.read_once_over_read_factor)} with read-once + broadcast (the default)")
    print(f"broadcast   {exp.broadcast_groups} replica groups; {format_bytes(exp.broadcast_bytes)} read once and "
          f"broadcast, {format_bytes(exp.broadcast_delivered_bytes)} delivered to the other members")
    if not exp.problems:
        print("\nno problems: every key loads")
        return
    print(f"\nproblems ({len(exp.problems)}): the load would fail")
    for p in exp.problems:
        print(f"  {p.kind:<15} {p.message}" + (f" [ranks {format_ranks(p.ranks)}]" if p.ranks else ""))


def run(args: Any) -> int:
    """Explain the load; exit 1 when a key cannot be loaded or the checkpoint is incomplete."""
    path = existing_dir(args.checkpoint)
    spec = load_target_spec(args.target)
    report = check_complete(path)
    if report.metadata is None:
        print(f"cannot explain: {path} has no readable metadata", file=sys.stderr)
        for problem in report.problems:
            print(f"  - {problem}", file=sys.stderr)
        return EXIT_PROBLEM
    exp = explain_load(report.metadata, spec, progress=lambda ranks: progress(
        ranks, desc="planning", unit="rank", enabled=not args.json))
    if args.json:
        print_json({"checkpoint": str(path), "complete": report.complete, "checkpoint_problems": report.problems,
                    **exp.to_json()})
    else:
        _print_human(path, exp, report.complete, args.keys)
        for problem in report.problems:
            print(f"  checkpoint: {problem}")
    return EXIT_OK if report.complete and not exp.problems else EXIT_PROBLEM
