"""The broadcast read executor on real gloo ranks, driven through the core load pipeline."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.metadata import metadata_from_json
from hyper_parallel_dcp.core.planner import LoadItemType
from hyper_parallel_dcp.core.standard_planner import StandardLoadPlanner
from hyper_parallel_dcp.core.storage import StorageReader
from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_fs import FileSystemReader

WORLD = 3


def _reference():
    g = torch.Generator().manual_seed(7)
    ref = {f"small.{i:02d}": torch.randn(3 + i % 4, generator=g) for i in range(20)}
    ref["big"] = torch.randn(64, 32, generator=g)
    ref["half"] = torch.randn(7, 5, generator=g).bfloat16()
    ref["mask"] = torch.rand(9, generator=g) > 0.5
    ref["ids"] = torch.randint(0, 1000, (11,), generator=g)
    ref["transposed"] = torch.randn(6, 10, generator=g)
    ref["scale"] = torch.tensor(3.5)  # 0-dim
    ref["optim"] = {"step": 12, "lr": [0.1, 0.01], "note": "adam"}
    return ref


def _targets(ref):
    sd = {}
    for k, v in ref.items():
        if k == "transposed":
            # a non-contiguous target view: the broadcast must not write past its strides
            sd[k] = torch.zeros(v.shape[1], v.shape[0]).t()
        elif isinstance(v, torch.Tensor):
            sd[k] = torch.zeros_like(v)
        else:
            sd[k] = {"step": 0, "lr": [0.0, 0.0], "note": ""}
    return sd


def _mismatches(sd, ref):
    bad = []
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            if sd[k].dtype != v.dtype or not torch.equal(sd[k], v):
                bad.append(k)
        elif sd[k] != v:
            bad.append(k)
    return bad


def _save(tmp_path, ref):
    from hyper_parallel_dcp.core.pipeline import save_state_dict
    from hyper_parallel_dcp.storage_fs import FileSystemWriter

    path = str(tmp_path / "ckpt")
    save_state_dict(ref, FileSystemWriter(path, sync_files=False), no_dist=True)
    return path


class _NoStreamReader(StorageReader):
    """A reader with only the required interface (no ``read_items``): the generic path."""

    def __init__(self, path):
        self.inner = FileSystemReader(path)

    def reset(self, checkpoint_id=None):
        self.inner.reset(checkpoint_id)

    def load_metadata(self):
        return self.inner.load_metadata()

    def set_up_storage_reader(self, metadata, *, is_coordinator, rank=0):
        self.inner.set_up_storage_reader(metadata, is_coordinator=is_coordinator, rank=rank)

    def execute_read(self, plan, planner):
        self.inner.execute_read(plan, planner)


class _MinimalReader(StorageReader):
    """Only the abstract methods, reading with the ``safetensors`` library itself (as a
    third-party reader would): broadcast loads reach it through the default
    ``read_into`` / ``read_object``, which run ``execute_read`` on one-item plans."""

    def __init__(self, path):
        self.path = Path(path)
        self.metadata = None
        self.bytes_read = 0
        self.plans_executed = 0

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def load_metadata(self):
        return metadata_from_json((self.path / ".metadata").read_bytes())

    def set_up_storage_reader(self, metadata, *, is_coordinator, rank=0):
        # with collectives only the coordinator reads .metadata; every rank gets it here
        self.metadata = metadata

    def execute_read(self, plan, planner):
        from safetensors import safe_open

        from hyper_parallel_dcp.core.objects import deserialize_object

        self.plans_executed += 1
        for item in plan.items:
            info = self.metadata.storage_data[item.storage_index]
            file = self.path / info.relative_path
            if item.type is LoadItemType.BYTE_IO:
                with open(file, "rb") as f:
                    f.seek(info.offset)
                    blob = f.read(info.length)
                self.bytes_read += len(blob)
                planner.load_bytes(item, deserialize_object(blob, fqn=item.storage_index.fqn, file=str(file)))
                continue
            with safe_open(str(file), framework="pt") as f:
                stored = f.get_slice(info.key)
                data = stored[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
            data = data.reshape(item.lengths)  # a 0-d chunk comes back 0-d already
            self.bytes_read += data.numel() * data.element_size()
            target = planner.resolve_tensor(item)
            target.copy_(data)
            planner.commit_tensor(item, target)


def _load_variants(rank, world_size, path, ref):
    from hyper_parallel_dcp.broadcast import make_read_executor
    from hyper_parallel_dcp.core.pipeline import load_state_dict

    out = {}
    variants = {
        "off": None,
        "unbatched": dict(batch_bytes=0),
        "batched": dict(),
        "one_in_flight": dict(batch_bytes=0, max_in_flight=1),
        "tiny_batches": dict(batch_bytes=64),
    }
    for name, kwargs in variants.items():
        sd = _targets(ref)
        reader = FileSystemReader(path)
        ex = None if kwargs is None else make_read_executor(**kwargs)
        load_state_dict(sd, reader, read_executor=ex)
        stats = None if ex is None else (ex.stats.broadcasts, ex.stats.batched_broadcasts, ex.stats.bytes_broadcast,
                                         ex.stats.replicated_shards, ex.stats.groups_created)
        out[name] = (_mismatches(sd, ref), reader.bytes_read, stats)
    # a caller's entry for the whole world: the default group is used (the same on every rank)
    import torch.distributed as dist

    group = dist.new_group(ranks=list(range(world_size)))
    ex = make_read_executor(groups={tuple(range(world_size)): group})
    sd = _targets(ref)
    reader = FileSystemReader(path)
    load_state_dict(sd, reader, read_executor=ex)
    out["prebuilt"] = (_mismatches(sd, ref), reader.bytes_read, (ex.stats.groups_used, ex.stats.groups_created))
    # Rank 2 loads only "big": the other keys form the replica group (0, 1).
    subset = {k: v for k, v in ref.items() if k == "big" or rank < 2}
    pair = dist.new_group(ranks=[0, 1])
    for name, groups in (("subset_lazy", None), ("subset_prebuilt", {(0, 1): pair} if rank < 2 else None)):
        ex = make_read_executor(groups=groups)
        sd = _targets(subset)
        load_state_dict(sd, FileSystemReader(path), read_executor=ex)
        out[name] = (_mismatches(sd, subset), 0, (ex.stats.groups_used, ex.stats.groups_created))
    sd = _targets(ref)
    plain = _NoStreamReader(path)
    load_state_dict(sd, plain, read_executor=make_read_executor())
    out["generic_reader"] = (_mismatches(sd, ref), plain.inner.bytes_read, None)
    sd = _targets(ref)
    minimal = _MinimalReader(path)
    load_state_dict(sd, minimal, read_executor=make_read_executor())
    out["minimal_reader"] = (_mismatches(sd, ref), minimal.bytes_read, minimal.plans_executed)
    return out


@pytest.mark.distributed
def test_replicated_state_is_read_once_and_broadcast(tmp_path):
    ref = _reference()
    path = _save(tmp_path, ref)
    md = FileSystemReader(path).load_metadata()
    object_bytes = sum(info.length for idx, info in md.storage_data.items() if idx.offset is None)
    tensor_bytes = sum(v.numel() * v.element_size() for v in ref.values() if isinstance(v, torch.Tensor))
    n_tensors = sum(isinstance(v, torch.Tensor) for v in ref.values())

    results = run_distributed(_load_variants, WORLD, path, ref, timeout=240)

    for rank, out in enumerate(results):
        for name, (bad, _, _) in out.items():
            assert bad == [], f"rank {rank}, {name}: wrong values for {bad}"
    total = {name: sum(out[name][1] for out in results) for name in results[0]}
    # the minimal reader ran one one-item plan per read: each tensor once, each object on every rank
    n_objects = sum(1 for idx in md.storage_data if idx.offset is None)
    assert sum(out["minimal_reader"][2] for out in results) == n_tensors + WORLD * n_objects
    # every rank reads its own copy of the non-tensor state in every mode
    assert total["off"] == WORLD * tensor_bytes + WORLD * object_bytes
    for name in ("unbatched", "batched", "one_in_flight", "tiny_batches", "generic_reader", "minimal_reader",
                 "prebuilt"):
        assert total[name] == tensor_bytes + WORLD * object_bytes, name
    for out in results:
        unbatched, batched = out["unbatched"][2], out["batched"][2]
        assert unbatched[3] == n_tensors  # every tensor is one replicated shard of group (0, 1, 2)
        assert unbatched[0] == n_tensors and unbatched[1] == 0  # > 8: the in-flight limit is exercised
        # same payload, far fewer broadcasts: one per (reader, dtype) at most
        assert batched[2] == unbatched[2] == tensor_bytes
        assert 1 <= batched[0] <= WORLD * 4 < n_tensors
        assert batched[1] >= 1
        assert out["tiny_batches"][2][2] == tensor_bytes
        assert batched[4] == 0  # the one replica group (0, 1, 2) is the default group: nothing created
        assert out["prebuilt"][2] == (1, 0)
    for rank, out in enumerate(results):
        # (0, 1) is created for the load unless the caller passes it; rank 2 is in no such group
        assert out["subset_lazy"][2] == ((2, 1) if rank < 2 else (1, 0)), rank
        assert out["subset_prebuilt"][2] == ((2, 0) if rank < 2 else (1, 0)), rank


class _FailingReader(FileSystemReader):
    """Fails to read one FQN, on whichever rank is told to read it."""

    def __init__(self, path, fqn):
        super().__init__(path)
        self.failing_fqn = fqn

    def _maybe_fail(self, item):
        if item.dest_index.fqn == self.failing_fqn:
            raise OSError(f"injected read failure for {self.failing_fqn} on rank {self.rank}")

    def read_into(self, item, dest):
        self._maybe_fail(item)
        return super().read_into(item, dest)


def _load_with_failing_reader(rank, world_size, path, ref, batch_bytes, read_ahead_min_bytes):
    from hyper_parallel_dcp.broadcast import executor, make_read_executor
    from hyper_parallel_dcp.core.pipeline import load_state_dict

    if read_ahead_min_bytes is not None:
        executor.READ_AHEAD_MIN_BYTES = read_ahead_min_bytes
    sd = _targets(ref)
    try:
        load_state_dict(sd, _FailingReader(path, "big"),
                        read_executor=make_read_executor(batch_bytes=batch_bytes))
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("read_ahead_min_bytes", [None, 0], ids=["inline", "read_ahead_thread"])
@pytest.mark.parametrize("batch_bytes", [0, 1 << 20])
def test_a_read_failure_on_the_reading_rank_fails_every_rank_without_a_hang(tmp_path, batch_bytes,
                                                                          read_ahead_min_bytes):
    ref = _reference()
    path = _save(tmp_path, ref)
    results = run_distributed(_load_with_failing_reader, WORLD, path, ref, batch_bytes, read_ahead_min_bytes,
                              timeout=180)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} did not fail"
        assert "injected read failure for big" in res[1], res


class _ThreadRecordingReader(FileSystemReader):
    """Records which thread read each FQN."""

    def __init__(self, path):
        super().__init__(path)
        self.threads = {}

    def read_into(self, item, dest):
        self.threads[item.dest_index.fqn] = threading.current_thread().name
        return super().read_into(item, dest)


def _load_recording_threads(rank, world_size, path, ref, read_ahead_min_bytes):
    from hyper_parallel_dcp.broadcast import executor, make_read_executor
    from hyper_parallel_dcp.core.pipeline import load_state_dict

    if read_ahead_min_bytes is not None:
        executor.READ_AHEAD_MIN_BYTES = read_ahead_min_bytes
    # "big" is loaded on rank 0 only: it is in no replica group, rank 0's tail
    wanted = {k: v for k, v in ref.items() if isinstance(v, torch.Tensor) and (k != "big" or rank == 0)}
    sd = _targets(wanted)
    reader = _ThreadRecordingReader(path)
    ex = make_read_executor(batch_bytes=0)
    load_state_dict(sd, reader, read_executor=ex)
    return _mismatches(sd, wanted), reader.threads, ex.stats.tail_items


@pytest.mark.distributed
@pytest.mark.parametrize("read_ahead_min_bytes", [None, 0], ids=["default", "every_size"])
def test_shards_read_for_groups_go_on_the_read_ahead_thread_from_its_size_and_the_tail_never(
        tmp_path, read_ahead_min_bytes):
    ref = _reference()
    path = _save(tmp_path, ref)
    results = run_distributed(_load_recording_threads, WORLD, path, ref, read_ahead_min_bytes, timeout=180)
    main = threading.main_thread().name
    for rank, (bad, threads, tail_items) in enumerate(results):
        assert bad == [], f"rank {rank}: wrong values for {bad}"
        assert tail_items == (1 if rank == 0 else 0)
        group_reads = {k: t for k, t in threads.items() if k != "big"}
        # the test's state dict is far below READ_AHEAD_MIN_BYTES: by default no thread
        expected = main if read_ahead_min_bytes is None else "hp-dcp-read-ahead"
        assert set(group_reads.values()) <= {expected}, (rank, group_reads)
    assert results[0][1]["big"] == main  # the tail: on the calling thread, in either case
    assert "big" not in results[1][1] and "big" not in results[2][1]
    # every replicated tensor was read by exactly one rank (the readers share them out)
    assert sum(1 for _, threads, _ in results if set(threads) - {"big"}) >= 2
    read_by = [k for _, threads, _ in results for k in threads if k != "big"]
    assert sorted(read_by) == sorted(k for k, v in ref.items() if isinstance(v, torch.Tensor) and k != "big")


class _PlannerWithoutShards(StandardLoadPlanner):
    """A planner that cannot hand out whole shards on one rank (``resolve_shard`` fails)."""

    def __init__(self, failing_rank):
        super().__init__()
        self.failing_rank = failing_rank

    def resolve_shard(self, dest_index):
        if self.rank == self.failing_rank:
            raise NotImplementedError(f"no shard views on rank {self.rank}")
        return super().resolve_shard(dest_index)


def _load_with_failing_planner(rank, world_size, path, ref):
    from hyper_parallel_dcp.broadcast import make_read_executor
    from hyper_parallel_dcp.core.pipeline import load_state_dict

    try:
        load_state_dict(_targets(ref), FileSystemReader(path), _PlannerWithoutShards(1),
                        read_executor=make_read_executor())
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.distributed
def test_a_planner_failure_on_one_rank_before_the_groups_exist_fails_every_rank(tmp_path):
    ref = _reference()
    path = _save(tmp_path, ref)
    results = run_distributed(_load_with_failing_planner, WORLD, path, ref, timeout=180)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} did not fail"
        assert "no shard views on rank 1" in res[1], res
