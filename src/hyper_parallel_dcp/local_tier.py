"""``LocalTier``: frequent checkpoints into node-local storage, replicated to peers on other nodes.

A background thread saves each rank's copy into ``dir/step_N/rank_R`` (:mod:`.local_copies`),
sends it to its replica peers over a gloo group and commits every copy once all are written.
:meth:`LocalTier.restore` loads the newest step every rank's copy survives; a step saved by
another world size is loaded resharded from the merged old copies (:class:`CopiesReader`).
Exports :class:`LocalTier`.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from hyper_parallel_dcp import api
from hyper_parallel_dcp.async_persist.arena import StagingArena, materialize
from hyper_parallel_dcp.core.collectives import collective_timeout
from hyper_parallel_dcp.core.flatten import flatten_state_dict, match_stored_keys
from hyper_parallel_dcp.core.layout import is_tensor_leaf
from hyper_parallel_dcp.core.load_planning import create_local_load_plan
from hyper_parallel_dcp.core.metadata import Metadata, metadata_from_json
from hyper_parallel_dcp.core.planner import LoadItemType
from hyper_parallel_dcp.core.settings import fault_error, fault_point
from hyper_parallel_dcp.core.standard_planner import StandardSavePlanner
from hyper_parallel_dcp.core.stateful import expand_stateful
from hyper_parallel_dcp.storage_fs import FileSystemReader, merge_rank_metadata
from hyper_parallel_dcp.storage_fs.metadata_io import StoredMetadata

from .local_copies import LocalCopies, LocalTierFullError, Manifest, room_for
from .retention import check_count

__all__ = ["LocalTier", "LocalTierFullError"]

logger = logging.getLogger(__name__)

Payload = tuple[Manifest, torch.Tensor]


def node_identity(node: Union[int, str, None]) -> str:
    """This rank's node: ``node`` if given, else torchrun's ``GROUP_RANK`` (or ``RANK //
    LOCAL_WORLD_SIZE``), else the host name."""
    if node is not None:
        if isinstance(node, bool) or not isinstance(node, (int, str)):
            raise ValueError(f"LocalTier(node=...) must be None, an int or a str, got {node!r}")
        return str(node)
    if os.environ.get("GROUP_RANK"):
        return f"group-{os.environ['GROUP_RANK']}"
    if os.environ.get("LOCAL_WORLD_SIZE") and os.environ.get("RANK"):
        return f"group-{int(os.environ['RANK']) // int(os.environ['LOCAL_WORLD_SIZE'])}"
    return socket.gethostname()


def replica_peers(nodes: list[str], rank: int, replicas: int) -> list[int]:
    """The ranks holding ``rank``'s replicas: the same local rank (modulo the node's size) on
    the next ``replicas`` nodes, nodes ordered by their lowest rank; never ``rank``'s node."""
    order = list(dict.fromkeys(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    here = order.index(nodes[rank])
    local_index = members[nodes[rank]].index(rank)
    peers = []
    for k in range(1, min(replicas, len(order) - 1) + 1):
        ranks = members[order[(here + k) % len(order)]]
        peers.append(ranks[local_index % len(ranks)])
    return peers


def merged_view(copies: dict[int, Metadata], where: dict[int, str]) -> Metadata:
    """One metadata of the old ranks' ``copies`` (old rank -> its copy's metadata), each
    copy's files named by the directory ``where[rank]`` (relative to the reader's root)."""
    parts = {}
    for rank, md in copies.items():
        prefix = where[rank]
        storage = {index: replace(info, relative_path=f"{prefix}/{info.relative_path}")
                   for index, info in (md.storage_data or {}).items()}
        parts[rank] = replace(md, storage_data=storage, files={f"{prefix}/{n}": s for n, s in md.files.items()},
                              header_digests={f"{prefix}/{n}": d for n, d in md.header_digests.items()},
                              rank_objects={})
    return merge_rank_metadata(parts)


def needed_copies(state_dict: dict[str, Any], copies: dict[int, Metadata], rank: int,
                  allow_partial_load: bool) -> set[int]:
    """The old ranks whose copies hold what ``rank``'s ``state_dict`` loads (a chunk stored
    by several, a replicated tensor's, comes from the lowest); raises as a load plans."""
    view = merged_view(copies, {r: str(r) for r in copies})
    flat, _ = flatten_state_dict(expand_stateful(state_dict)[0], is_tensor_leaf)
    flat, _ = match_stored_keys(flat, {}, view.state_dict_metadata)
    plan, _ = create_local_load_plan(flat, view, allow_partial_load=allow_partial_load)
    storage = view.storage_data or {}
    needed = set()
    for item in plan.items:
        if item.type is LoadItemType.BYTE_IO:
            info = view.object_storage(item.storage_index.fqn, rank)
        else:
            info = storage[item.storage_index]
        if info is not None:
            needed.add(int(info.relative_path.split("/", 1)[0]))
    return needed


class CopiesReader(FileSystemReader):
    """Reads ``metadata`` (a :func:`merged_view`) under ``root`` as new rank ``rank``: its
    rank-own objects are the copies old rank ``rank`` saved, else the lowest's (SPEC §4)."""

    def __init__(self, root: Path, metadata: Metadata, rank: int, *, verify: bool) -> None:
        super().__init__(root, verify=verify)
        self._merged, self._new_rank = metadata, rank

    def read_metadata_payload(self) -> StoredMetadata:
        self._is_global = False
        return StoredMetadata(b"", f"{self._root()} (local copies of another world size, merged)", False,
                              self._merged)

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        super().set_up_storage_reader(metadata, is_coordinator=is_coordinator, rank=self._new_rank)


def _text(exc: Optional[BaseException]) -> Optional[str]:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


class LocalTier:
    """Node-local checkpoints every ``interval_steps`` under ``dir`` (tmpfs or local NVMe), kept
    for the newest ``keep_last`` steps, each rank's copy also held by ``replicas`` ranks of
    other nodes.  ``node``: this rank's node (int or str); ``None`` finds it from the launcher.

    Pass to ``CheckpointManager(local=...)``, which calls :meth:`save` and :meth:`restore`
    collectively.  A failed local save (a full disk: :class:`LocalTierFullError` naming the
    directory and the bytes needed) is logged and kept in :attr:`last_error`; it never fails
    training or the persistent tier.  ``ValueError`` for settings out of range.
    """

    def __init__(self, dir: Union[str, os.PathLike], interval_steps: int, keep_last: int = 2, replicas: int = 1,
                 node: Union[int, str, None] = None):
        self.dir = Path(dir)
        self.interval_steps: int = check_count("LocalTier(interval_steps=...)", interval_steps)
        self.keep_last: int = check_count("LocalTier(keep_last=...)", keep_last)
        self.replicas: int = check_count("LocalTier(replicas=...)", replicas, low=0)
        self.node = node_identity(node)
        self.last_error: Optional[BaseException] = None
        #: the last local save: ``step``, ``blocked_s`` (staging), ``bytes`` (this rank's),
        #: ``replica_bytes`` (received); the last restore: ``restored_step``, ``received_bytes``
        self.stats: dict[str, Any] = {}
        self._group: Any = None  # None with _distributed: the default group (gloo: a restore before any save)
        self._nodes: Optional[list[str]] = None
        self._distributed = False
        self._rank, self._world = 0, 1
        self._arena = StagingArena()
        self._job: Optional[threading.Thread] = None

    def due(self, step: int) -> bool:
        return step % self.interval_steps == 0

    def _join(self) -> bool:
        """Whether the job is distributed; sets this rank and the world size."""
        joined = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if joined:
            self._distributed = True
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
        return joined

    def _setup(self) -> None:
        """Once, collectively: a gloo group of its own (the background thread's exchanges must
        not interleave with the training's collectives) and every rank's node."""
        if self._nodes is not None:
            return
        if self._join():
            self._group = dist.new_group(backend="gloo",
                                         timeout=datetime.timedelta(seconds=collective_timeout() or 1800))
        self._nodes = [str(n) for n in self._gather(self.node)]
        if self.replicas and len(set(self._nodes)) < 2 and self._rank == 0:
            logger.warning("local checkpoint tier: all %d rank(s) are on node %s: local copies have no replica on "
                           "another node (a lost node restores from the persistent tier)", self._world, self.node)

    def _gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self._world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _failures(self, error: Optional[BaseException]) -> dict[int, str]:
        """Rank -> what failed there, of every rank's ``error`` (collective)."""
        return {r: text for r, text in enumerate(self._gather(_text(error))) if text}

    def peers(self, rank: int) -> list[int]:
        """The ranks that hold ``rank``'s replicas."""
        assert self._nodes is not None
        return replica_peers(self._nodes, rank, self.replicas)

    def save(self, step: int, state_dict: dict[str, Any]) -> None:
        """Stage ``state_dict`` (blocks until copied; the previous local save is waited for) and
        save it as local ``step`` in the background.  Collective."""
        self._setup()
        self.wait()
        started = time.perf_counter()
        expanded, _ = expand_stateful(state_dict)
        staged, stats = self._arena.stage(expanded)
        self.stats = {"step": step, "blocked_s": time.perf_counter() - started, "bytes": stats.staged_bytes}
        self._job = threading.Thread(target=self._run_save, args=(step, staged, stats.staged_bytes),
                                     name=f"hp-dcp-local-step-{step}", daemon=True)
        self._job.start()

    def wait(self) -> None:
        """Return once the local save in flight has committed or failed (see :attr:`last_error`)."""
        job, self._job = self._job, None
        if job is not None:
            job.join()

    def close(self, wait: bool = True) -> None:
        """Wait for the local save in flight (``wait``), then free the staging memory (unless
        a save still uses it)."""
        if wait:
            self.wait()
        if self._job is None or not self._job.is_alive():
            self._arena.clear()

    def _run_save(self, step: int, staged: Any, nbytes: int) -> None:
        try:
            self._save_step(step, staged, nbytes)
        except Exception as exc:  # noqa: BLE001 - a local save never fails training
            self.last_error = exc
            logger.error("local checkpoint tier: step %d on rank %d failed: %s", step, self._rank, _text(exc))

    def _save_step(self, step: int, staged: Any, nbytes: int) -> None:
        rank, copies = self._rank, LocalCopies(self.dir, self._rank, self._world)
        error: Optional[BaseException] = None
        payload: Payload = ([], torch.empty(0, dtype=torch.uint8))
        try:
            self._arena.complete()
            copies.discard(step, rank)
            with room_for(self.dir, nbytes, f"rank {rank}'s copy of step {step}"):
                fault_error("local.full", rank)
                api.save(materialize(staged, self._arena.slabs), checkpoint_id=copies.copy_dir(step, rank),
                         no_dist=True, planner=StandardSavePlanner(enable_plan_caching=False))
            fault_point("local.write", rank)
            payload = copies.read_payload(step, rank)
        except Exception as exc:  # noqa: BLE001 - exchanged below: every rank gives up on this step
            error = exc
        manifests = self._gather((None if error else payload[0], _text(error)))
        failed = {r: text for r, (_, text) in enumerate(manifests) if text}
        received = [s for s in range(self._world) if rank in self.peers(s)]  # the copies this rank holds
        if not failed:
            try:
                self.stats["replica_bytes"] = self._move(
                    step, [(s, s, p) for s in range(self._world) for p in self.peers(s)],
                    {s: m for s, (m, _) in enumerate(manifests)}, {rank: payload[1]}, copies)
                fault_point("local.replicate", rank)
            except Exception as exc:  # noqa: BLE001
                error = exc
            failed = self._failures(error)
        if failed:
            copies.discard(step, rank, *received)
            self.last_error = error or RuntimeError(
                f"local step {step} not committed: rank {min(failed)} failed: {failed[min(failed)]}")
            if error is not None:
                logger.error("local checkpoint tier: step %d not saved on rank %d: %s", step, rank, _text(error))
            elif rank == 0:
                logger.warning("local checkpoint tier: step %d not committed: rank %s failed: %s", step,
                               min(failed), failed[min(failed)])
            return
        for source in [rank, *received]:
            copies.commit(step, source, self._world)
        deleted = copies.retain(self.keep_last, step, rank)
        if rank == 0:
            logger.info("local checkpoint tier: step %d committed in %s (%d bytes on rank 0, replicas on %s)%s",
                        step, self.dir, self.stats["bytes"], self.peers(0),
                        f"; deleted local step(s) {deleted}" if deleted else "")

    def _payload(self, copies: LocalCopies, step: int, rank: int, manifest: Manifest) -> torch.Tensor:
        """The bytes of ``rank``'s copy as listed; zeros when it cannot be read as listed (the
        receiver waits for that many bytes, and their checksums then fail there: no hang)."""
        try:
            listed, data = copies.read_payload(step, rank)
            if listed == manifest:
                return data
            problem = f"its files are now {listed}, not {manifest}"
        except OSError as exc:
            problem = _text(exc)
        logger.warning("local checkpoint tier: rank %d cannot send rank %d's copy of step %d: %s", self._rank, rank,
                       step, problem)
        return torch.zeros(sum(n for _, n in manifest), dtype=torch.uint8)

    def _move(self, step: int, moves: list[tuple[int, int, int]], manifests: dict[int, Manifest],
              payloads: dict[int, torch.Tensor], into: LocalCopies) -> int:
        """Each ``(copy, src, dst)`` of ``moves``: ``src`` sends ``payloads[copy]``, the bytes of
        old rank ``copy``'s copy (its files: ``manifests[copy]``), to ``dst``, which writes them
        as that copy into ``into``.  A rank receives at most one copy from each ``src``; every
        transfer is in flight at once (no order between ranks can deadlock).  The bytes received."""
        me = self._rank
        requests = [dist.isend(payloads[c], d, group=self._group) for c, s, d in moves if s == me]
        buffers = {s: (c, torch.empty(sum(n for _, n in manifests[c]), dtype=torch.uint8))
                   for c, s, d in moves if d == me}
        requests += [dist.irecv(buffer, s, group=self._group) for s, (_, buffer) in buffers.items()]
        for request in requests:
            request.wait()
        for c, buffer in buffers.values():
            into.write_payload(step, c, manifests[c], buffer)
        return sum(buffer.numel() for _, buffer in buffers.values())

    def restore(self, state_dict: dict[str, Any], persistent_step: Optional[int], *, verify: bool = True,
                allow_partial_load: bool = False) -> Optional[int]:
        """Load the newest local step at least as new as ``persistent_step`` (the persistent
        tier's newest) whose every rank's copy is held by some rank; returns it, or ``None``
        (load from the persistent tier).  A rank whose copy is missing or fails its checksums
        receives the replica's bytes from its holder (and keeps them as its copy again).  A
        step saved by another world size is loaded resharded from the old ranks' copies the
        new ranks hold (:class:`CopiesReader`), each rank receiving those
        its target needs.  Collective; reads nothing from the persistent tier."""
        # the gloo group of the saves, or, before any save, the default group if it is gloo
        # (creating a group costs 0.05-0.15 s of a 0.5 s recovery)
        if self._join() and self._group is None and "gloo" not in str(dist.get_backend()):
            self._setup()
        self.wait()
        rank, copies = self._rank, LocalCopies(self.dir, self._rank, self._world)
        gathered = self._gather((copies.held(), persistent_step))
        persistent_step = gathered[0][1]
        holders: dict[tuple[int, int], dict[int, list[int]]] = {}  # (step, world) -> rank -> holders
        manifests: dict[tuple[int, int], dict[int, Manifest]] = {}  # (step, world) -> rank -> its copy's files
        for holder, (held, _) in enumerate(gathered):
            for (step, world, r), manifest in held.items():
                holders.setdefault((step, world), {}).setdefault(r, []).append(holder)
                manifests.setdefault((step, world), {})[r] = manifest
        for step, world in sorted(holders, key=lambda sw: (sw[0], sw[1] == self._world), reverse=True):
            if persistent_step is not None and persistent_step > step:
                break
            missing = [r for r in range(world) if r not in holders[step, world]]
            if missing:
                if rank == 0:
                    logger.warning("local checkpoint tier: step %d is not complete: no copy of rank(s) %s is left%s",
                                   step, missing[:8], "" if world == self._world else
                                   f" on the {self._world} rank(s) of this job (saved by {world} ranks)")
                continue
            restore = self._restore_step if world == self._world else self._reshard_step
            if restore(step, holders[step, world], manifests[step, world], state_dict, verify, allow_partial_load):
                return step
        if rank == 0 and holders:
            logger.warning("local checkpoint tier: no local step to restore (newest persistent step: %s); "
                           "loading from the persistent tier", persistent_step)
        return None

    def _reshard_step(self, step: int, holders: dict[int, list[int]], manifests: dict[int, Manifest],
                      state_dict: dict[str, Any], verify: bool, allow_partial_load: bool) -> bool:
        """Load ``step`` saved by ``len(holders)`` ranks: each old rank's copy is read by its
        lowest holder, which shares its metadata and sends its bytes to the ranks whose target
        needs them; they load the copies they then hold as one merged checkpoint."""
        rank, copies = self._rank, LocalCopies(self.dir, self._rank, self._world)
        fetched = LocalCopies(self.dir / ".restore" / f"rank_{rank}", rank)
        source = {r: min(hs) for r, hs in holders.items()}
        error: Optional[BaseException] = None
        try:
            mine = {r: (copies.copy_dir(step, r) / ".metadata").read_bytes() for r in source if source[r] == rank}
        except OSError as exc:
            error, mine = exc, {}
        shared = self._gather((mine, _text(error)))
        needed: set[int] = set()
        problems = [f"rank {h}: {text}" for h, (_, text) in enumerate(shared) if text]
        if problems:
            error = error or RuntimeError(f"a local copy's metadata cannot be read on {problems[0]}")
        else:
            try:
                metas = {r: metadata_from_json(data, source=f"local copy of rank {r}, step {step} (on rank {h})")
                         for h, (part, _) in enumerate(shared) for r, data in part.items()}
                needed = needed_copies(state_dict, metas, rank, allow_partial_load)
            except Exception as exc:  # noqa: BLE001 - exchanged below
                error = exc
        wants = self._gather(sorted(needed) if error is None else None)
        received = 0
        if all(w is not None for w in wants):
            where = {r: os.path.relpath(copies.copy_dir(step, r), self.dir) for r in needed}
            for r in sorted(holders):  # one round per old copy: a rank receives each at most once
                dsts = [n for n, w in enumerate(wants) if r in w and n not in holders[r]]
                sends = {r: self._payload(copies, step, r, manifests[r])} if source[r] == rank and dsts else {}
                received += self._move(step, [(r, source[r], n) for n in dsts], manifests, sends, fetched)
                if rank in dsts:
                    where[r] = os.path.relpath(fetched.copy_dir(step, r), self.dir)
            try:
                reader = CopiesReader(self.dir, merged_view({r: metas[r] for r in needed}, where), rank, verify=verify)
                api.load(state_dict, storage_reader=reader, no_dist=True, allow_partial_load=allow_partial_load)
            except Exception as exc:  # noqa: BLE001 - exchanged below
                error = exc
        shutil.rmtree(fetched.directory, ignore_errors=True)
        failed = self._failures(error)
        if failed:
            if rank == 0:
                logger.warning("local checkpoint tier: step %d (saved by %d ranks) cannot be loaded here: rank %d: %s",
                               step, len(holders), min(failed), failed[min(failed)])
            return False
        self.stats = {"restored_step": step, "received_bytes": received, "saved_world_size": len(holders)}
        if rank == 0:
            logger.info("local checkpoint tier: restored step %d, saved by %d ranks, from %s", step, len(holders),
                        self.dir)
        return True

    def forget_after(self, step: int) -> None:
        """The job resumed from persistent ``step``: delete the local copies this rank holds of
        newer steps, so that no later restore mixes them with the new run's (no collective)."""
        dropped = LocalCopies(self.dir, self._rank, self._world).drop_newer(step, self._rank)
        if dropped:
            logger.info("local checkpoint tier: rank %d deleted its copies of local step(s) %s in %s, newer than "
                        "step %d restored from the persistent tier", self._rank, dropped, self.dir, step)

    def _restore_step(self, step: int, holders: dict[int, list[int]], manifests: dict[int, Manifest],
                      state_dict: dict[str, Any], verify: bool, allow_partial_load: bool) -> bool:
        rank, copies = self._rank, LocalCopies(self.dir, self._rank, self._world)
        sources = {r: sorted(hs, key=lambda h, r=r: (h != r, h)) for r, hs in holders.items()}
        attempt = dict.fromkeys(range(self._world), 0)
        pending = set(range(self._world))
        received = 0
        while pending:
            # the same plan on every rank: who fetches its copy from whom this round
            fetch = {r: sources[r][attempt[r]] for r in pending if sources[r][attempt[r]] != r}
            error: Optional[BaseException] = None
            try:
                sends = {dst: self._payload(copies, step, dst, manifests[dst])
                         for dst, src in fetch.items() if src == rank}
                received += self._move(step, [(dst, src, dst) for dst, src in fetch.items()], manifests, sends, copies)
                if rank in pending:
                    api.load(state_dict, checkpoint_id=str(copies.copy_dir(step, rank)), no_dist=True, verify=verify,
                             allow_partial_load=allow_partial_load)
            except Exception as exc:  # noqa: BLE001 - exchanged below
                error = exc
            failed = self._failures(error)
            for r in list(pending):
                if r not in failed:
                    pending.discard(r)
                    continue
                attempt[r] += 1
                where = f"replica on rank {sources[r][attempt[r]]}" if attempt[r] < len(sources[r]) else None
                if rank == r:
                    logger.warning("local checkpoint tier: rank %d's copy of step %d (from rank %d) is not usable: "
                                   "%s; %s", r, step, sources[r][attempt[r] - 1], failed[r],
                                   f"trying the {where}" if where else "no other copy")
                if where is None:
                    return False
        if received:
            copies.commit(step, rank, self._world)  # the fetched copy is this rank's own again
        self.stats = {"restored_step": step, "received_bytes": received}
        if rank == 0:
            logger.info("local checkpoint tier: restored step %d from %s", step, self.dir)
        return True
